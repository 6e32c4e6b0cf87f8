"""The transport's close under a cancel the reader task does not take."""

from __future__ import annotations

import asyncio

from support.fake_controller import FakeController

from tangram.client.transport import Transport


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
