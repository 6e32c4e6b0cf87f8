"""A bare ROUTER that plays the controller for one client transport: it reads what the transport
sends (batches split into their messages) and answers what a test tells it to."""

from __future__ import annotations

import asyncio
import secrets

import zmq
import zmq.asyncio

from tangram import protocol as p


class FakeController:
    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.addr = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.ident = b""  # the transport's routing identity, once it sent something
        self._inbox: list[p.Envelope] = []

    async def recv(self, timeout: float = 5.0) -> p.Envelope:
        """The next message from the transport (the items of a batch one by one)."""
        while not self._inbox:
            frames = await asyncio.wait_for(self.router.recv_multipart(), timeout)
            self.ident = frames[0]
            self._inbox.extend(e for e in p.decode_all(frames[1:]) if isinstance(e, p.Envelope))
        return self._inbox.pop(0)

    async def request(self, timeout: float = 5.0) -> p.Envelope:
        """The next message that is not a heartbeat."""
        while True:
            env = await self.recv(timeout)
            if not isinstance(env.msg, p.Heartbeat):
                return env

    async def send(self, msg: p.Message, rid: int = 0) -> None:
        await self.router.send_multipart([self.ident, *p.encode(msg, rid)])

    @staticmethod
    def welcome(epoch: int, minor: int = p.PROTOCOL_MINOR) -> p.Welcome:
        """A durable controller's Welcome with a fresh session token."""
        return p.Welcome(1, minor, epoch, durable=True, session=secrets.token_hex(p.TOKEN_BYTES))

    def close(self) -> None:
        self.router.close(0)
        self.ctx.term()
