"""Socket I/O for the controller's ROUTERs without a future per message.

`zmq.asyncio` makes a future (and often a loop callback) for every `recv_multipart` and
`send_multipart`; at thousands of messages a second that bookkeeping costs more than the
messages. The controller instead:

- sends with the socket's synchronous shadow and `NOBLOCK` (`send_now`): a ROUTER never
  blocks on send, it either queues the frames or fails at once (unknown peer with
  `ROUTER_MANDATORY`, or the peer's high-water mark), and the caller decides what a failure
  means (the gateway keeps final replies in a bounded outbox);
- reads with one loop reader on the socket's file descriptor (`serve`): each wake-up drains
  up to `batch` ready messages and hands each to `handle(frames)` synchronously, then yields
  to the loop if more are waiting, so one busy socket cannot starve the others or the timers.

ZeroMQ's descriptor is edge-triggered: it signals when the socket's event state changes, and
any send or receive on the socket may consume that signal. So after every send the reader
schedules one extra check of `EVENTS` (at most one pending per loop iteration), and every
drain ends by checking `EVENTS` again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("tangram.controller.wire")

Handler = Callable[[list[Any]], None]

_readers: dict[int, _Reader] = {}  # id(sync shadow) -> the reader serving it, for send_now's re-check


def shadow(sock: Any) -> zmq.Socket:
    """The synchronous socket behind a `zmq.asyncio` socket (the socket itself if it is sync)."""
    inner = getattr(sock, "_shadow_sock", None)
    return inner if inner is not None else sock


def send_now(sock: Any, frames: list[bytes]) -> bool:
    """Send without waiting; False when the peer is unknown or its queue is full."""
    sync = shadow(sock)
    try:
        sync.send_multipart(frames, zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        log.debug("send failed: %s", exc)
        return False
    finally:
        reader = _readers.get(id(sync))
        if reader is not None:
            reader.poke()
    return True


class _Reader:
    def __init__(self, sock: Any, handle: Handler, *, copy: bool, batch: int) -> None:
        self.sync = shadow(sock)
        self.handle = handle
        self.copy = copy
        self.batch = batch
        self.loop = asyncio.get_running_loop()
        self._poked = False
        self.received = 0

    def poke(self) -> None:
        """Check the socket once more on the next loop iteration (after a send)."""
        if not self._poked:
            self._poked = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._poked = False
        sync, handle = self.sync, self.handle
        for _ in range(self.batch):
            try:
                frames = sync.recv_multipart(zmq.NOBLOCK, copy=self.copy)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ENOTSOCK:
                    return
                raise
            self.received += 1
            try:
                handle(frames)
            except Exception:
                log.exception("message handling failed")
        self.poke()  # more may be waiting: come back after the loop ran its other callbacks


async def serve(sock: Any, handle: Handler, *, copy: bool = True, batch: int = 256) -> None:
    """Read `sock` until cancelled, calling `handle(frames)` for every message (see module doc)."""
    reader = _Reader(sock, handle, copy=copy, batch=batch)
    fd = reader.sync.FD
    _readers[id(reader.sync)] = reader
    reader.loop.add_reader(fd, reader.poke)
    reader.poke()  # messages that arrived before the reader existed raise no new edge
    try:
        await asyncio.Event().wait()
    finally:
        reader.loop.remove_reader(fd)
        _readers.pop(id(reader.sync), None)


__all__ = ["send_now", "serve", "shadow"]
