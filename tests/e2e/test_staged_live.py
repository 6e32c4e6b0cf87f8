"""Staged starts end to end (tangram/core/staging.py, agent/staged.py): a real controller, a real
agent (`python -m agent`, process executor), real sockets. Short execs from several clients keep
the node's cores busy, so most starts are decided before their cores are free; counts only:
every exec ran exactly once and succeeded, each request got one reply, no core is left taken,
and the scheduler really staged (or, with `stage_starts: false`, never did)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tangram
from tests.e2e.conftest import CONFIG, cpus_for_test

pytestmark = pytest.mark.timeout(240)


async def _client(addr: str, name: str, n: int, lanes: int) -> list[int]:
    """``lanes`` sandboxes, each running ``n`` short execs one after another (as a trajectory
    does); each exec appends its number to a file, checked afterwards: each ran exactly once."""
    async with tangram.AsyncClient(addr, name=name, default_timeout=120) as tg:
        sbs = [await tg.open_sandbox(mem="16MiB") for _ in range(lanes)]

        async def lane(k: int) -> list[int]:
            return [(await sbs[k].exec(f"echo {i} >> runs")).exit_code for i in range(n)]

        codes = [c for part in await asyncio.gather(*(lane(k) for k in range(lanes))) for c in part]
        for sb in sbs:
            ran = sorted(int(x) for x in (await sb.get("runs")).split())
            assert ran == list(range(n)), "an action ran twice or never"
            await sb.close()
        assert tg._transport.resent == 0 and tg._transport.stray_replies == 0
        return codes


async def _run(cluster: Any, stage: bool) -> Any:
    config = {**CONFIG, "scheduler": {**CONFIG["scheduler"], "stage_starts": stage}}
    c = await cluster("--executor", "process", "--cpus", cpus_for_test(), config=config)
    results = await asyncio.gather(*(_client(c.submit_addr, f"st-{k}", 60, 4) for k in range(2)))
    assert all(code == 0 for codes in results for code in codes) and sum(map(len, results)) == 480
    assert c.agents.counters["agents_lost"] == 0
    assert not c.registry.actions and not c.agents.deferred
    node = c.core.cpu.nodes["n1"]
    assert node.free == node.total  # every core came back
    assert len(c.core.stages) == 0 and not c.core.running
    return c


async def test_short_execs_are_staged_and_each_runs_once(cluster: Any) -> None:
    c = await _run(cluster, stage=True)
    counters = c.core.counters
    assert counters.get("staged", 0) > 0, counters  # the queue was blocked and starts were staged
    assert counters["finished"] >= 480


async def test_stage_starts_false_never_stages(cluster: Any) -> None:
    c = await _run(cluster, stage=False)
    assert c.core.counters.get("staged", 0) == 0


async def test_a_start_behind_a_mispredicted_long_run_is_given_back_and_runs_on_the_next_free_core(
        cluster: Any) -> None:
    """Adversarial: `echo` has run in milliseconds, so a long `echo ...; sleep 3` is expected to
    end at once and the blocked queue's head is staged behind it. The agent gives that start
    back (agent/staged.py, GIVE_BACK_S) and the controller queues it again, so it runs on the
    other core when that one frees (about 1 s), long before the long one ends (3 s)."""
    if cpus_for_test() != "0-1":
        pytest.skip("needs two cores")
    config = {**CONFIG, "scheduler": {**CONFIG["scheduler"], "stage_starts": True}}
    c = await cluster("--executor", "process", "--cpus", "0-1", config=config)
    async with tangram.AsyncClient(c.submit_addr, name="mispredict", default_timeout=60) as tg:
        fast, slow, other, blocked = [await tg.open_sandbox(mem="16MiB") for _ in range(4)]
        for i in range(20):  # the type's history: milliseconds
            assert (await fast.exec(f"echo {i}")).exit_code == 0
        for sb in (slow, other, blocked):  # placed on the node (only a placed sandbox's exec is staged)
            assert (await sb.exec("true")).exit_code == 0
        ended: list[str] = []

        async def run(sb: Any, cmd: str, name: str) -> None:
            assert (await sb.exec(cmd)).exit_code == 0
            ended.append(name)

        long = asyncio.ensure_future(run(slow, "echo long; sleep 3", "long"))
        await asyncio.sleep(0.3)
        medium = asyncio.ensure_future(run(other, "sleep 1", "medium"))  # the other core
        await asyncio.sleep(0.3)
        await asyncio.gather(long, medium, run(blocked, "echo blocked", "blocked"))
    counters = c.core.counters
    assert counters.get("staged", 0) >= 1 and counters.get("unstaged", 0) >= 1, counters
    assert ended == ["medium", "blocked", "long"], ended  # it ran on the core the medium one freed
    node = c.core.cpu.nodes["n1"]
    assert node.free == node.total and not c.core.stages.overran and len(c.core.stages) == 0
