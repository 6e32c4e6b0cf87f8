"""Stand-ins for verl's tool interface, used by `tangram.integrations.verl` when verl does not import.

Same names and method signatures as `verl.tools.base_tool.BaseTool` and the two classes of
`verl.tools.schemas` the tool uses (verl 0.9), written in plain Python so the adapter imports in a
light client install (no verl, torch, ray or pydantic). Only what a tool and a rollout loop touch is
here: the schema's `type`/`function.name`, `model_dump`/`model_validate`, and `ToolResponse`'s
`text`/`image`/`video`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse"]


@dataclass
class _Function:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass
class OpenAIFunctionToolSchema:
    """An OpenAI function-tool schema: {"type": "function", "function": {name, description, parameters}}."""

    type: str
    function: _Function

    @classmethod
    def model_validate(cls, raw: dict[str, Any]) -> OpenAIFunctionToolSchema:
        fn = dict(raw["function"])
        return cls(
            str(raw["type"]),
            _Function(
                str(fn["name"]),
                str(fn.get("description", "")),
                dict(fn.get("parameters") or {"type": "object", "properties": {}}),
            ),
        )

    def model_dump(self, **_: Any) -> dict[str, Any]:
        f = self.function
        return {
            "type": self.type,
            "function": {"name": f.name, "description": f.description, "parameters": f.parameters},
        }


@dataclass
class ToolResponse:
    """What a tool returns to the rollout loop: text (and, in verl, optional images or videos)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


class BaseTool:
    """verl's tool lifecycle: create an instance per trajectory (or per call), execute calls on it,
    compute its reward, release it."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        schema = tool_schema or self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__} needs a tool schema")
        self.tool_schema = schema
        self.name = schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None
