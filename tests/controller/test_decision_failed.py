"""A pass of the core that raises half way (a bug) must not strand what it already started:
`Scheduler.decide` raises `DecisionFailed` carrying the commands emitted before the error, the
driver carries them out, and the next decision runs every pool again. Real controller, fake agent
(real `sh -c` processes, real ZeroMQ), the real client."""

from __future__ import annotations

import asyncio

import pytest

import tangram
from tangram.core import commands as cmd
from tangram.core import cpu_pass
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.resources import CPU, Demand
from tangram.core.scheduler import Scheduler


@pytest.mark.swallows_exceptions
async def test_a_pass_that_raises_still_sends_what_it_started(make_controller, make_agent, monkeypatch):
    c = await make_controller()
    await make_agent(c, "n1", cpus=(0, 1))
    real, calls = cpu_pass._start_group, []

    def flaky(ctx, node, group, units, out):  # starts its group, then fails every third time
        real(ctx, node, group, units, out)
        calls.append(len(out))
        if len(calls) % 3 == 0:
            raise RuntimeError("a bug in the CPU pass")

    monkeypatch.setattr(cpu_pass, "_start_group", flaky)
    async with tangram.AsyncClient(c.submit_addr, name="flaky", default_timeout=60) as tg:
        sbs = [await tg.open_sandbox(mem="16MiB") for _ in range(4)]
        execs = asyncio.gather(*(sb.exec("true") for sb in sbs for _ in range(6)))
        results = await asyncio.wait_for(execs, 30)  # without the fix the stranded starts never end
    assert [r.exit_code for r in results] == [0] * 24
    assert len(calls) >= 3  # the pass really failed, with starts made before the error
    node = c.core.cpu.nodes["n1"]
    assert node.free == node.total and not c.core.running and not c.registry.actions


def test_decision_failed_carries_the_commands_emitted_before_the_error(monkeypatch):
    s = Scheduler()
    s.handle(ev.NodeJoined("n1", cpus=(0,), numa=((0,),), mem_mib=1000), 0.0)
    s.handle(ev.SandboxOpened("sb", client="c", mem_mib=10), 0.0)
    monkeypatch.setattr(cpu_pass, "_start_group", _start_then_fail)
    spec = _exec("a")
    try:
        s.handle(ev.ActionSubmitted(spec), 1.0)
    except cmd.DecisionFailed as exc:
        assert isinstance(exc.__cause__, RuntimeError)
        assert [type(x) for x in exc.commands] == [cmd.CreateSandbox, cmd.Spawn]
    else:
        raise AssertionError("the failure did not surface")
    assert "a" in s.running  # the state change behind the Spawn stays: the driver must send it
    monkeypatch.undo()
    s.handle(ev.ActionSubmitted(_exec("b")), 1.5)
    assert s.handle(ev.ActionFinished("a"), 2.0)[1:] == [cmd.Spawn("b", "n1", "sb", (0,), 1, 1.0)]


def _start_then_fail(ctx, node, group, units, out):
    _REAL(ctx, node, group, units, out)
    raise RuntimeError("a bug in the CPU pass")


_REAL = cpu_pass._start_group


def _exec(aid: str) -> ActionSpec:
    return ActionSpec(aid, Kind.EXEC, ((CPU, Demand.fixed(1)),), sandbox="sb", client="c")
