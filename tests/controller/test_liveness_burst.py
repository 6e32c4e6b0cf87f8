"""Liveness while a burst is read: nobody is judged silent for being busy or descheduled.

Real controller, real ZeroMQ sockets, the in-test fake agent; counts and flags, no timings
asserted beyond the protocol's own intervals."""

from __future__ import annotations

import asyncio
import time

import tangram
from tangram import protocol as p
from tangram_cli.controller.sessions import BEAT_S


async def test_a_client_hears_heartbeats_while_its_requests_are_read(controller, agent, raw_client) -> None:
    """A client that sends requests and no heartbeat of its own still hears from the controller
    about once a `BEAT_S`: its own heartbeat could wait behind a burst of its requests."""
    raw = raw_client(controller.submit_addr)
    await raw.send(p.SandboxOpen(mem_mib=64), 2)
    sb = (await raw.final(2)).msg.body["sandbox"]
    beats = 0
    rid = 10
    end = time.monotonic() + 2.5 * BEAT_S
    while time.monotonic() < end:  # bad requests (an unknown sandbox): read and answered, run nothing
        await raw.send(p.Exec(sb + "-missing", "true", 1, 1), rid)
        while True:
            frames = await asyncio.wait_for(raw.sock.recv_multipart(), 5)
            env = p.decode(frames)
            if isinstance(env.msg, p.Heartbeat):
                beats += 1
                continue
            assert env.request_id == rid and isinstance(env.msg, p.Error)
            break
        rid += 1
        await asyncio.sleep(0.05)
    assert 2 <= beats <= 4, beats
    assert agent.runs == []


async def test_no_accepted_before_a_queued_result(controller, agent, raw_client) -> None:
    """Protocol 1.4: a queued exec gets its final reply and nothing before it."""
    raw = raw_client(controller.submit_addr)
    await raw.send(p.SandboxOpen(mem_mib=64), 2)
    sb = (await raw.final(2)).msg.body["sandbox"]
    for rid in (3, 4, 5):  # two cores, each exec takes both: two of them wait
        await raw.send(p.Exec(sb, "sleep 0.2", 2, 2), rid)
    got: list[tuple[int, str]] = []
    while len(got) < 3:
        env = p.decode(await asyncio.wait_for(raw.sock.recv_multipart(), 10))
        if not isinstance(env.msg, (p.Heartbeat, p.Welcome)):
            got.append((env.request_id, type(env.msg).__name__))
    assert sorted(got) == [(3, "Result"), (4, "Result"), (5, "Result")]


def test_a_client_descheduled_while_replies_arrived_is_not_down(controller_thread) -> None:
    """The transport drains its socket before it judges the controller silent: after this
    process waited for a core, replies that arrived meanwhile count (they were sent in time).
    The controller runs on its own thread, so it answers while this loop is blocked."""

    async def main() -> None:
        async with tangram.AsyncClient(controller_thread) as tg:
            tr = tg._transport
            tr._send(p.encode(p.Heartbeat(), 0, token=tr.token))  # answered while we block
            time.sleep(0.5)  # this loop does not run: the answer waits unread in the socket
            tr._last_recv = time.monotonic() - 10 * tr.heartbeat_s  # what the loop saw last is old
            tr._tick()
            assert not tr._down
            assert tr.reconnects == 0

    asyncio.run(main())
