"""Reading a ZeroMQ socket from an asyncio loop without a future per message.

`zmq.asyncio` makes a future (and often a loop callback) for every receive and send; at
thousands of messages a second that bookkeeping costs more than the messages. The controller's
ROUTERs, the client's DEALER and the agent's DEALER therefore all read through one
`SocketReader`: one loop reader on the socket's file descriptor; each wake-up drains up to
`batch` ready messages and hands each to `handle(frames)` synchronously, then comes back on the
next loop iteration if more may wait, so one busy socket cannot starve the loop. Sends go
straight to the synchronous socket with `NOBLOCK` (each user decides what a refused send means)
and then call `poke()`.

ZeroMQ's descriptor is edge-triggered: it signals when the socket's event state changes, and
any send or receive may consume that signal. So every send must `poke()` (at most one check is
pending per loop iteration), and every drain that stopped early checks again.

`send_frames` and `recv_frames` are pyzmq's `send_multipart`/`recv_multipart` without the
per-frame cost of its sugar layer (an `enum.Flag` combined for every frame, a Python frame per
send): plain int flags straight to the backend socket, about 1 us per message instead of 8.

Depends only on pyzmq: the client library and the agent bundle carry it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.backend import Socket as _Backend

log = logging.getLogger("tangram.sockio")

__all__ = ["SocketReader", "events_socket", "recv_frames", "send_frames", "shadow"]

_send, _recv, _get = _Backend.send, _Backend.recv, _Backend.get
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def send_frames(sync: Any, frames: list[Any], flags: int = _NOBLOCK) -> None:
    """`sync.send_multipart(frames, flags)` (copying) for a synchronous socket. ZeroMQ queues a
    message whole: once the first part is taken the others are too, or the first raises."""
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        _send(sync, frame, more)
    _send(sync, frames[-1], flags)


def recv_frames(sync: Any, flags: int = _NOBLOCK, copy: bool = True) -> list[Any]:
    """`sync.recv_multipart(flags, copy=copy)` for a synchronous socket (all parts of one message).
    Each part is received as a `zmq.Frame`, whose `more` says whether another follows: asking the
    socket (`RCVMORE`) instead costs an option lookup through an enum per part, about twice the
    time of the receive itself."""
    frame = _recv(sync, flags, False)
    parts = [frame]
    while frame.more:
        frame = _recv(sync, flags, False)
        parts.append(frame)
    return [f.bytes for f in parts] if copy else parts


def events_socket(sync: Any) -> zmq.Socket | None:
    """The socket whose `ZMQ_EVENTS` says whether a message waits on `sync`: itself, or a wrapper's own
    `sync` (the controller's submit ROUTER); None when there is none."""
    inner = sync if isinstance(sync, zmq.Socket) else getattr(sync, "sync", None)
    return inner if isinstance(inner, zmq.Socket) else None


def shadow(sock: Any) -> zmq.Socket:
    """The synchronous socket behind a `zmq.asyncio` socket (the socket itself if it is sync)."""
    inner = getattr(sock, "_shadow_sock", None)
    return inner if inner is not None else sock


class SocketReader:
    """Serves `sock` on the running loop until `close()` (see the module doc).

    A drain handles at most `batch` messages, counted as `handle` says: it may return how many
    messages one frame list carried (a protocol batch: its items), so a drain of batches does
    not hold the loop 256 times longer than a drain of single messages.

    `copy=False` hands `zmq.Frame`s to `handle` (CURVE's `User-Id` is read from them);
    `before`, if given, runs at the start of every drain (the client flushes the sends that
    libzmq could not take yet)."""

    def __init__(
        self,
        sock: Any,
        handle: Callable[[list[Any]], int | None],
        *,
        copy: bool = True,
        batch: int = 256,
        before: Callable[[], None] | None = None,
    ) -> None:
        self.sync = shadow(sock)
        self.handle = handle
        self.copy = copy
        self.batch = batch
        self.before = before
        self.loop = asyncio.get_running_loop()
        self.received = 0
        self._poked = False
        self._closed = False
        self._fd = self.sync.FD
        # Asked before each receive, so a drain ends without the `zmq.Again` that a receive raises (an
        # exception object built in Python: several microseconds, once per drain).
        self._events = events_socket(self.sync)
        self.loop.add_reader(self._fd, self.poke)
        self.poke()  # messages that arrived before the reader existed raise no new edge

    def unread(self) -> bool:
        """Whether a message waits, not read yet; if so, it is read on the next loop iteration. Asking
        `ZMQ_EVENTS` takes the edge of the descriptor (see the module doc), and one more message on a
        peer's queue that already holds some raises none: without the poke, what waits would stay
        unread until another peer's first message or a send. False for a socket with no `EVENTS`."""
        waiting = self._events is not None and bool(_get(self._events, _EVENTS) & _POLLIN)
        if waiting:
            self.poke()
        return waiting

    def poke(self) -> None:
        """Check the socket on the next loop iteration (at most one check pending)."""
        if not self._poked and not self._closed:
            self._poked = True
            self.loop.call_soon(self._drain)

    def drain(self) -> None:
        """Read what waits, now. Call it before judging a peer silent: after the process was
        descheduled, the loop runs due timers before the reader it woke for, so the last message
        seen may be old while newer ones wait unread."""
        self._drain()

    def _drain(self) -> None:
        self._poked = False
        if self._closed:
            return
        if self.before is not None:
            self.before()
        sync, handle, copy = self.sync, self.handle, self.copy
        recv = recv_frames if isinstance(sync, zmq.Socket) else type(sync).recv_multipart  # a wrapper's own
        budget = self.batch
        events = self._events
        while budget > 0:
            if self._closed:
                return
            try:
                if events is not None and not _get(events, _EVENTS) & _POLLIN:
                    return
                frames = recv(sync, _NOBLOCK, copy)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # closed under us (ENOTSOCK, ETERM), or broken: stop reading
                if exc.errno not in (zmq.ENOTSOCK, zmq.ETERM):
                    log.error("receive failed: %s", exc)
                return
            self.received += 1
            try:
                budget -= handle(frames) or 1
            except Exception:  # one bad message never stops the socket
                budget -= 1
                log.exception("handling a message failed")
        self.poke()  # more may be waiting: come back after the loop ran its other callbacks

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.loop.remove_reader(self._fd)
