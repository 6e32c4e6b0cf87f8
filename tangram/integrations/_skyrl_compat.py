"""Stand-ins for SkyRL-Gym's text-environment interface, used by `tangram.integrations.skyrl` when
`skyrl_gym` does not import.

Same names, fields and method signatures as `skyrl_gym.envs.base_text_env` (skyrl-gym 0.4):
`BaseTextEnvStepOutput` is the dict `step` returns, `BaseTextEnv` has `init`/`step`/`close`,
`get_metrics`, `aggregate_metrics` and the `turns`/`max_turns` counters. Plain Python, so the
adapter imports in a light client install.
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["BaseTextEnv", "BaseTextEnvStepOutput", "ConversationType"]

ConversationType = list[dict[str, str]]


class BaseTextEnvStepOutput(TypedDict, total=False):
    observations: ConversationType
    reward: float
    done: bool
    metadata: dict[str, Any]
    postprocessed_action: str | None


class BaseTextEnv:
    """A text-in, text-out environment: `init(prompt)`, then `step(llm_output)` until `done`, then
    `close()`."""

    def __init__(self) -> None:
        self.turns = 0
        self.max_turns = 1
        self.tool_groups: list[Any] = []
        self.tool_to_toolgroup: dict[str, Any] = {}

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        raise NotImplementedError

    def close(self) -> None:
        return None

    def get_metrics(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """Means of the numeric values, per key."""
        sums: dict[str, list[float]] = {}
        for m in metrics:
            for key, value in m.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    sums.setdefault(key, []).append(float(value))
        return {key: sum(values) / len(values) for key, values in sums.items()}

    def __enter__(self) -> BaseTextEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
