"""The gateway's replies to clients: the reply cache, the per-client outbox and backpressure.

Rules 1, 2 and 6 of `gateway.py`: every request gets one final reply, cached per (client
identity, request id) so that a resent request gets it again (LRU, `CACHE_MAX` entries, kept
`CACHE_TTL_S` after the final reply); a final reply the ROUTER cannot send waits in the
client's bounded outbox (order kept) and a full outbox cancels the client's unfinished actions;
a request that would start work past a cap is refused at once with `RETRY_LATER`. Nothing is
sent to a session that is blocked (`sessions.py`, rule 2): its final replies wait in its outbox.
Large cached finals (over `LARGE_FINAL_BYTES`: file contents, long outputs) share a byte budget
(half of `scheduler.max_held_bytes`); past it the oldest are kept as a `NODE_LOST` "result not
kept" reply, as the state file keeps them (`ledger.MAX_ANSWER_BYTES`): a resent `GET` runs again
(the library retries an idempotent request once after `NodeLost`), nothing runs twice.

`Gateway` inherits these methods (as `AgentLink` inherits `GpuCommands`); they use its socket,
clock, config, registry, clients, counters, ledger and `post`. `_init_replies` creates the state
they own: `cache`, `outstanding`, `outbox`, `outbox_bytes`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tangram import protocol
from tangram.core import events as ev
from tangram.errors import ProtocolError
from tangram_cli.controller.config import ControllerConfig
from tangram_cli.controller.ledger import Ledger
from tangram_cli.controller.state import Registry, encode_to
from tangram_cli.controller.wire import Batcher, send_now

log = logging.getLogger("tangram.controller.gateway")

CACHE_MAX = 65536
CACHE_TTL_S = 300.0
LARGE_FINAL_BYTES = 1 << 20  # a cached final over this counts against the cache's byte budget
MAX_OUTBOX_BYTES = 256 << 20  # the default of scheduler.max_client_bytes, which bounds an outbox's bytes


@dataclass
class ClientState:
    """One client session (`sessions.py`)."""

    ident: bytes  # the routing identity: where replies go, never a proof of who sent a frame
    key: str  # the core's client key (`sessions.client_key`: a hash of the identity)
    name: str = ""
    last_seen: float = 0.0  # controller clock
    connected: float = 0.0
    requests: int = 0
    welcomed: bool = False  # said Hello to this controller, or was told its epoch unasked
    token: bytes | None = None  # the session token; None: restored after a restart, not yet back
    alias: bytes = b""  # the token its first frame carried when that was another controller's (sessions.py)
    user: str = ""  # with CURVE: the User-Id (public key) the session is bound to
    owner: str = ""  # what status calls it: the CURVE key's name, else the Hello name
    route: int = -1  # the connection its own frames come over (SRCFD); -1: none now, send nothing
    conn: int = 0  # a new number (sessions.py `_conns`) each time `route` changes: which connection it is
    blocked: bool = False  # a frame of another connection came over this identity since its last own one
    refused: int = 0  # frames refused on this identity (wrong token or key)
    beat_sent: float = 0.0  # when it was last sent a `Heartbeat` (controller clock)
    batches: bool = False  # its Hello said minor >= BATCH_MINOR: its finals may go in batches
    job: str = ""  # its RL job (sessions.py rule 8; "": the default job)


@dataclass(slots=True)
class CacheEntry:
    kind: str
    action_id: str = ""
    final: list[bytes] | None = None
    expires: float = 0.0
    counted: bool = False  # counts toward the client's outstanding requests until its final reply
    size: int = 0  # a large final's bytes while they count in `Replies.cache_large_bytes`
    conn: int = 0  # the client's `conn` its final was handed to (0: not handed to a connection)


class Replies:
    """Mixed into `Gateway` (which provides the attributes below)."""

    sock: Any
    wire: Any  # the submit socket as the gateway reads and sends on it (sessions.SubmitWire)
    clock: Any
    config: ControllerConfig
    registry: Registry
    post: Callable[..., None]
    clients: dict[bytes, ClientState]
    counters: dict[str, int]
    ledger: Ledger
    _touch_gone: Callable[[bytes], int]
    _tag: Callable[[bytes], str]
    _watch_routes: Callable[[], None]
    _conns: Iterator[int]

    def _init_replies(self) -> None:
        self.cache: OrderedDict[tuple[bytes, int], CacheEntry] = OrderedDict()
        self.outstanding: dict[bytes, int] = {}  # per client identity: requests without a final reply
        self.outbox: dict[bytes, deque[tuple[list[bytes], int]]] = {}  # finals the ROUTER could not send
        self.outbox_bytes: dict[bytes, int] = {}
        self.outbox_total = 0  # bytes in all outboxes together
        self._overflowed: set[bytes] = set()  # clients whose work was cancelled for a full outbox
        self._large: deque[tuple[tuple[bytes, int], CacheEntry]] = deque()  # large finals, oldest first
        self.cache_large_bytes = 0  # their bytes (counter `finals_not_kept`: those kept as stubs)
        # finals of one driver batch, one BATCH per client (`Batcher`; `holding` around the batch)
        self.batcher = Batcher(self.wire, self._batches_to, self._keep, self._watch_routes)

    def _batches_to(self, ident: bytes) -> bool:
        client = self.clients.get(ident)
        return client is not None and client.batches and client.route >= 0

    # ------------------------------------------------------------ sending
    def _send(
        self, ident: bytes, msg: protocol.Message, rid: int, blobs: tuple[bytes, ...] | list[bytes] = ()
    ) -> None:
        try:
            frames = encode_to(ident, msg, rid, blobs)
        except ProtocolError as exc:  # e.g. a result too large for one message
            log.error("reply to request %d does not encode: %s", rid, exc)
            frames = encode_to(ident, protocol.Error("INTERNAL", f"reply does not encode: {exc}", False), rid)
        if not send_now(self.wire, frames):
            self.counters["send_dropped"] += 1

    def _send_accepted(self, ident: bytes, rid: int) -> None:
        client = self.clients.get(ident)  # (no monitor read: an Accepted carries nothing of the session)
        if (client is not None and client.route < 0) or not send_now(
            self.wire, [ident, *protocol.encode_trusted(protocol.Accepted(), rid)]
        ):
            self.counters["send_dropped"] += 1

    def final(
        self,
        ident: bytes,
        rid: int,
        msg: protocol.Message,
        blobs: tuple[bytes, ...] | list[bytes] = (),
        trusted: bool = False,
    ) -> None:
        """Send the one final reply to (ident, rid) and cache it. `trusted`: `msg` holds only
        checked values (a typed outcome), so `protocol.encode_trusted` skips the field checks."""
        try:
            frames = (protocol.encode_trusted if trusted else protocol.encode)(msg, rid, blobs)
        except ProtocolError as exc:
            log.error("reply to request %d does not encode: %s", rid, exc)
            frames = protocol.encode(protocol.Error("INTERNAL", f"reply does not encode: {exc}", False), rid)
        key = (ident, rid)
        entry = self.cache.get(key)
        if entry is None:
            entry = CacheEntry("")
            self._cache_put(key, entry)
        elif entry.counted and entry.final is None:
            self._uncount(ident)
        entry.final = frames
        entry.expires = self.clock.now() + CACHE_TTL_S
        self._keep_large(key, entry, frames)
        self.ledger.answered(ident, rid, entry.kind, frames)  # on disk before the client can see it
        entry.conn = self._deliver(ident, frames)

    def _keep_large(self, key: tuple[bytes, int], entry: CacheEntry, frames: list[bytes]) -> None:
        """Count a large final against the cache's byte budget; past it, keep the oldest as stubs."""
        self._forget_large(entry)
        if len(frames) <= 4:  # no blobs: a body alone is at most MAX_BODY_BYTES (= LARGE_FINAL_BYTES)
            return
        size = sum(map(len, frames))
        if size <= LARGE_FINAL_BYTES:
            return
        entry.size = size
        self.cache_large_bytes += size
        large = self._large
        while large and not large[0][1].size:  # already gone from the cache
            large.popleft()
        large.append((key, entry))
        budget = self.config.max_held_bytes // 2
        while self.cache_large_bytes > budget and large:
            (_, rid), old = large.popleft()
            if not old.size:
                continue
            mib = old.size >> 20
            self._forget_large(old)
            self.counters["finals_not_kept"] += 1
            text = (
                f"the request finished and was answered; its {mib} MiB reply is not kept for a resend "
                f"(the controller keeps at most {budget >> 20} MiB of large replies)"
            )
            old.final = protocol.encode(protocol.Error("NODE_LOST", text, False), rid)

    def _forget_large(self, entry: CacheEntry) -> None:
        if entry.size:
            self.cache_large_bytes -= entry.size
            entry.size = 0

    def fail(self, ident: bytes, rid: int, exc: BaseException) -> None:
        self.final(ident, rid, protocol.Error.from_exception(exc))

    # ------------------------------------------------------------ the reply cache
    def _register(self, client: ClientState, rid: int, kind: str, action_id: str = "") -> None:
        """Record a request that will get a final reply; it counts as outstanding until then."""
        key = (client.ident, rid)
        old = self.cache.get(key)
        if old is not None and old.counted and old.final is None:
            self._uncount(client.ident)
        self._cache_put(key, CacheEntry(kind, action_id, counted=True))
        self.outstanding[client.ident] = self.outstanding.get(client.ident, 0) + 1

    def _replay(self, ident: bytes, rid: int, resend: bool = False) -> bool:
        """A copy of a request seen before: its cached final reply again, or `Accepted` again
        when it still waits (a joined request). False when the request id is new. A copy marked
        as a library resend (`resend`, protocol 1.8) whose final reply was already handed to the
        connection the copy came over gets nothing: that reply is on its way (in order, over the
        same connection), and a second one would only be a stray reply to the client."""
        key = (ident, rid)
        entry = self.cache.get(key)
        if entry is None:
            return False
        self.cache.move_to_end(key)
        if entry.final is not None:
            if resend and entry.conn and self._on_its_way(ident, entry.conn):
                self.counters["resends_already_answered"] += 1
                return True
            self.counters["replayed"] += 1
            entry.conn = self._deliver(ident, entry.final)
        else:
            self.counters["joined"] += 1
            if entry.kind in ("exec", "call"):
                rec = self.registry.actions.get(entry.action_id)
                if rec is not None and rec.granted:
                    self._send_accepted(ident, rid)
        return True

    def _cache_put(self, key: tuple[bytes, int], entry: CacheEntry) -> None:
        replaced = self.cache.get(key)
        if replaced is not None and replaced is not entry:
            self._forget_large(replaced)
        self.cache[key] = entry
        self.cache.move_to_end(key)
        now = self.clock.now()
        while len(self.cache) > CACHE_MAX:
            (old_ident, _), old = self.cache.popitem(last=False)
            self._forget_large(old)
            if old.counted and old.final is None:
                self._uncount(old_ident)
        self._expire_finals(now, 4)  # a few old finals per insert (amortised)

    def _expire_finals(self, now: float, most: int | None = None) -> None:
        """Drop the oldest cached finals that expired (at most `most`; all with None)."""
        dropped = 0
        while self.cache and (most is None or dropped < most):
            _, e = next(iter(self.cache.items()))
            if e.final is not None and e.expires < now:
                self.cache.popitem(last=False)
                self._forget_large(e)
                dropped += 1
            else:
                return

    def restore_final(self, key: tuple[bytes, int], kind: str, frames: list[bytes], expires: float) -> None:
        """A final reply from the ledger: a resent request gets it again."""
        self.cache[key] = CacheEntry(kind, final=frames, expires=expires)

    def restore_waiting(self, key: tuple[bytes, int], kind: str) -> None:
        """A request that was running when the controller died: a resent copy joins it and
        waits for the one final reply `final` will give it."""
        self.cache[key] = CacheEntry(kind)

    # ------------------------------------------------------------ backpressure
    def _uncount(self, ident: bytes) -> None:
        n = self.outstanding.get(ident, 0) - 1
        if n > 0:
            self.outstanding[ident] = n
        else:
            self.outstanding.pop(ident, None)

    def _on_its_way(self, ident: bytes, conn: int) -> bool:
        """The client's route is still connection `conn` (`ClientState.conn`)."""
        self._watch_routes()
        client = self.clients.get(ident)
        return client is not None and client.route >= 0 and client.conn == conn

    def _deliver(self, ident: bytes, frames: list[bytes]) -> int:
        """Send a final reply (`frames`, without the identity) now, or keep it in the client's
        bounded outbox (order kept). A session without a route always waits (sessions.py, rules 2
        and 3). While the batcher holds, the monitor is read once at its release instead. Returns
        the `ClientState.conn` it was handed to (0: kept, or sent without a session)."""
        if not self.batcher.depth:
            self._watch_routes()
        client = self.clients.get(ident)
        if client is None:  # gone: sent if its connection is still up; it stays in the cache for a resend
            if self._touch_gone(ident) < 0 or not send_now(self.wire, [ident, *frames]):
                self.counters["send_dropped"] += 1
            return 0
        if client.route >= 0:
            if ident in self.outbox:
                self._flush(ident)
            if ident not in self.outbox and self.batcher.send(ident, frames):
                return client.conn
        self._keep(ident, frames)
        return 0

    def _keep(self, ident: bytes, frames: list[bytes]) -> None:
        """Keep a final reply (`frames` without the identity) in the client's bounded outbox."""
        frames = [ident, *frames]
        size = sum(len(f) for f in frames)
        box = self.outbox.setdefault(ident, deque())
        used = self.outbox_bytes.get(ident, 0)
        if len(box) >= self.config.max_outbox or used + size > self.config.max_client_bytes:
            self.counters["outbox_overflows"] += 1
            if (client := self.clients.get(ident)) is not None:  # a final is dropped: no resend may be
                client.conn = next(self._conns)  # taken for one on its way (`_replay`)
            self._overflow(ident, len(box))
            return
        box.append((frames, size))
        self.outbox_bytes[ident] = used + size
        self.outbox_total += size
        self.counters["outbox_queued"] += 1

    def _flush(self, ident: bytes) -> None:
        self._watch_routes()
        client = self.clients.get(ident)
        if client is None or client.route < 0:
            return
        box = self.outbox.get(ident)
        while box:
            frames, size = box[0]
            if not send_now(self.wire, frames):
                return
            box.popleft()
            entry = self.cache.get((ident, int.from_bytes(frames[3][:8], "big")))
            if entry is not None and entry.final is not None and entry.final[3] is frames[4]:
                entry.conn = client.conn  # handed to this connection now (`_replay`)
            self.outbox_bytes[ident] -= size
            self.outbox_total -= size
        self._drop_outbox(ident)

    def _drop_outbox(self, ident: bytes) -> None:
        """Forget the client's outbox (its final replies stay in the cache until they expire)."""
        self.outbox.pop(ident, None)
        self.outbox_total -= self.outbox_bytes.pop(ident, 0)
        self._overflowed.discard(ident)

    def _overflow(self, ident: bytes, waiting: int) -> None:
        """The client is not reading: cancel its unfinished actions (once until its outbox drains)."""
        if ident in self._overflowed:
            return
        self._overflowed.add(ident)
        victims = [a for a, rec in self.registry.actions.items() if rec.ident == ident and not rec.final_sent]
        log.warning(
            "client %s is not reading: outbox full (%d replies waiting); cancelling %d unfinished actions",
            self._tag(ident),
            waiting,
            len(victims),
        )
        self.counters["outbox_cancelled"] += len(victims)
        for aid in victims:
            self.post(ev.ActionCancelled(aid, f"client not reading: outbox full ({waiting} replies waiting)"))

    def _refuse(self, client: ClientState, rid: int, msg: protocol.Message) -> bool:
        """RETRY_LATER at once when a cap is reached; the request is neither submitted nor recorded."""
        ident = client.ident
        n = self.outstanding.get(ident, 0) + len(self.outbox.get(ident, ()))
        cap = self.config.max_outstanding_per_client
        text = ""
        if n >= cap:
            self.counters["retry_later_client"] += 1
            text = f"client at its cap of {cap} outstanding requests ({n} pending or undelivered)"
        elif _is_action(msg) and len(self.registry.actions) >= self.config.max_queued:
            self.counters["retry_later_global"] += 1
            text = (
                f"controller at its cap of {self.config.max_queued} queued actions "
                f"({len(self.registry.actions)} queued or running)"
            )
        if not text:
            return False
        # Recorded like any final reply: a copy of this request id arriving later (a resend after a
        # lost link) gets this refusal again instead of being admitted, while the client library
        # resubmits the work under a new id; so a refused request can never run as well.
        self.final(ident, rid, protocol.Error("RETRY_LATER", f"{text}; back off and resubmit", True))
        return True


def _is_action(msg: protocol.Message) -> bool:
    """Whether the request becomes a core action (the global cap's unit)."""
    if isinstance(msg, protocol.SandboxOpen):
        return msg.reserve > 0
    return isinstance(msg, (protocol.Exec, protocol.Call, protocol.Lease))
