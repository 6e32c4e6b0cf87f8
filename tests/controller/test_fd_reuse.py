"""A connection that ends before its descriptor is reused by another client's: the controller
reads the old one's disconnect before it gives the descriptor to the new session's route, so the
new session is answered (sessions.py `_attach`)."""

from __future__ import annotations

import asyncio
import secrets

import zmq

from tangram import protocol as p


async def test_a_new_session_on_a_reused_descriptor_is_answered(controller, raw_client) -> None:
    for i in range(6):
        client = raw_client(controller.submit_addr)
        await client.send(p.Heartbeat(), 0)  # an anonymous connection, answered or not: it ends now
        await asyncio.sleep(0.05)
        client.sock.close(0)
        await asyncio.sleep(0.1)  # the controller closed it: its descriptor is free for the next one
        client.sock = client.ctx.socket(zmq.DEALER)
        client.sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
        client.sock.setsockopt(zmq.LINGER, 0)
        client.sock.connect(controller.submit_addr)
        client.token = None
        await client.send(p.SandboxOpen(), 1)
        env = await client.final(1, timeout=3)
        assert isinstance(env.msg, p.Result), (i, env.msg)
