"""A verl tool whose calls run in Tangram sandboxes: `TangramSandboxTool`.

verl's tool lifecycle maps onto a sandbox:

    create(instance_id, create_kwargs={...})  -> a tool instance; its sandbox opens on first use,
                                                 with the task's `files` put in it
    execute(instance_id, {"command": ...})    -> `sandbox.exec(command)`: the output (and exit code)
                                                 as the ToolResponse text, step reward 0.0
    calc_reward(instance_id)                  -> an elastic test run in the sandbox (`{dop}` in the
                                                 test command becomes the granted cores) -> reward
    release(instance_id)                      -> the sandbox is closed

Sandbox state (files) persists between the `execute` calls of one instance. verl 0.9's
`ToolAgentLoop` creates and releases an instance around every single call and passes the
trajectory's `agent_data` to `execute`; the tool then keeps one sandbox per trajectory (per
`agent_data` object) across those calls, and closes it when verl drops the trajectory's
`agent_data` (or on `close_trajectory(agent_data)`). `trajectory_reward(agent_data)` runs the
tests there.

Errors: what the model caused (a non-zero exit, a command killed at its timeout, a call without a
`command`) comes back as response text, as a shell would show it; failures of the cluster itself
(no controller, no capacity, a lost sandbox) raise, and verl's loop turns them into its
"Error executing tool" text or fails the rollout, as for any tool.

Configuration (verl's tool YAML; every key but `type` is a `tangram.integrations._common` option,
plus `command_parameter`, the schema parameter holding the command, "command" by default):

    tools:
      - class_name: tangram.integrations.verl.TangramSandboxTool
        config: {type: native, mem: 2GiB, timeout: 60, test_command: "python3 -m pytest -n {dop}",
                 test_cpus: [1, 8], reward: pytest}

Without `tool_schema` the tool describes itself as `bash(command)`. verl is imported when it is
installed (`BASE == "verl"`: the tool subclasses `verl.tools.base_tool.BaseTool`); otherwise
plain-Python stand-ins with the same signatures are used (`BASE == "fallback"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from tangram.client.aio import AsyncClient, AsyncSandbox, ExecResult
from tangram.errors import ActionTimeout, TangramError
from tangram.integrations import _common as common

log = logging.getLogger(__name__)

try:
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    BASE = "verl"
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # verl absent, or present without its dependencies
    from tangram.integrations._verl_compat import BaseTool, OpenAIFunctionToolSchema, ToolResponse

    BASE = "fallback"
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    if (getattr(exc, "name", None) or "").split(".")[0] != "verl":
        log.warning("verl is installed but does not import (%s); using the stand-in base class", IMPORT_ERROR)

__all__ = ["BASE", "OpenAIFunctionToolSchema", "TangramSandboxTool", "ToolResponse", "default_schema"]

DEFAULT_DESCRIPTION = (
    "Run a shell command in this task's sandbox (sh -c, in the task's working directory). "
    "Files persist between calls; each call starts in the working directory again."
)


def default_schema(parameter: str = "command") -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": DEFAULT_DESCRIPTION,
                "parameters": {
                    "type": "object",
                    "properties": {parameter: {"type": "string", "description": "the shell command to run"}},
                    "required": [parameter],
                },
            },
        }
    )


@dataclass
class _Instance:
    task: common.Task
    opening: asyncio.Future[AsyncSandbox] | None = None
    owned: bool = True  # False: the sandbox belongs to a trajectory and outlives this instance
    last_test: ExecResult | None = None


class TangramSandboxTool(BaseTool):
    """verl `BaseTool` backed by one Tangram sandbox per instance (or per trajectory)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        raw = dict(common.plain(config or {}))
        raw.pop("type", None)  # verl's tool type ("native")
        self.command_parameter = str(raw.pop("command_parameter", "command"))
        self.options = common.Options.from_mapping(raw, default_name="verl-tool")
        super().__init__(config, tool_schema)
        self._instances: dict[str, _Instance] = {}
        self._trajectories: weakref.WeakKeyDictionary[Any, asyncio.Future[AsyncSandbox]] = (
            weakref.WeakKeyDictionary()
        )
        self._client: asyncio.Future[AsyncClient] | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or default_schema(self.command_parameter)

    # ------------------------------------------------------------ verl's lifecycle
    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """A new instance. verl 0.9 passes the sample's `create_kwargs=`; older rollouts passed
        its keys directly: both are read (`files`, `test_command`)."""
        task = common.Task.from_mapping(kwargs.get("create_kwargs", kwargs))
        instance_id = instance_id or uuid.uuid4().hex
        if instance_id in self._instances:
            raise ValueError(f"tool instance {instance_id!r} exists already")
        self._instances[instance_id] = _Instance(task)
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        inst = self._instance(instance_id)
        command = (parameters or {}).get(self.command_parameter)
        if not isinstance(command, str) or not command.strip():
            text = f"error: the call needs a non-empty string parameter {self.command_parameter!r}"
            return ToolResponse(text=text), 0.0, {"error": "bad_arguments"}
        sandbox = await self._sandbox(inst, kwargs.get("agent_data"))
        opts = self.options
        try:
            result = await sandbox.exec(command, cpus=opts.cpus, timeout=opts.timeout)
        except ActionTimeout as exc:
            return (
                ToolResponse(text=common.render_timeout(exc, opts.max_output_chars)),
                0.0,
                {"error": "timeout"},
            )
        text = common.render(result, opts.max_output_chars)
        return ToolResponse(text=text), 0.0, common.exec_metrics(result)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The elastic test run's reward (0.0 when neither the task nor the config names tests)."""
        inst = self._instance(instance_id)
        test = inst.task.test_run(self.options)
        if test is None:
            return 0.0
        sandbox = await self._sandbox(inst, kwargs.get("agent_data"))
        try:
            inst.last_test = await sandbox.exec(test.command, **test.exec_kwargs())
        except ActionTimeout:  # the model's code hangs the tests: no reward, not an error
            return 0.0
        return common.score(inst.last_test, test.reward)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Close the instance's sandbox (not a trajectory's); releasing twice is a no-op."""
        inst = self._instances.pop(instance_id, None)
        if inst is not None and inst.owned and inst.opening is not None:
            sandbox = await _opened(inst.opening)
            if sandbox is not None:
                await sandbox.close()

    # ------------------------------------------------------------ beyond BaseTool
    def sandbox_id(self, instance_id: str) -> str | None:
        """The id of the instance's sandbox (as `tangram status` shows it); None before first use."""
        opening = self._instance(instance_id).opening
        if opening is None or not opening.done() or _failed(opening):
            return None
        return opening.result().id

    def last_test_run(self, instance_id: str) -> ExecResult | None:
        """The `ExecResult` of the instance's last `calc_reward` test run (dop, run_s, output)."""
        return self._instance(instance_id).last_test

    async def trajectory_reward(self, agent_data: Any, **create_kwargs: Any) -> float:
        """`calc_reward` for verl 0.9's per-call instances: the tests run in the trajectory's
        sandbox (opened with `create_kwargs` if no call opened it yet)."""
        instance_id, _ = await self.create(create_kwargs=create_kwargs)
        try:
            return await self.calc_reward(instance_id, agent_data=agent_data)
        finally:
            await self.release(instance_id)

    async def close_trajectory(self, agent_data: Any) -> None:
        """Close the sandbox kept for `agent_data` now, instead of when verl drops it."""
        opening = self._trajectories.pop(agent_data, None)
        sandbox = await _opened(opening) if opening is not None else None
        if sandbox is not None:
            await sandbox.close()

    async def aclose(self) -> None:
        """Close every sandbox this tool opened, then its client."""
        for instance_id in list(self._instances):
            with contextlib.suppress(TangramError):
                await self.release(instance_id)
        for agent_data in list(self._trajectories.keys()):
            with contextlib.suppress(TangramError):
                await self.close_trajectory(agent_data)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            client = await _opened(self._client)
            self._client = None
            if client is not None:
                await client.close()

    # ------------------------------------------------------------ plumbing
    def _instance(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise ValueError(f"unknown tool instance {instance_id!r} (never created, or released)") from None

    async def _get_client(self) -> AsyncClient:
        """One connected client per tool and event loop, shared by all its instances."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop or _failed(self._client):
            opts = self.options
            client = AsyncClient(opts.addr, name=opts.client_name, connect_timeout=opts.connect_timeout)
            self._client, self._client_loop = asyncio.ensure_future(client.connect()), loop
        return await asyncio.shield(self._client)

    async def _open(self, task: common.Task) -> AsyncSandbox:
        client = await self._get_client()
        sandbox = await client.open_sandbox(self.options.image, self.options.mem)
        try:
            for path, data in task.files.items():
                await sandbox.put(path, data)
        except BaseException:
            await asyncio.shield(sandbox.close())
            raise
        return sandbox

    async def _sandbox(self, inst: _Instance, agent_data: Any) -> AsyncSandbox:
        """The instance's sandbox, opened on first use: the trajectory's when verl passes
        `agent_data` (one per trajectory, shared by its per-call instances), else its own."""
        if inst.opening is None or _failed(inst.opening):
            if agent_data is not None:
                inst.opening, inst.owned = self._trajectory(agent_data, inst.task), False
            else:
                inst.opening, inst.owned = asyncio.ensure_future(self._open(inst.task)), True
        return await asyncio.shield(inst.opening)

    def _trajectory(self, agent_data: Any, task: common.Task) -> asyncio.Future[AsyncSandbox]:
        opening = self._trajectories.get(agent_data)
        if opening is None or _failed(opening):
            opening = asyncio.ensure_future(self._open(task))
            self._trajectories[agent_data] = opening
            done = weakref.finalize(
                agent_data, _close_later, asyncio.get_running_loop(), opening, self._closing
            )
            done.atexit = False  # at exit the controller closes the sandboxes of a departed client
        return opening


def _failed(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


async def _opened(fut: asyncio.Future[Any]) -> Any:
    """The future's result, or None when it failed (its error was reported where it was awaited)."""
    try:
        return await asyncio.shield(fut)
    except Exception:  # noqa: BLE001 (any failure of opening means: nothing to close)
        return None


def _close_later(
    loop: asyncio.AbstractEventLoop, opening: asyncio.Future[AsyncSandbox], closing: set[asyncio.Task[None]]
) -> None:
    """weakref.finalize callback of a trajectory's `agent_data`: close its sandbox on the tool's loop
    (the callback may run in any thread, at any point of the garbage collector)."""
    if not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(opening.add_done_callback, lambda fut: _spawn_close(fut, closing))


def _spawn_close(opening: asyncio.Future[AsyncSandbox], closing: set[asyncio.Task[None]]) -> None:
    if opening.cancelled() or opening.exception() is not None:
        return
    task = opening.get_loop().create_task(_quiet_close(opening.result()))
    closing.add(task)
    task.add_done_callback(closing.discard)


async def _quiet_close(sandbox: AsyncSandbox) -> None:
    try:
        await sandbox.close()
    except TangramError as exc:  # the client or the cluster is gone: so is the sandbox
        log.debug("closing %s: %s", sandbox.id, exc)
