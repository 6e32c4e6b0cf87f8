"""`wire.unread` on real ZeroMQ sockets (loopback TCP): asking whether a message waits must not
leave it waiting. ZeroMQ's `EVENTS` takes the edge of the socket's descriptor; a message that came
in just before, on a peer's queue that then holds it, raises no new edge, so unless the reader is
poked it stays unread until another peer's first message or a send (the liveness checks of the
gateway and the agent link ask this every half second to second: 1 s stalls of a whole dispatch
run before)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq

from tangram_cli.controller import wire
from tangram_cli.controller.sessions import SubmitWire


async def _until(cond: Any, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.005)
    return True


@pytest.mark.parametrize("wrapped", [False, True], ids=["router", "submit-wire"])
async def test_a_message_seen_waiting_is_read_next(wrapped: bool) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
    target = SubmitWire(router) if wrapped else router
    got: list[bytes] = []
    serving = asyncio.create_task(wire.serve(target, lambda frames: got.append(bytes(frames[-1])) or 1))
    try:
        dealer.send(b"first")
        assert await _until(lambda: got == [b"first"], 10.0)
        await asyncio.sleep(0.05)  # quiet, drained
        dealer.send(b"second")
        time.sleep(0.1)  # (the loop is held) the message reaches the socket and raises its edge
        assert wire.unread(target)  # seen waiting: the edge is taken here
        dealer.send(b"third")  # the same peer's queue is not empty: no new edge from it
        assert await _until(lambda: got == [b"first", b"second", b"third"], 0.5), got
        assert not wire.unread(target)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        router.close()
        dealer.close()
        ctx.term()
