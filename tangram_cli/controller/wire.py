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

from tangram.sockio import SocketReader, send_frames, shadow

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


async def serve(
    sock: Any, handle: Callable[[list[Any]], None], *, copy: bool = True, batch: int = 256
) -> None:
    """Read `sock` until cancelled, calling `handle(frames)` for every message."""
    reader = SocketReader(sock, handle, copy=copy, batch=batch)
    _readers[id(reader.sync)] = reader
    try:
        await asyncio.Event().wait()
    finally:
        reader.close()
        _readers.pop(id(reader.sync), None)


__all__ = ["send_now", "serve", "shadow"]
