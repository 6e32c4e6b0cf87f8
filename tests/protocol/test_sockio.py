"""`tangram.sockio.SocketReader` on real ZeroMQ sockets (loopback TCP): every message is handled
once, in order, across drains cut by the batch budget, for a plain socket and for a wrapper that
reads its own way (the controller's submit ROUTER), and messages that come after a drain ended
still wake the reader."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from tangram.sockio import SocketReader, recv_frames


class Wrapper:
    """Like the controller's `SubmitWire`: its own `recv_multipart`, the socket as `sync`."""

    def __init__(self, sync: zmq.Socket[Any]) -> None:
        self.sync = sync
        self.FD = sync.FD
        self.reads = 0

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        self.reads += 1
        return recv_frames(self.sync, flags, copy)


async def _pair(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


async def _until(cond: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


async def _run(wrap: bool) -> None:
    ctx = zmq.Context()
    router, dealer = await _pair(ctx)
    got: list[bytes] = []
    wrapper = Wrapper(router) if wrap else None
    reader = SocketReader(wrapper or router, lambda frames: got.append(bytes(frames[-1])) or 1, batch=16)
    try:
        for i in range(100):  # a burst: drains of 16, each followed by another turn of the loop
            dealer.send(b"%d" % i)
        await _until(lambda: len(got) == 100)
        await asyncio.sleep(0.05)  # quiet: nothing more arrives
        for i in range(100, 103):  # after the drains ended: the reader wakes again
            dealer.send(b"%d" % i)
            await _until(lambda i=i: len(got) == i + 1)
        assert got == [b"%d" % i for i in range(103)]  # each once, in order
        assert reader.received == 103
        if wrapper is not None:
            assert wrapper.reads == 103  # no read that found nothing: the drains asked ZMQ_EVENTS first
    finally:
        reader.close()
        router.close()
        dealer.close()
        ctx.term()


async def test_reader_handles_every_message_once_across_drains() -> None:
    await _run(wrap=False)


async def test_reader_of_a_wrapped_socket_handles_every_message_once() -> None:
    await _run(wrap=True)
