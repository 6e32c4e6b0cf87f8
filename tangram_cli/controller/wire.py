"""Socket I/O for the controller's ROUTERs without a future per message.

Reading is `tangram.sockio.SocketReader` (one loop reader per ROUTER, up to 256 ready messages
per wake-up). Sending is `send_now`: through the socket's synchronous shadow with `NOBLOCK`, so
a ROUTER never blocks on send; it either queues the frames or fails at once (unknown peer with
`ROUTER_MANDATORY`, or the peer's high-water mark), and the caller decides what a failure
means (the gateway keeps final replies in a bounded outbox). A send may consume the edge of
the descriptor, so `send_now` pokes the socket's reader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from tangram import protocol
from tangram.sockio import SocketReader, events_socket, send_frames, shadow

log = logging.getLogger("tangram.controller.wire")

_readers: dict[int, SocketReader] = {}  # id(sync shadow) -> the reader serving it, for send_now's poke


def send_now(sock: Any, frames: list[bytes]) -> bool:
    """Send without waiting; False when the peer is unknown or its queue is full."""
    sync = shadow(sock)
    try:
        if isinstance(sync, zmq.Socket):
            send_frames(sync, frames)
        else:
            sync.send_multipart(frames, zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        log.debug("send failed: %s", exc)
        return False
    finally:
        reader = _readers.get(id(sync))
        if reader is not None:
            reader.poke()
    return True


def unread(sock: Any) -> bool:
    """Whether a message waits on `sock` (a socket `serve`d here), not read yet; its reader then reads
    it next (`SocketReader.unread`: asking ZeroMQ takes the descriptor's edge, which left results
    unread until the peers' next heartbeats — the whole dispatch run stood still for a second in
    about a third of the runs, the liveness checks having asked right as results came in). A socket
    no reader serves is only asked."""
    sync = shadow(sock)
    reader = _readers.get(id(sync))
    if reader is not None:
        return reader.unread()
    events = events_socket(sync)
    return events is not None and bool(events.getsockopt(zmq.EVENTS) & zmq.POLLIN)


OnFail = Callable[[bytes, list[bytes]], None]


class Batcher:
    """Messages to the peers of one ROUTER, held while the controller works through a batch of
    events (`holding`) and sent at the end as one `BATCH` per peer (protocol rule 7): a decision
    that starts 200 actions on one agent sends it one message, and the replies of 200 finished
    actions of one client go to it in one. Only peers that said minor >= `BATCH_MINOR`
    (`can_batch`) get batches; the others, and everything sent outside a hold, go at once.

    A held message that cannot go at release (the peer's queue is full, or it is gone) is
    handed to `on_fail(ident, frames)`, in order, as its sender would have seen `send_now`
    fail; once one chunk to a peer fails, the rest to that peer fail too (order is kept).

    `before_release` (if given) runs once before a release sends anything, and `can_batch` is
    asked again per peer then: a peer that may no longer be sent to (the gateway's client whose
    connection dropped meanwhile) has its messages handed to `on_fail`. So the gateway reads its
    monitor once per released batch, right before the sends, not once per held final."""

    def __init__(self, sock: Any, can_batch: Callable[[bytes], bool], on_fail: OnFail,
                 before_release: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.can_batch = can_batch
        self.on_fail = on_fail
        self.before_release = before_release
        self.depth = 0
        self.held: dict[bytes, list[list[bytes]]] = {}
        self.batches = 0  # batch messages sent
        self.batched = 0  # messages that went in them

    def send(self, ident: bytes, frames: list[bytes]) -> bool:
        """Send `frames` (a message, without the identity) to `ident` now, or hold it."""
        if self.depth and frames[1][0] not in protocol.UNBATCHED and self.can_batch(ident):
            held = self.held.get(ident)
            if held is None:
                self.held[ident] = [frames]
            else:
                held.append(frames)
            return True
        return send_now(self.sock, [ident, *frames])

    def holding(self) -> Batcher:
        """`with batcher.holding():` hold what is sent until the outermost one ends (the batcher is
        its own context manager: no generator per driver batch)."""
        return self

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if not self.depth and self.held:
            self.release()

    def release(self) -> None:
        held, self.held = self.held, {}
        if self.before_release is not None:
            self.before_release()
        for ident, items in held.items():
            failed = not self.can_batch(ident)
            for chunk in protocol.chunks(items):
                message = [ident, *protocol.packed(chunk)]
                if not failed and send_now(self.sock, message):
                    if len(chunk) > 1:
                        self.batches += 1
                        self.batched += len(chunk)
                    continue
                failed = True
                for frames in chunk:
                    self.on_fail(ident, frames)


async def serve(
    sock: Any, handle: Callable[[list[Any]], int | None], *, copy: bool = True, batch: int = 256
) -> None:
    """Read `sock` until cancelled, calling `handle(frames)` for every message (it may return how
    many messages a batch carried: `SocketReader`)."""
    reader = SocketReader(sock, handle, copy=copy, batch=batch)
    _readers[id(reader.sync)] = reader
    try:
        await asyncio.Event().wait()
    finally:
        reader.close()
        _readers.pop(id(reader.sync), None)


__all__ = ["Batcher", "send_now", "serve", "shadow", "unread"]
