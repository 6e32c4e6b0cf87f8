"""The transport's close: under a cancel the reader task does not take, and with other transports of
the process on the same ZeroMQ context."""

from __future__ import annotations

import asyncio
import os

import pytest
from support.fake_controller import FakeController

from tangram import protocol as p
from tangram.client.transport import Transport, shared_context


async def test_close_returns_when_the_reader_task_drops_a_cancel() -> None:
    """Python 3.11's `wait_for` can lose a cancel that crosses the event it waited for (the
    transport's monitor reads use it): `close` must still return, not wait for the task forever."""
    ctl = FakeController()
    transport = Transport(ctl.addr, "stubborn", heartbeat_s=0.2)
    dropped = []

    async def watch(seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            dropped.append(1)  # swallowed, as the race in wait_for does

    try:
        start = asyncio.ensure_future(transport.start())
        hello = await ctl.recv()
        await ctl.send(ctl.welcome(1), hello.request_id)
        await start
        transport._watch = watch  # type: ignore[method-assign]
        await asyncio.sleep(0.3)  # the reader loop is in the stubborn watch now
        await asyncio.wait_for(transport.close(), 5)
        assert dropped and transport._task is not None and transport._task.done()
    finally:
        await transport.close()
        ctl.close()


async def test_transports_share_one_context_and_outlive_each_other() -> None:
    """Every transport of a process uses one ZeroMQ context (one I/O thread); closing one leaves the
    context up and the others working."""
    ctls = [FakeController(), FakeController()]
    transports = [Transport(c.addr, f"t{i}", heartbeat_s=5) for i, c in enumerate(ctls)]
    try:
        for ctl, transport in zip(ctls, transports, strict=True):
            start = asyncio.ensure_future(transport.start())
            hello = await ctl.recv()
            await ctl.send(ctl.welcome(1), hello.request_id)
            await start
        first, second = (t._sock for t in transports)
        assert first is not None and second is not None
        assert first.context is second.context is shared_context()
        await transports[0].close()
        assert not shared_context().closed and shared_context() is second.context
        pending = transports[1].request(p.SandboxClose("sb-1"))
        env = await ctls[1].request()
        assert isinstance(env.msg, p.SandboxClose) and env.msg.sandbox == "sb-1"
        await ctls[1].send(p.Result({"closed": True}), env.request_id)
        reply = await asyncio.wait_for(pending.final, 5)
        assert isinstance(reply.msg, p.Result) and reply.msg.body == {"closed": True}
    finally:
        for transport in transports:
            await transport.close()
        for ctl in ctls:
            ctl.close()


def test_a_forked_process_gets_a_context_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child does not use its parent's context (its I/O thread did not come along); the
    parent's stays referenced, so the child never destroys it."""
    parent = shared_context()
    monkeypatch.setattr(os, "getpid", lambda: -1)
    child = shared_context()
    try:
        assert child is not parent and not child.closed and not parent.closed
        assert shared_context() is child
    finally:
        monkeypatch.undo()
        child.term()
    assert shared_context() is parent
