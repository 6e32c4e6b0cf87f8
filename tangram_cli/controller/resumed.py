"""Requests and owners carried over a controller restart (``recovery.py`` calls these).

A restored sandbox's, lease's or reply's owner becomes a known client, so its silence ends in
`ClientGone` like anyone's; requests held while a sandbox waited for its node, or until the nodes
that were up came back, are handled once that wait ends. `Gateway` inherits these methods (before
`Replies`, whose `restore_final`/`restore_waiting` they extend).
"""

from __future__ import annotations

import logging
from typing import Any

from tangram.errors import InternalError
from tangram_cli.controller.replies import ClientState
from tangram_cli.controller.sessions import client_key

log = logging.getLogger("tangram.controller.gateway")


def _size(blobs: tuple[bytes, ...] | list[bytes]) -> int:
    return sum(len(b) for b in blobs)


class Resumed:
    """Mixed into `Gateway`; uses its clients, cache, registry, clock, `_handle` and `fail`."""

    clients: dict[bytes, ClientState]
    cache: Any
    registry: Any
    clock: Any

    def restore_client(self, ident: bytes) -> None:
        """A restored sandbox's, lease's or reply's owner: known, so its silence ends in ClientGone
        like anyone's, and no one else gets a session for its identity; the first frame whose token
        verifies for it (issued before the restart) resumes its session (sessions.py, rule 5)."""
        if ident not in self.clients:
            now = self.clock.now()
            self.clients[ident] = ClientState(ident, client_key(ident), last_seen=now, connected=now)

    def restore_final(self, key: tuple[bytes, int], kind: str, frames: list[bytes], expires: float) -> None:
        self.restore_client(key[0])
        super().restore_final(key, kind, frames, expires)

    def restore_waiting(self, key: tuple[bytes, int], kind: str) -> None:
        self.restore_client(key[0])
        super().restore_waiting(key, kind)

    def resume(self, sandbox: str) -> None:
        """Handle the requests held while ``sandbox`` waited for its node (adopted or lost now)."""
        rec = self.registry.sandboxes.get(sandbox)
        if rec is None:
            return
        held, rec.deferred = rec.deferred, []
        self.handle_held(held)

    def handle_held(self, held: list[tuple[bytes, int, Any, tuple[bytes, ...]]]) -> None:
        """Handle requests that were held (by sandbox, or until the nodes came back)."""
        for ident, rid, msg, blobs in held:
            self._uncharge(ident, _size(blobs))
            client = self.clients.get(ident)
            if client is None:
                self.restore_client(ident)
                client = self.clients[ident]
            entry = self.cache.get((ident, rid))
            if entry is not None:  # a copy was handled already
                continue
            try:
                self._handle(client, rid, msg, blobs)
            except Exception as exc:
                log.exception("held request failed")
                self.fail(ident, rid, InternalError(f"controller error ({type(exc).__name__})"))
