"""The client library marks what it resends after a `Welcome` (protocol 1.8), and only to a
controller that reads the mark."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import zmq
import zmq.asyncio

from tangram import protocol as p
from tangram.client.transport import Transport


@pytest.mark.parametrize("minor", [p.RESEND_MINOR, p.RESEND_MINOR - 1])
async def test_resends_after_a_restart_carry_the_flag_for_a_controller_that_reads_it(minor: int) -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    transport = Transport(f"tcp://127.0.0.1:{port}", "marks", heartbeat_s=5.0)
    inbox: list[tuple[bytes, p.Envelope]] = []

    async def recv() -> tuple[bytes, p.Envelope]:
        while not inbox:
            frames = await asyncio.wait_for(router.recv_multipart(), 5)
            inbox.extend((frames[0], e) for e in p.decode_all(frames[1:]) if isinstance(e, p.Envelope))
        return inbox.pop(0)

    def welcome(epoch: int) -> p.Welcome:
        return p.Welcome(1, minor, epoch, durable=True, session=secrets.token_hex(p.TOKEN_BYTES))

    try:
        start = asyncio.ensure_future(transport.start())
        ident, hello = await recv()
        await router.send_multipart([ident, *p.encode(welcome(1), hello.request_id)])
        await start
        pending = transport.request(p.Cancel(target_request_id=3))
        _, first = await recv()
        assert first.request_id == pending.request_id and first.resend is False
        await router.send_multipart([ident, *p.encode(welcome(2), 0)])  # a restarted controller
        while True:
            _, env = await recv()
            if not isinstance(env.msg, p.Heartbeat):
                break
        assert env.request_id == pending.request_id and transport.resent == 1
        assert env.resend is (minor >= p.RESEND_MINOR)
    finally:
        await transport.close()
        router.close(0)
        ctx.term()

