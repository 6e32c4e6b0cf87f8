"""Bytes the controller holds for clients, and the caps on them.

What a client sends is held by the controller until it is passed on or answered: files put
before a sandbox's first exec (kept until the sandbox is placed, at most 64 MiB per sandbox),
files put to a placed sandbox until its agent answers, the stdin of an exec and the payload of
a call until the action ends, requests held after a restart until their node is back, and final
replies waiting in the client's outbox. Each is charged to its client when it arrives and
released when it goes; the charges are plain counters, so the check costs a few dict reads.

A request that brings bytes (`PUT`, `EXEC` with stdin, `CALL`) is refused at once when they
would take its client past `scheduler.max_client_bytes` (`ERROR OVER_CAP`, not retryable; the
message names the cap and what to do) or the controller past `scheduler.max_held_bytes` for all
clients together (`ERROR RETRY_LATER`: others hold it, so backing off helps). Nothing of a
refused request is kept, and the refusal is cached like any final reply (gateway rule 6).
Counters: `over_cap_client`, `over_cap_global`, and the gauge `held_bytes`.

Kept puts leave the controller inside the agent link (`agents.py` takes a sandbox's
`pending_puts` when it creates it); their charge is settled from the sandbox records when a
check comes near a cap and once a second (`_settle_puts`).

`Gateway` inherits these methods; they use its config, registry, counters, outbox byte counts
and `final`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tangram import protocol
from tangram_cli.controller.replies import ClientState
from tangram_cli.controller.state import Registry

MIB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class Holds:
    """Mixed into `Gateway` (which provides the attributes below)."""

    config: Any
    registry: Registry
    counters: dict[str, int]
    outbox_bytes: dict[bytes, int]
    outbox_total: int
    final: Callable[..., None]

    def _init_holds(self) -> None:
        self.held: dict[bytes, int] = {}  # per client identity: bytes charged (outboxes counted apart)
        self.held_total = 0
        self._put_charges: dict[str, tuple[bytes, int]] = {}  # sandbox -> (owner, its kept puts' bytes)
        self._puts_of: dict[bytes, set[str]] = {}  # owner -> sandboxes with kept puts charged
        self._action_charges: dict[str, tuple[bytes, int]] = {}  # action id -> (owner, stdin/payload)
        self.counters.update(over_cap_client=0, over_cap_global=0, held_bytes=0, finals_not_kept=0)

    # ------------------------------------------------------------ charges
    def _charge(self, ident: bytes, n: int) -> None:
        self.held[ident] = self.held.get(ident, 0) + n
        self.held_total += n
        self.counters["held_bytes"] = self.held_total

    def _uncharge(self, ident: bytes, n: int) -> None:
        left = self.held.get(ident, 0) - n
        if left > 0:
            self.held[ident] = left
        else:
            self.held.pop(ident, None)
        self.held_total -= n
        self.counters["held_bytes"] = self.held_total

    def _charge_action(self, action_id: str, ident: bytes, n: int) -> None:
        if n > 0:
            self._action_charges[action_id] = (ident, n)
            self._charge(ident, n)

    def _release_action(self, action_id: str) -> None:
        """The action's record is gone: its stdin or payload is no longer held."""
        charge = self._action_charges.pop(action_id, None)
        if charge is not None:
            self._uncharge(*charge)

    def _charge_puts(self, sandbox: str, ident: bytes, now_bytes: int) -> None:
        """Set the charge for a sandbox's kept puts to ``now_bytes``."""
        _, before = self._put_charges.get(sandbox, (ident, 0))
        if now_bytes > 0:
            self._put_charges[sandbox] = (ident, now_bytes)
            self._puts_of.setdefault(ident, set()).add(sandbox)
        elif before:
            del self._put_charges[sandbox]
            mine = self._puts_of.get(ident)
            if mine is not None:
                mine.discard(sandbox)
                if not mine:
                    del self._puts_of[ident]
        delta = now_bytes - before
        if delta > 0:
            self._charge(ident, delta)
        elif delta < 0:
            self._uncharge(ident, -delta)

    def _settle_puts(self, ident: bytes | None = None) -> None:
        """Charge kept puts as the sandbox records now hold them (placed, closed or gone: 0)."""
        owners = [ident] if ident is not None else list(self._puts_of)
        for owner in owners:
            for sandbox in list(self._puts_of.get(owner, ())):
                rec = self.registry.sandboxes.get(sandbox)
                held = 0 if rec is None or rec.closed else rec.pending_bytes
                self._charge_puts(sandbox, owner, held)

    # ------------------------------------------------------------ caps
    def _over_bytes_cap(self, client: ClientState, rid: int, size: int) -> bool:
        """Refuse (a cached final reply) a request bringing ``size`` bytes past a cap."""
        ident = client.ident
        cap = self.config.max_client_bytes
        used = self.held.get(ident, 0) + self.outbox_bytes.get(ident, 0)
        if used + size > cap:
            self._settle_puts(ident)
            used = self.held.get(ident, 0) + self.outbox_bytes.get(ident, 0)
            if used + size > cap:
                self.counters["over_cap_client"] += 1
                text = (
                    f"the controller holds {_mib(used)} for this client (files put before their sandbox's "
                    f"first exec, stdin and payloads of unfinished actions, undelivered replies); this "
                    f"request's {_mib(size)} would pass its cap of {_mib(cap)} (scheduler.max_client_bytes): "
                    "exec in the sandboxes you put files to, wait for queued execs, read replies, "
                    "or raise the cap"
                )
                self.final(ident, rid, protocol.Error("OVER_CAP", text, False))
                return True
        total_cap = self.config.max_held_bytes
        if self.held_total + self.outbox_total + size > total_cap:
            self._settle_puts()
            total = self.held_total + self.outbox_total
            if total + size > total_cap:
                self.counters["over_cap_global"] += 1
                text = (
                    f"the controller holds {_mib(total)} for all clients together; this request's "
                    f"{_mib(size)} would pass its cap of {_mib(total_cap)} (scheduler.max_held_bytes); "
                    "back off and resubmit"
                )
                self.final(ident, rid, protocol.Error("RETRY_LATER", text, True))
                return True
        return False


__all__ = ["Holds"]
