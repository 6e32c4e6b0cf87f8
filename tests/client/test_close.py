"""The transport's close under a cancel the reader task does not take."""

from __future__ import annotations

import asyncio
import secrets

import zmq
import zmq.asyncio

from tangram import protocol as p
from tangram.client.transport import Transport


async def test_close_returns_when_the_reader_task_drops_a_cancel() -> None:
    """Python 3.11's `wait_for` can lose a cancel that crosses the event it waited for (the
    transport's monitor reads use it): `close` must still return, not wait for the task forever."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    transport = Transport(f"tcp://127.0.0.1:{port}", "stubborn", heartbeat_s=0.2)
    dropped = []

    async def watch(seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            dropped.append(1)  # swallowed, as the race in wait_for does

    try:
        start = asyncio.ensure_future(transport.start())
        frames = await asyncio.wait_for(router.recv_multipart(), 5)
        hello = p.decode(frames[1:])
        welcome = p.Welcome(1, p.PROTOCOL_MINOR, 1, session=secrets.token_hex(p.TOKEN_BYTES))
        await router.send_multipart([frames[0], *p.encode(welcome, hello.request_id)])
        await start
        transport._watch = watch  # type: ignore[method-assign]
        await asyncio.sleep(0.3)  # the reader loop is in the stubborn watch now
        await asyncio.wait_for(transport.close(), 5)
        assert dropped and transport._task is not None and transport._task.done()
    finally:
        await transport.close()
        router.close(0)
        ctx.term()

