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
