"""`tangram.integrations.verl.TangramSandboxTool` against a real local cluster (`tangram up`).

verl's lifecycle (create -> execute -> calc_reward -> release) maps onto sandbox open, exec, an
elastic test run and close; verl 0.9's ToolAgentLoop (create/execute/release around every call,
`agent_data` passed to execute) keeps one sandbox per trajectory. Where verl is installed
(`pip install verl` with torch, ray, tensordict, transformers, omegaconf) the tool is a subclass of
verl's `BaseTool` and verl's own YAML loader builds it; elsewhere the stand-in base is checked.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import inspect
import socket
from pathlib import Path
from typing import Any

import pytest

from tangram.client.aio import AsyncSandbox
from tangram.errors import BadRequest, ConfigError, ControllerUnreachable, NoCapacity
from tangram.integrations import _verl_compat, verl

from .helpers import FILES, FIX, TEST_OPTIONS, sandboxes_of, wait_for

pytestmark = pytest.mark.timeout(120)
TASK = {"files": FILES}


def make_tool(name: str, **overrides: Any) -> verl.TangramSandboxTool:
    config = {"type": "native", "client_name": name, **TEST_OPTIONS, **overrides}
    return verl.TangramSandboxTool(config, tool_schema=None)


class AgentData:
    """What verl 0.9's ToolAgentLoop passes to `execute` as `agent_data` (the fields a tool may read)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.extra_fields: dict[str, Any] = {}


# ---------------------------------------------------------------- the interface (no cluster)
def test_base_class_is_verls_when_verl_imports() -> None:
    if importlib.util.find_spec("verl") is None:
        assert verl.BASE == "fallback" and verl.IMPORT_ERROR
        assert issubclass(verl.TangramSandboxTool, _verl_compat.BaseTool)
        return
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

    assert verl.BASE == "verl", verl.IMPORT_ERROR
    assert issubclass(verl.TangramSandboxTool, BaseTool)
    assert verl.ToolResponse is ToolResponse
    assert isinstance(make_tool("schema").tool_schema, OpenAIFunctionToolSchema)


@pytest.mark.skipif(verl.BASE != "verl", reason="verl is not installed")
def test_stand_in_has_verls_signatures() -> None:
    from verl.tools.base_tool import BaseTool

    for method in ("__init__", "get_openai_tool_schema", "create", "execute", "calc_reward", "release"):
        real = list(inspect.signature(getattr(BaseTool, method)).parameters)
        assert list(inspect.signature(getattr(_verl_compat.BaseTool, method)).parameters) == real, method
        assert list(inspect.signature(getattr(verl.TangramSandboxTool, method)).parameters) == real, method


@pytest.mark.skipif(verl.BASE != "verl", reason="verl is not installed")
def test_verl_builds_the_tool_from_its_tool_yaml(tmp_path: Path) -> None:
    from verl.tools.tool_registry import initialize_tools_from_config

    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: tangram.integrations.verl.TangramSandboxTool\n"
        "    config: {type: native, mem: 512MiB, test_command: 'python3 t.py {dop}', test_cpus: [1, 4]}\n"
    )
    (tool,) = initialize_tools_from_config(str(path))
    assert isinstance(tool, verl.TangramSandboxTool)
    assert tool.name == "bash" and tool.options.mem == "512MiB"
    assert tool.options.test is not None and tool.options.test.cpus == (1, 4)
    assert tool.tool_schema.function.parameters.required == ["command"]


def test_default_schema_and_config_errors() -> None:
    schema = make_tool("schema").tool_schema.model_dump()
    assert schema["function"]["name"] == "bash"
    assert schema["function"]["parameters"]["required"] == ["command"]
    with pytest.raises(ConfigError, match="test_comand"):
        make_tool("typo", test_comand="pytest")
    with pytest.raises(ConfigError, match="reward"):
        make_tool("bad", reward="vibes")
    with pytest.raises(ConfigError, match="test_cpus"):
        make_tool("bad", test_cpus=[1, 2, 3])


# ---------------------------------------------------------------- against the cluster
async def test_state_persists_between_execute_calls(cluster_home: Path) -> None:
    tool = make_tool("verl-state")
    try:
        iid, created = await tool.create(create_kwargs=TASK)
        assert created.text is None  # as verl's BaseTool: nothing to tell the model on create
        response, reward, metrics = await tool.execute(iid, {"command": "cat calc.py"})
        assert response.text == "def add(a, b):\n    return a - b"  # the task's files are there
        assert reward == 0.0 and metrics["exit_code"] == 0 and metrics["node"] == "local"
        await tool.execute(iid, {"command": "mkdir -p work && echo hello > work/note.txt"})
        response, _, _ = await tool.execute(iid, {"command": "cat work/note.txt; ls"})
        assert response.text.splitlines() == ["hello", "calc.py", "run_tests.py", "work"]
        # the keys of an older rollout's create(instance_id, **create_kwargs) work too
        iid2, _ = await tool.create("older-verl", **TASK)
        response, _, _ = await tool.execute(iid2, {"command": "ls"})
        assert iid2 == "older-verl" and "work" not in response.text  # another instance, another sandbox
    finally:
        await tool.aclose()


async def test_failed_commands_are_responses_not_exceptions(cluster_home: Path) -> None:
    tool = make_tool("verl-errors", timeout=1)
    try:
        iid, _ = await tool.create(create_kwargs=TASK)
        response, reward, metrics = await tool.execute(iid, {"command": "echo out; echo oops >&2; exit 3"})
        assert response.text == "out\n[stderr]\noops\n[exit code 3]"
        assert reward == 0.0 and metrics["exit_code"] == 3
        response, _, metrics = await tool.execute(iid, {"command": "echo partial; sleep 30"})
        assert response.text.startswith("partial\n[command timed out") and metrics == {"error": "timeout"}
        response, _, metrics = await tool.execute(iid, {"cmd": "ls"})  # the model named no command
        assert "'command'" in response.text and metrics == {"error": "bad_arguments"}
        response, _, _ = await tool.execute(iid, {"command": "python3 -c 'print(\"x\" * 20000)'"})
        assert len(response.text) <= tool.options.max_output_chars and "characters cut" in response.text
        response, _, metrics = await tool.execute(iid, {"command": "true"})
        assert response.text == "(no output)" and metrics["exit_code"] == 0  # the sandbox still works
    finally:
        await tool.aclose()


async def test_reward_comes_from_an_elastic_test_run(cluster_home: Path) -> None:
    tool = make_tool("verl-reward")
    plain = make_tool("verl-reward-exit", reward="exit_code")
    untested = make_tool("verl-untested", test_command=None)
    try:
        iid, _ = await tool.create(create_kwargs=TASK)
        assert await tool.calc_reward(iid) == 0.25  # 1 of 4 cases passes with the bug
        run = tool.last_test_run(iid)
        assert run is not None and run.exit_code == 1 and run.dop in (1, 2)
        assert f"workers={run.dop}" in run.stdout  # {dop} became the granted core count
        await tool.execute(iid, {"command": FIX})
        assert await tool.calc_reward(iid) == 1.0

        pid, _ = await plain.create(create_kwargs=TASK)
        assert await plain.calc_reward(pid) == 0.0  # exit code 1: no partial credit
        own, _ = await plain.create(create_kwargs={**TASK, "test_command": "python3 -c 'import calc'"})
        assert await plain.calc_reward(own) == 1.0  # the task's own test command wins
        slow = make_tool("verl-hang", reward="exit_code", test_timeout=1)
        hid, _ = await slow.create(create_kwargs={"test_command": "sleep 30"})
        assert await slow.calc_reward(hid) == 0.0  # tests killed at their timeout: no reward
        await slow.aclose()
        uid, _ = await untested.create(create_kwargs={})
        assert await untested.calc_reward(uid) == 0.0 and untested.sandbox_id(uid) is None
    finally:
        for t in (tool, plain, untested):
            await t.aclose()


async def test_release_closes_the_sandbox(cluster_home: Path) -> None:
    name = "verl-release"
    tool = make_tool(name)
    try:
        iid, _ = await tool.create(create_kwargs=TASK)
        assert tool.sandbox_id(iid) is None  # opened on first use
        await tool.execute(iid, {"command": "true"})
        sandbox_id = tool.sandbox_id(iid)
        assert sandbox_id is not None
        assert await asyncio.to_thread(sandboxes_of, cluster_home, name) == 1
        await tool.release(iid)
        assert await asyncio.to_thread(sandboxes_of, cluster_home, name) == 0
        with pytest.raises(BadRequest, match="closed|unknown sandbox"):  # the cluster knows it is gone
            await AsyncSandbox(tool._client.result(), sandbox_id).exec("true", timeout=10)  # type: ignore[union-attr]
        await tool.release(iid)  # twice: a no-op
        with pytest.raises(ValueError, match="unknown tool instance"):
            await tool.execute(iid, {"command": "true"})
    finally:
        await tool.aclose()


async def test_verl09_loop_keeps_one_sandbox_per_trajectory(cluster_home: Path) -> None:
    """What ToolAgentLoop._call_tool does for every call: create, execute(agent_data=...), release."""
    name = "verl-trajectory"
    tool = make_tool(name)

    async def call(agent_data: AgentData, command: str) -> str:
        iid, _ = await tool.create(create_kwargs=TASK)
        try:
            response, _, _ = await tool.execute(iid, {"command": command}, agent_data=agent_data)
        finally:
            await tool.release(iid)
        return response.text or ""

    first, second = AgentData("req-1"), AgentData("req-2")
    try:
        await asyncio.gather(call(first, "echo one > note.txt"), call(second, "echo two > note.txt"))
        assert await call(first, "cat note.txt") == "one"  # kept across calls of one trajectory ...
        assert await call(second, "cat note.txt") == "two"  # ... and apart from another trajectory's
        assert await asyncio.to_thread(sandboxes_of, cluster_home, name) == 2
        assert await tool.trajectory_reward(first) == 0.25
        await call(first, FIX)
        assert await tool.trajectory_reward(first) == 1.0
        assert first.extra_fields == {}  # verl's own output fields are left alone

        del first  # verl drops the trajectory's agent_data when its run ends
        gc.collect()
        assert await asyncio.to_thread(wait_for, lambda: sandboxes_of(cluster_home, name) == 1)
        await tool.close_trajectory(second)
        assert await asyncio.to_thread(sandboxes_of, cluster_home, name) == 0
    finally:
        await tool.aclose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_cluster_failures_raise(cluster_home: Path) -> None:
    """Not the model's doing: raised, for verl's loop to report as a tool error."""
    tool = make_tool("verl-nocap", mem="60TiB")
    gone = make_tool("verl-gone", addr=f"tcp://127.0.0.1:{free_port()}", connect_timeout=1)
    try:
        iid, _ = await tool.create(create_kwargs=TASK)
        with pytest.raises(NoCapacity):
            await tool.execute(iid, {"command": "true"})
        gid, _ = await gone.create(create_kwargs=TASK)
        with pytest.raises(ControllerUnreachable):
            await gone.execute(gid, {"command": "true"})
    finally:
        await tool.aclose()
        await gone.aclose()
