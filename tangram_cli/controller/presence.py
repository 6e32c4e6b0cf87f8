"""Client presence on the submit socket: silence, `ClientGone`, and the status rows.

`liveness` runs as a task of the gateway: a client silent for `client_grace_s` (judged only on
what was read) is gone, and everything it holds is released (`ClientGone` to the core); the same
tick retries outboxes, expires cached finals and gone sessions, and settles held puts. `rows` are
the clients as status shows them: names and counts, never an identity or a token. `Gateway`
inherits these methods.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tangram.core import events as ev
from tangram_cli.controller.replies import ClientState
from tangram_cli.controller.sessions import client_tag
from tangram_cli.controller.wire import unread

log = logging.getLogger("tangram.controller.gateway")


class Presence:
    """Mixed into `Gateway`; uses its socket, clients, registry, outboxes, counters and clock."""

    sock: Any
    wire: Any
    clients: dict[bytes, ClientState]
    registry: Any
    clock: Any
    config: Any
    counters: Any
    outbox: Any
    outstanding: Any
    outbox_bytes: Any
    held: Any

    async def liveness(self) -> None:
        grace = self.config.client_grace_s
        while True:
            await asyncio.sleep(max(0.05, min(1.0, grace / 4)))
            now = self.clock.now()
            waiting = unread(self.wire)  # judge only what was read (and read it next)
            for client in list(self.clients.values()):
                if not waiting and now - client.last_seen > grace:
                    self._client_gone(client, f"silent for {now - client.last_seen:.1f}s")
            self._watch_routes()
            for ident in list(self.outbox):
                self._flush(ident)
            self._expire_finals(now)
            self._expire_gone(now)
            self._settle_puts()
            for name, sb in list(self.registry.sandboxes.items()):
                if sb.closed and sb.busy == 0 and now - sb.opened > 1.0:
                    self.registry.sandboxes.pop(name, None)

    def _client_gone(self, client: ClientState, why: str) -> None:
        """Release everything the client holds (ClientGone); its cached replies stay until they expire."""
        self.clients.pop(client.ident, None)
        self._bury(client)  # its token still counts while its cached replies live (sessions.py)
        self.counters["clients_gone"] += 1
        self._drop_outbox(client.ident)  # its final replies stay in the cache until they expire
        owned = [
            rec for rec in self.registry.sandboxes.values() if rec.client == client.key and not rec.closed
        ]
        busy = any(
            rec.client == client.key for rec in self.registry.actions.values()
        )  # queued, running, leases
        log.info("client %s (%s) %s: releasing its work", client.name, client_tag(client.key), why)
        for rec in owned:
            rec.closed = True
            rec.pending_puts.clear()
            rec.pending_bytes = 0
        self._settle_puts(client.ident)
        if owned or busy:
            self.post(ev.ClientGone(client.key))

    def rows(self) -> list[dict[str, Any]]:
        """The status rows of the clients: names and counts, never an identity or a token."""
        now = self.clock.now()
        return [
            {
                "client": client_tag(c.key),
                "name": c.name,
                "owner": c.owner or c.name,
                "silent_s": round(now - c.last_seen, 3),
                "connected_s": round(now - c.connected, 3),
                "requests": c.requests,
                "outstanding": self.outstanding.get(c.ident, 0),
                "outbox": len(self.outbox.get(c.ident, ())),
                "held_bytes": self.held.get(c.ident, 0) + self.outbox_bytes.get(c.ident, 0),
                "connected": c.route >= 0,
                "refused": c.refused,
                "sandboxes": sum(
                    1 for s in self.registry.sandboxes.values() if s.client == c.key and not s.closed
                ),
            }
            for c in sorted(self.clients.values(), key=lambda c: c.connected)
        ]
