"""A staged start for an agent of protocol 1.5, which would start a `Spawn(after=...)` at once:
the controller holds it until the result of the action it follows (agent_cpu.py), so the node
never runs two actions on one core. Fake agent (real `sh -c` processes, real ZeroMQ)."""

from __future__ import annotations

import asyncio
from typing import Any

import tangram
from tangram import protocol as p


async def test_an_old_agent_gets_a_staged_spawn_only_after_the_one_it_follows(make_controller, make_agent):
    c = await make_controller(stage_starts=True)
    node = await make_agent(c, "n1", cpus=(0,), minor=p.STAGED_MINOR - 1)
    async with tangram.AsyncClient(c.submit_addr, name="old-agent", default_timeout=60) as tg:
        sbs = [await tg.open_sandbox(mem="16MiB") for _ in range(4)]

        async def lane(sb: Any) -> list[int]:
            return [(await sb.exec("true")).exit_code for _ in range(30)]

        codes = await asyncio.gather(*(lane(sb) for sb in sbs))
    assert codes == [[0] * 30] * 4
    assert c.core.counters.get("staged", 0) > 0  # starts were staged: the hold was exercised
    runs = sorted(node.runs, key=lambda r: r.start)
    assert len(runs) == 120
    for before, after in zip(runs, runs[1:], strict=False):  # one core: never two at once
        assert after.start >= before.end, (before, after)
    assert not c.agents.deferred
