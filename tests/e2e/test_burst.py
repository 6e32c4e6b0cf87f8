"""Bursts far beyond the happy path, with a real agent (`python -m agent`) and real sockets.

Counts, never timings: every request gets exactly one final reply, nothing fails, nothing is
resent, the agent is never dropped, and the controller's caps act as flow control (the client
waits for a slot) rather than as errors that reach rollout code.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tangram
from tests.e2e.conftest import CONFIG, cpus_for_test

pytestmark = pytest.mark.timeout(240)


def _config(**scheduler: Any) -> dict[str, Any]:
    return {**CONFIG, "scheduler": {**CONFIG["scheduler"], **scheduler}}


async def _burst(addr: str, name: str, n: int, sandboxes: int) -> tuple[list[int], Any]:
    """`n` execs submitted at once over `sandboxes` sandboxes, each appending its number to a file
    in its sandbox; returns the exit codes and the transport, after checking that every number
    was written exactly once (each action ran once on the node)."""
    async with tangram.AsyncClient(addr, name=name, default_timeout=200) as tg:
        sbs = [await tg.open_sandbox(mem="16MiB") for _ in range(sandboxes)]
        codes = await asyncio.gather(*(sbs[i % sandboxes].exec(f"echo {i} >> runs") for i in range(n)))
        ran = []
        for sb in sbs:
            ran += [int(x) for x in (await sb.get("runs")).split()]
            await sb.close()
        assert sorted(ran) == list(range(n)), "an action ran twice or never"
        return [r.exit_code for r in codes], tg._transport


async def test_burst_beyond_the_client_cap_is_queued_in_the_client(cluster: Any) -> None:
    """3 clients x 500 execs at once against a per-client cap of 40: the Welcome tells each client
    the cap and the client keeps the rest itself, so the controller refuses nothing."""
    c = await cluster("--executor", "process", "--cpus", cpus_for_test(), config=_config(max_outstanding_per_client=40))
    results = await asyncio.gather(*(_burst(c.submit_addr, f"burst-{k}", 500, 4) for k in range(3)))
    for codes, transport in results:
        assert codes == [0] * 500
        assert transport.resent == 0 and transport.stray_replies == 0
        assert not transport._pending
    g = c.gateway.counters
    assert g["retry_later_client"] == 0, g
    assert g["joined"] == 0 and g["replayed"] == 0, g  # nothing was sent twice
    assert c.agents.counters["agents_lost"] == 0
    assert c.agents.agents["n1"].live
    assert not c.registry.actions  # every action ended and was answered
    assert c.core.snapshot().queued == 0


async def test_burst_beyond_the_global_cap_retries_until_done(cluster: Any) -> None:
    """A global cap (max_queued 30) below what 3 clients keep in flight: refusals happen, the client
    library backs off and resubmits, and still every exec runs exactly once and succeeds."""
    c = await cluster("--executor", "process", "--cpus", cpus_for_test(), config=_config(max_queued=30))
    results = await asyncio.gather(*(_burst(c.submit_addr, f"cap-{k}", 300, 3) for k in range(3)))
    for codes, transport in results:
        assert codes == [0] * 300
        assert transport.stray_replies == 0
    assert c.gateway.counters["retry_later_global"] > 0  # the cap was really reached
    assert c.agents.counters["agents_lost"] == 0
    assert not c.registry.actions
