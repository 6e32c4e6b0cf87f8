"""The agent's DEALER on the event loop without a future per message.

``zmq.asyncio`` makes a future (and a poller with a timer for ``poll``) for every receive and send; at a
thousand actions a second that bookkeeping costs more than the messages. ``Wire`` instead keeps a plain
(synchronous) socket:

- one loop reader on the socket's descriptor (``tangram.sockio.SocketReader``, shared with the controller and
  the client); each wake-up drains up to ``batch`` ready messages and hands each to ``handle(frames)``;
- sends are ``NOBLOCK``: they queue at once or fail at once (``IMMEDIATE`` while cut off, or a full pipe),
  and the caller decides (the agent's outbox); small messages are copied, which is cheaper than
  zero-copy for them; only large blobs go without a copy.

ZeroMQ's descriptor is edge-triggered: it signals when the socket's event state changes, and any send or
receive may consume that signal. So every send schedules one extra check (at most one pending per loop
iteration), and every drain ends by checking ``EVENTS`` again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from tangram import protocol as p
from tangram.certs import HandshakeWatch, handshake_events
from tangram.sockio import SocketReader, send_frames

ZERO_COPY_MIN = 1 << 16  # pyzmq: copying is cheaper than a zero-copy frame below about 64 KiB
# Plain ints: pyzmq's flags are IntFlag enums, and enum arithmetic costs microseconds per frame.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


class Wire:
    def __init__(self, sock: zmq.Socket, handle: Callable[[list[bytes]], int | None], batch: int = 256) -> None:
        self.sock = sock
        self._reader = SocketReader(sock, handle, batch=batch)  # tangram.sockio: one loop reader
        self._closed = False

    def poke(self) -> None:
        """Check the socket on the next loop iteration (at most one check pending)."""
        self._reader.poke()

    def drain(self) -> None:
        """Read what waits, now (``SocketReader.drain``: before judging the controller silent)."""
        self._reader.drain()

    def send(self, frames: list[bytes]) -> None:
        """Queue ``frames`` now; raises ``zmq.Again`` when they cannot go (cut off, or the pipe is full)."""
        try:  # once the first part is queued the others are too (ZeroMQ queues a message whole)
            if sum(len(f) for f in frames) < ZERO_COPY_MIN:
                send_frames(self.sock, frames)
            else:
                send, last = self.sock.send, len(frames) - 1
                for i, frame in enumerate(frames):
                    send(frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=False)
        finally:
            self.poke()

    async def send_within(self, frames: list[bytes], timeout_s: float) -> bool:
        """Send, retrying while the connection is not up yet (``IMMEDIATE``); False after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                self.send(frames)
                return True
            except zmq.Again:
                if time.monotonic() >= end:
                    return False
            await asyncio.sleep(0.01)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._reader.close()
            self.sock.close(linger=0)


__all__: list[Any] = ["ZERO_COPY_MIN", "Wire"]


def agent_socket(ctx: zmq.Context, cfg: Any, curve: Any, liveness: int) -> tuple[zmq.Socket, zmq.Socket]:
    """The agent's DEALER to ``cfg.controller`` (connected) and its monitor of handshake events (made
    before the connect, so no refusal is missed). ``curve``: the agent's CURVE keys, or None; libzmq drops
    the link after ``liveness`` heartbeats of silence."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, cfg.name.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.SNDTIMEO, int(cfg.hello_timeout_s * 1000))  # replies use NOBLOCK anyway
    # Queue only on a live connection: a reply sent while the link is down then fails at once and waits
    # in the agent's outbox for the next Welcome, instead of dying in a pipe when this socket is closed.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    hb_ms = max(100, int(cfg.heartbeat_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, hb_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, hb_ms * liveness)
    sock.setsockopt(zmq.HEARTBEAT_TTL, hb_ms * liveness)
    if curve is not None:  # CURVE client: own keypair, the controller's public key pinned
        curve.apply(sock)
    monitor = sock.get_monitor_socket(handshake_events())
    sock.connect(cfg.controller)
    return sock, monitor


def handshake_refusal(monitor: zmq.Socket | None, cfg: Any, curve: Any) -> Any:
    """A refused handshake (`tangram.certs.KeyRefused`) among the events ``monitor`` holds, else None."""
    watch = HandshakeWatch(cfg.controller, "agent", curve, cfg.name)
    found = None
    while monitor is not None:
        try:
            ev = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError:
            break
        found = watch.seen(int(ev["event"]), int(ev["value"])) or found
    return found


def close_monitor(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    if monitor is not None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)
