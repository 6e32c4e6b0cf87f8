"""The submit ROUTER: client requests -> core events, core commands -> client replies.

Rules (docs/protocol.md, "Controller behaviour"):

1. Every request gets exactly one final reply (`Result` or `Error`) with its request id, and
   (since protocol 1.4) nothing before it: a queued `Exec` or `Call` no longer gets `Accepted`
   (one message less per queued action under a burst; no client waited for it).
2. Replies are cached per (client identity, request id): a resent request joins its pending
   action (`Accepted`, saying it is known) or gets the cached final reply; nothing runs twice. The cache is
   bounded (LRU) and entries expire 5 minutes after their final reply.
3. Bytes that do not decode get `Error(BAD_REQUEST)` (or `VERSION`); the gateway keeps
   serving. Asks the core can never satisfy get `NO_CAPACITY` from the core's `Reject`.
   Sessions (`sessions.py`): a client's sandboxes, leases, requests and replies belong to the
   session its `Welcome` started; only frames carrying that session's token (and, with CURVE,
   its key) reach them, and its replies go only over the connection its own frames come from.
4. A client that says `Bye` (the library does on close), or is silent for `client_grace_s`,
   gets `ClientGone`: its queued and running actions are
   cancelled and its sandboxes and leases released. Clients ping with `Heartbeat`; the gateway
   answers each one, so a client can tell a dead controller from a quiet one.
5. A sandbox has no node before its first action. Puts before that are kept (at most 64 MiB
   per sandbox) and written right after `CreateSandbox`; gets before that read them back.
6. Backpressure: a request that would start work (open, put, get, exec, call, lease) while its
   client has `max_outstanding_per_client` requests pending or replies undelivered, or (for an
   action) while `max_queued` actions are unfinished, gets `Error(RETRY_LATER, retryable)` at
   once; it is not submitted, and the refusal is cached like any final reply (a copy of that
   request id gets the same refusal; the client library resubmits under a new id, so refused
   work never runs twice). Cancel, close and release are never refused. A final reply the
   ROUTER cannot send (HWM, EAGAIN, peer reconnecting) waits in the client's bounded outbox
   and is retried on the client's next message or heartbeat; when the outbox is full, the
   client's unfinished actions are cancelled (their errors, like every final reply, stay in
   the reply cache for a resent request).
7. Bytes held for clients (`holds.py`): a request that brings bytes past the client's cap
   (`max_client_bytes`) gets `Error(OVER_CAP)`, past the controller's (`max_held_bytes`)
   `Error(RETRY_LATER)`; nothing of it is kept.

Layout: this module reads requests and runs the per-request handlers; `replies.py` (mixed in)
keeps the reply cache, the outboxes and the caps (rules 1, 2 and 6), `sessions.py` (mixed in)
admits frames to sessions (rule 3), `holds.py` (mixed in) counts held bytes (rule 7), and
`answers.py` (mixed in) turns the core's verdicts on actions into final replies; `resumed.py`
(mixed in) carries owners and held requests over a controller restart, and `presence.py` (mixed
in) ends silent clients and gives the status rows.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tangram import protocol
from tangram.aiotasks import cancel_tasks
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.resources import CPU, GPU, Demand, api_resource
from tangram.errors import BadRequest, InternalError, ProtocolError, SandboxLost, TangramError
from tangram_cli.controller.admission import elasticity_of, open_refusal, profile_named
from tangram_cli.controller.agents import AgentLink
from tangram_cli.controller.answers import KILL_CODES, Answers
from tangram_cli.controller.config import ControllerConfig
from tangram_cli.controller.files import MAX_PENDING_PUT_BYTES, FileRequests
from tangram_cli.controller.holds import Holds
from tangram_cli.controller.ledger import Ledger
from tangram_cli.controller.presence import Presence
from tangram_cli.controller.replies import (
    CACHE_MAX,
    CACHE_TTL_S,
    MAX_OUTBOX_BYTES,
    CacheEntry,
    ClientState,
    Replies,
)
from tangram_cli.controller.resumed import Resumed
from tangram_cli.controller.sessions import (
    _SRCFD,
    BEAT_S,
    Sessions,
    SubmitWire,
    client_key,
    client_tag,
    hello_problem,
)
from tangram_cli.controller.state import ActionRecord, Registry, SandboxRecord
from tangram_cli.controller.wire import serve, shadow

log = logging.getLogger("tangram.controller.gateway")



class Gateway(Resumed, Presence, Replies, Sessions, Holds, Answers, FileRequests):
    """The submit socket's server; replies (cache, outbox, caps), sessions, held bytes and core
    verdicts are mixed in."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        post: Callable[..., None],
        registry: Registry,
        agents: AgentLink,
        config: ControllerConfig,
        controller_epoch: int,
    ) -> None:
        self.sock = sock
        self.wire = SubmitWire(shadow(sock))
        self.post = post
        self.registry = registry
        self.clock = registry.clock
        self.agents = agents
        self.config = config
        self.epoch = controller_epoch
        self.clients: dict[bytes, ClientState] = {}
        self.ledger = Ledger(None, controller_epoch)  # the controller's, when it keeps state
        self.hold: Callable[[tuple[bytes, int, Any, tuple[bytes, ...]]], bool] | None = None
        self._init_replies()
        self._seq = 0
        self._id_tag = secrets.token_hex(3)  # this process's ids differ from a restarted one's
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters: dict[str, int] = {
            "bad_requests": 0,
            "replayed": 0,
            "resends_already_answered": 0,  # marked resends whose final was on its way (replies.py)
            "joined": 0,
            "clients_gone": 0,
            "retry_later_client": 0,  # refused: the client's outstanding cap
            "retry_later_global": 0,  # refused: the global cap on unfinished actions
            "outbox_queued": 0,  # final replies that waited in an outbox
            "outbox_overflows": 0,  # final replies that found the outbox full (kept in the cache only)
            "outbox_cancelled": 0,  # actions cancelled because their client's outbox was full
            "send_dropped": 0,  # non-final replies (Accepted, Heartbeat, RetryLater) that could not be sent
        }
        self._init_sessions(sock)
        self._init_holds()

    # ------------------------------------------------------------ helpers
    def _new_id(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}{self._seq}-{self._id_tag}"

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _welcome(self, client: ClientState) -> protocol.Welcome:
        return protocol.Welcome(
            protocol.PROTOCOL_MAJOR,
            protocol.PROTOCOL_MINOR,
            self.epoch,
            0,
            self.config.heartbeat_s,
            self.config.max_outstanding_per_client,
            self.ledger.enabled,
            client.token.hex() if client.token else "",
        )

    def _tag(self, ident: bytes) -> str:
        """What logs and status show of a client identity (never the identity itself)."""
        return client_tag(client_key(ident))

    # ------------------------------------------------------------ receive
    async def run(self) -> None:
        await serve(self.wire, self._on_message)

    def _on_message(self, raw: list[Any]) -> int:
        """Handle one message (a batch: each item); returns how many messages that was."""
        first = raw[0]  # a zmq.Frame (SubmitWire): the connection it came over, and its CURVE key
        frames = [first.bytes, *raw[1:]]
        try:
            return self._on_frames(frames, first)
        except Exception:
            log.exception("request handling failed")
            if len(frames) >= 4 and len(frames[3]) >= 8:  # answered, not cached: it may not be the session's
                rid = int.from_bytes(frames[3][:8], "big") & ((1 << 63) - 1)
                self._send(frames[0], protocol.Error.from_exception(InternalError("controller error")), rid)
        return 1

    def _on_frames(self, frames: list[bytes], head: Any) -> int:
        """One message (a batch: each of its items): ``frames`` as bytes, ``head`` its identity
        frame as a `zmq.Frame`. Returns how many messages it carried."""
        if len(frames) < 2:
            return 1
        ident = frames[0]
        try:
            envs = protocol.decode_all(frames[1:])
        except ProtocolError as exc:  # answered to whoever sent it; no session is touched
            rid = 0
            if len(frames) >= 4 and len(frames[3]) >= 8:
                rid = int.from_bytes(frames[3][:8], "big") & ((1 << 63) - 1)
            self._bad(ident, rid, exc)
            return 1
        user = head.get("User-Id") if self.curve_on else ""  # a property of the whole message
        try:
            fd = head.get(_SRCFD)  # deprecated in libzmq 4.x, still there in 4.3
        except zmq.ZMQError:  # a libzmq without it: replies follow the identity's route as before
            fd = 0
        if len(envs) == 1 and isinstance(envs[0], protocol.Envelope):
            self._on_envelope(ident, envs[0], user, fd)  # errors: _on_message answers them
            return 1
        with self.batcher.holding():  # what it answers at once (errors, resent requests) goes in one
            for env in envs:  # a batch: one item's failure is that item's answer, the others go on
                if isinstance(env, protocol.BadItem):
                    self._bad(ident, env.request_id, env.error)
                    continue
                try:
                    self._on_envelope(ident, env, user, fd)
                except Exception:
                    log.exception("request handling failed")
                    error = protocol.Error.from_exception(InternalError("controller error"))
                    self._send(ident, error, env.request_id)
        return len(envs)

    def _bad(self, ident: bytes, rid: int, exc: ProtocolError) -> None:
        self.counters["bad_requests"] += 1
        log.info("bad request from %s: %s", self._tag(ident), exc)
        self._send(ident, protocol.Error.from_exception(exc), rid)

    def _on_envelope(self, ident: bytes, env: protocol.Envelope, user: str, fd: int) -> None:
        msg, rid = env.msg, env.request_id
        if isinstance(msg, protocol.Hello) and (problem := hello_problem(msg)) is not None:
            self._send(ident, protocol.Reject(problem), rid)
            return
        client = self.clients.get(ident)
        if (
            client is None
            or client.token is None
            or not hmac.compare_digest(env.token, client.token)
            or (self.curve_on and user != client.user)
        ):
            client = self._admit(ident, env, user, client)  # sessions.py: start, resume or refuse
            if client is None:
                return
        elif client.alias:  # its client has the new token now
            client.alias = b""
        if fd != client.route:  # its own frame over another connection: replies go there now
            self._attach(client, fd)
        if self._session_traffic(client, msg, rid):
            return
        if self._replay(ident, rid, env.resend):  # a resent request: answered again, never run twice
            return
        sandbox = getattr(msg, "sandbox", "")
        if sandbox and (sb := self.registry.sandboxes.get(sandbox)) is not None and sb.restoring:
            sb.deferred.append((ident, rid, msg, env.blobs))  # until its node's agent is back
            self._charge(ident, _size(env.blobs))  # held until handle_held
            return
        if self.hold is not None and self.hold((ident, rid, msg, env.blobs)):
            self._charge(ident, _size(env.blobs))  # held until handle_held
            return  # after a restart: until the nodes it knew are back (Recovery.hold)
        self._handle(client, rid, msg, env.blobs)

    def _session_traffic(self, client: ClientState, msg: protocol.Message, rid: int) -> bool:
        """What every frame of a session does, and the messages that are not requests (True:
        nothing more to do with this one)."""
        ident = client.ident
        client.last_seen = now = self.clock.now()
        if ident in self.outbox:  # any message, heartbeats included, retries what waits for it
            self._flush(ident)
        if not client.welcomed and not isinstance(msg, protocol.Hello):
            # a client of a previous controller (a restart): it learns the new epoch (and its
            # session token) from its first contact, heartbeat or request, and resends what it waits for
            client.welcomed = True
            self._send(ident, self._welcome(client), 0)
        beat = isinstance(msg, protocol.Heartbeat)
        if beat or now - client.beat_sent >= BEAT_S:
            # each heartbeat is answered; and while a burst of its requests is read (its own
            # heartbeat waits behind them) the client hears one a second: it judges us by that
            client.beat_sent = now
            self._send(ident, protocol.Heartbeat(), 0)
        if isinstance(msg, protocol.Hello):
            if not self._join_job(client, msg.job, rid):  # sessions.py: a job its key may not claim
                return True
            client.name, client.welcomed = msg.name, True
            client.batches = msg.minor >= protocol.BATCH_MINOR
            client.owner = self._owner(client.user, msg.name)
            self._send(ident, self._welcome(client), rid)
            return True
        if isinstance(msg, protocol.Bye):
            self._client_gone(client, "said bye")
            return True
        return beat or isinstance(msg, (protocol.Ack, protocol.Accepted, protocol.Result, protocol.Error))

    def _handle(self, client: ClientState, rid: int, msg: protocol.Message, blobs: tuple[bytes, ...]) -> None:
        ident = client.ident
        client.requests += 1
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            self.counters["bad_requests"] += 1
            self._send(
                ident,
                protocol.Error("BAD_REQUEST", f"{msg.NAME} is not a request on the submit socket", False),
                rid,
            )
            return
        if type(msg) in _CAPPED:
            if self._refuse(client, rid, msg):
                return
            if blobs and self._over_bytes_cap(client, rid, _size(blobs)):
                return
        try:
            handler(self, client, rid, msg, blobs)
        except TangramError as exc:
            self.counters["bad_requests"] += 1
            self.fail(ident, rid, exc)

    # ------------------------------------------------------------ requests
    def _budget(self, budget_ms: int) -> float:
        if budget_ms <= 0:
            return self.config.max_timeout_s
        return min(budget_ms / 1000.0, self.config.max_timeout_s)

    def _own_sandbox(self, client: ClientState, sandbox: str) -> SandboxRecord:
        rec = self.registry.sandboxes.get(sandbox)
        if rec is None or rec.client != client.key:
            raise BadRequest(f"unknown sandbox {sandbox!r}: open it first (sandboxes belong to one client)")
        if rec.closed:
            raise BadRequest(f"sandbox {sandbox} is closed")
        if rec.lost:
            raise SandboxLost(f"sandbox {sandbox} was lost with its node {rec.node}")
        return rec

    def _on_open(
        self, client: ClientState, rid: int, msg: protocol.SandboxOpen, blobs: tuple[bytes, ...]
    ) -> None:
        if (refusal := open_refusal(msg.mem_mib, self.agents.agents.values())) is not None:
            raise refusal  # larger than any node: NO_CAPACITY now, not at the first exec
        sandbox = self._new_id("sb-")
        rec = SandboxRecord(
            sandbox, client.ident, client.key, msg.image, msg.mem_mib, msg.reserve, opened=self.clock.now()
        )
        self.registry.sandboxes[sandbox] = rec
        self._register(client, rid, "open")
        ident = client.ident
        if msg.reserve > 0:
            deadline = self.clock.now() + self._budget(int(msg.timeout_s * 1000))
            self.registry.actions[f"open:{sandbox}"] = ActionRecord(
                f"open:{sandbox}", "open", ident, rid, client.key, self.clock.now(), deadline, sandbox=sandbox
            )

        def after(cmds: list[cmd.Command] | None) -> None:
            if cmds is None:
                self.fail(ident, rid, InternalError("the scheduler failed on this request"))
            elif msg.reserve <= 0:
                self.final(ident, rid, protocol.Result({"sandbox": sandbox}))

        self.post(ev.SandboxOpened(sandbox, client.key, msg.mem_mib, msg.image, msg.reserve), after)

    def _on_close(
        self, client: ClientState, rid: int, msg: protocol.SandboxClose, blobs: tuple[bytes, ...]
    ) -> None:
        rec = self.registry.sandboxes.get(msg.sandbox)
        if rec is not None and rec.client != client.key:
            raise BadRequest(f"unknown sandbox {msg.sandbox!r}")
        self._register(client, rid, "close")
        if rec is None or rec.closed:
            self.final(client.ident, rid, protocol.Result({}))
            return
        rec.closed = True
        rec.pending_puts.clear()
        rec.pending_bytes = 0
        self._charge_puts(msg.sandbox, client.ident, 0)
        ident = client.ident
        self.post(ev.SandboxClosed(msg.sandbox), lambda cmds: self.final(ident, rid, protocol.Result({})))

    def _submit(self, client: ClientState, rid: int, kind: str, spec: ActionSpec, rec: ActionRecord) -> None:
        self.registry.actions[spec.action_id] = rec
        self._register(client, rid, kind, spec.action_id)
        ident, aid = client.ident, spec.action_id

        self._charge_action(aid, ident, len(rec.stdin or b"") + len(rec.payload))  # held until it ends

        def after(cmds: list[cmd.Command] | None) -> None:
            if cmds is None:
                self.fail(ident, rid, InternalError("the scheduler failed on this request"))
                self.registry.actions.pop(aid, None)
                self._release_action(aid)
                return
            if not rec.final_sent and kind in ("exec", "call"):
                rec.granted = True  # admitted: a resent copy is joined (`Accepted`), never run again

        self.post(ev.ActionSubmitted(spec), after)

    def _on_exec(self, client: ClientState, rid: int, msg: protocol.Exec, blobs: tuple[bytes, ...]) -> None:
        sb = self._own_sandbox(client, msg.sandbox)
        el = elasticity_of(msg, self.config.profiles)
        timeout = self._budget(msg.total_budget_ms)  # the whole request; budget_ms bounds the run alone
        aid = self._new_id("x")
        argv0 = msg.cmd.strip().split(" ", 1)[0][:64] if msg.cmd.strip() else "sh"
        spec = ActionSpec(
            action_id=aid,
            kind=Kind.EXEC,
            demand=((CPU, Demand.range(msg.cpus_min, msg.cpus_max)),),
            action_type=f"exec:{msg.elastic or ''}:{argv0}",
            client=client.key,
            sandbox=msg.sandbox,
            trajectory=msg.sandbox,
            elasticity=el,
            t_ori=msg.duration_hint_s if msg.duration_hint_s > 0 else None,
            timeout_s=timeout,
            mem_mib=sb.mem_mib,
        )
        now = self.clock.now()
        rec = ActionRecord(
            aid,
            "exec",
            client.ident,
            rid,
            client.key,
            now,
            now + timeout,
            sandbox=msg.sandbox,
            cmd=msg.cmd,
            env=dict(msg.env),
            stdin=blobs[0] if blobs else None,
            run_limit_s=self._budget(msg.budget_ms),
        )
        self._submit(client, rid, "exec", spec, rec)

    def _on_call(self, client: ClientState, rid: int, msg: protocol.Call, blobs: tuple[bytes, ...]) -> None:
        svc = self.config.service(msg.service)
        if svc is None:
            known = ", ".join(s.name for s in self.config.services) or "none"
            raise BadRequest(f"unknown service {msg.service!r} (known: {known})")
        timeout = self._budget(msg.total_budget_ms)  # as in _on_exec
        aid = self._new_id("c")
        spec = ActionSpec(
            action_id=aid,
            kind=Kind.CALL,
            demand=((GPU, Demand.of(list(msg.gpus_options) or [msg.gpus])),),
            key=GPU,
            action_type=f"call:{msg.service}",
            client=client.key,
            service=msg.service,
            timeout_s=timeout,
            elasticity=profile_named(msg.elastic, self.config.profiles) if msg.elastic else None,
        )
        now = self.clock.now()
        rec = ActionRecord(
            aid,
            "call",
            client.ident,
            rid,
            client.key,
            now,
            now + timeout,
            service=msg.service,
            payload=blobs[0],
            run_limit_s=self._budget(msg.budget_ms),
        )
        self._submit(client, rid, "call", spec, rec)

    def _on_lease(self, client: ClientState, rid: int, msg: protocol.Lease, blobs: tuple[bytes, ...]) -> None:
        if not any(a.name == msg.api for a in self.config.apis):
            known = ", ".join(a.name for a in self.config.apis) or "none"
            raise BadRequest(f"unknown API {msg.api!r} (known: {known})")
        timeout = self._budget(msg.budget_ms)
        aid = self._new_id("l")
        spec = lease_spec(aid, msg.api, msg.units, client.key, timeout, msg.tokens)
        now = self.clock.now()
        rec = ActionRecord(aid, "lease", client.ident, rid, client.key, now, now + timeout, units=msg.units)
        self._submit(client, rid, "lease", spec, rec)

    def _on_release(
        self, client: ClientState, rid: int, msg: protocol.Release, blobs: tuple[bytes, ...]
    ) -> None:
        rec = self.registry.actions.get(msg.lease)
        self._register(client, rid, "release")
        if rec is None or rec.kind != "lease" or rec.client != client.key or not rec.granted or rec.release:
            if rec is not None and rec.kind == "lease" and rec.client == client.key and not rec.granted:
                rec.release = (client.ident, rid)  # released while still queued: cancel it
                self.post(ev.ActionCancelled(msg.lease, "released before grant"))
                return
            self.final(client.ident, rid, protocol.Result({}))
            return
        rec.release = (client.ident, rid)
        if msg.tokens or msg.rate_limited:  # the holder's report of its call (API key pools)
            self.post(ev.ApiReported(msg.lease, msg.tokens or -1, msg.rate_limited, msg.reset_ms / 1000))
        self.post(ev.ActionFinished(msg.lease, ok=True, reason="released"))

    def _on_cancel(
        self, client: ClientState, rid: int, msg: protocol.Cancel, blobs: tuple[bytes, ...]
    ) -> None:
        self._register(client, rid, "cancel")
        entry = self.cache.get((client.ident, msg.target_request_id))
        if entry is not None and entry.final is None and entry.action_id:
            rec = self.registry.actions.get(entry.action_id)
            if rec is not None and not rec.final_sent:
                self.post(ev.ActionCancelled(entry.action_id, "cancelled"))
        self.final(client.ident, rid, protocol.Result({}))

    async def close(self) -> None:
        await cancel_tasks(self._tasks)
        self._close_monitor()


_HANDLERS: dict[type, Callable[..., None]] = {
    protocol.SandboxOpen: Gateway._on_open,
    protocol.SandboxClose: Gateway._on_close,
    protocol.Put: Gateway._on_put,
    protocol.Get: Gateway._on_get,
    protocol.Exec: Gateway._on_exec,
    protocol.Call: Gateway._on_call,
    protocol.Lease: Gateway._on_lease,
    protocol.Release: Gateway._on_release,
    protocol.Cancel: Gateway._on_cancel,
}

# Requests that start work and so count against the caps; Cancel, SandboxClose and Release free
# work and are never refused.
_CAPPED = frozenset(
    {protocol.SandboxOpen, protocol.Put, protocol.Get, protocol.Exec, protocol.Call, protocol.Lease}
)


def _size(blobs: tuple[bytes, ...] | list[bytes]) -> int:
    return sum(len(b) for b in blobs)


def lease_spec(aid: str, api: str, units: int, client: str, timeout_s: float, tokens: int = 0) -> ActionSpec:
    """The core's action for an API lease (a new one, or one restored after a restart);
    ``tokens``: its charge against a key's tokens per minute (API key pools)."""
    res = api_resource(api)
    return ActionSpec(
        action_id=aid,
        kind=Kind.LEASE,
        demand=((res, Demand.fixed(units)),),
        key=res,
        action_type=f"lease:{api}",
        client=client,
        api=api,
        timeout_s=timeout_s,
        tokens=tokens,
    )


__all__ = [  # the cache, client and kill-code names live in replies.py and answers.py now
    "CACHE_MAX",
    "CACHE_TTL_S",
    "KILL_CODES",
    "MAX_OUTBOX_BYTES",
    "MAX_PENDING_PUT_BYTES",
    "CacheEntry",
    "ClientState",
    "Gateway",
    "SubmitWire",
    "lease_spec",
]
