"""How the agent answers the controller: a mixin of ``link.Agent``, which provides the session's socket
(``_live`` while welcomed), the bounded outbox and whether the controller reads batches.

Every request is answered exactly once (``link``'s rule 3). While welcomed by a controller of protocol
1.5 or newer, the replies of one loop iteration go back as one ``BATCH`` (``tangram.protocol`` rule 7):
requests that arrived together mostly finish together. A reply that cannot be sent (cut off, or the pipe
is full) waits in the outbox, in order, and goes out after the next ``Welcome``."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from tangram import protocol as p
from tangram.errors import InternalError, ProtocolError

from .support import _Outbox, error_reply
from .wire import Wire

log = logging.getLogger("agent")


class ReplySender:
    _live: Wire | None
    _welcomed: bool
    _outbox: _Outbox
    _replies: list[list[bytes]]
    _batches: bool
    _last_out: float

    def _send_on(self, wire: Wire, frames: list[bytes]) -> bool:
        try:
            wire.send(frames)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:  # e.g. a closed socket
            log.warning("send failed: %s", exc)
            return False
        self._last_out = time.monotonic()
        return True

    def _reply(self, rid: int, msg: p.Message, blobs: list[bytes] | tuple[bytes, ...] = ()) -> None:
        try:
            frames = p.encode(msg, rid, blobs)
        except ProtocolError as exc:  # e.g. a result over 64 MiB: say so instead
            log.error("reply to request %d does not encode: %s", rid, exc)
            frames = p.encode(error_reply(InternalError(f"reply does not fit the protocol: {exc}")), rid)
        live = self._live if self._welcomed else None
        if live is not None and self._batches and not self._outbox.items:
            self._replies.append(frames)  # with the others of this loop iteration (`_send_replies`)
            if len(self._replies) == 1:
                asyncio.get_running_loop().call_soon(self._send_replies)
            return
        if live is not None and not self._outbox.items and self._send_on(live, frames):
            return
        self._outbox.push(frames)

    def _send_replies(self) -> None:
        """The replies of one loop iteration, one batch per `BATCH_MAX` (protocol rule 7); what
        cannot go waits in the outbox, in order."""
        items, self._replies = self._replies, []
        live = self._live if self._welcomed else None
        for chunk in p.chunks(items):
            if live is None or self._outbox.items or not self._send_on(live, p.packed(chunk)):
                for frames in chunk:
                    self._outbox.push(frames)

    def _flush_outbox(self, wire: Wire) -> None:
        self._send_replies()
        while self._outbox.items:
            if not self._send_on(wire, self._outbox.items[0]):
                return
            self._outbox.pop()
