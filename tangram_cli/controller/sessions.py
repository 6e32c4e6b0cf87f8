"""Client sessions on the submit socket: who may use a sandbox, a lease or a request.

A *session* is what the controller knows of one client: the ZeroMQ routing identity it chose,
the token the controller issued in its `Welcome`, and with CURVE the public key (`User-Id`) it
authenticated with. Everything a client creates (sandboxes, leases, requests and their cached
replies) belongs to its session, and only frames of that session reach it. Rules:

1. **Token.** ``nonce (8 random bytes) + HMAC-SHA256(secret, identity + nonce)[:16]``
   (`protocol.TOKEN_BYTES`). It is issued once per session, in the `Welcome` that answers the
   session's first `Hello`; every later frame of the client carries it (frame 2, after the request
   id). A frame of a live session is checked with one bytes compare against the session's token
   (`hmac.compare_digest`) and, with CURVE, one string compare against its `User-Id`; the HMAC is
   computed only for a session the controller does not hold (after a restart). Not
   HMAC(secret, identity) alone: every `Hello` with that identity would then get the same token,
   and the controller would have to remember every identity it ever welcomed to keep a victim's
   token from whoever copies its identity; the nonce makes each session's token its own.
2. **Refusals.** A frame with a missing or wrong token, or from another CURVE key, never reaches
   the session: a request gets `ERROR AUTH` (not cached, so it cannot spoil the session's reply
   cache), a `Hello` gets `REJECT`, anything else is dropped; all are counted (`auth_refused`).
   Such a frame can only come from a second connection that now holds the routing identity's
   route, so the session is *blocked*: nothing of it is sent to that identity (final replies wait
   in its outbox, `ACCEPTED` is dropped) until a frame with the right token and key arrives again.
3. **Routes.** Replies of a session go only over the connection that last sent one of its own
   frames (`ClientState.route`, the frame's `SRCFD`). When that connection drops (the socket
   monitor's `EVENT_DISCONNECTED` for its descriptor, read before every final reply is sent), the
   session has no route: its final replies wait in its outbox until its client's next frame on
   a new connection. So a silent second connection that takes the identity once the client's
   own connection is gone receives nothing either.
4. **No second session for an identity.** A `Hello` without the session's token for an identity
   the controller knows (a live session, one restored from the state file, or one gone less than
   `GONE_TTL_S` ago) is refused; so a leaked identity never yields the victim's token. The submit
   socket also runs without `ROUTER_HANDOVER`: a second connection with a live identity gets no
   route at all (libzmq ignores it), and ZMTP heartbeats drop a dead client's route so that its
   own reconnect gets the route back (the client library reconnects while it hears nothing).
5. **Restarts.** The secret lives next to the state file (`<state>.session-key`, mode 0600), so
   a controller restarted on the same state verifies the tokens its predecessor issued without
   having stored them: a restored owner (sandbox, lease, reply) is pinned to the first frame
   whose token verifies for its identity. Without a state file the secret is random per process,
   and a client of the previous controller simply gets a new session (it had nothing to lose).
6. **Gone.** A session that said `Bye` or went silent is released; its token is kept for
   `GONE_TTL_S` after its last cached reply (the reply cache's TTL), so the same client can come
   back for its replies and no one else can take the identity meanwhile.
7. **Names.** Status shows a session's name (the key's name under CURVE, `curve.name_of`, else
   the `Hello` name) and a short tag: the first 6 hex digits of SHA-256 of the identity
   (`client_tag`). The core's client key is 32 hex digits of the same hash (`client_key`): unique,
   not reversible, and no key to anything, since use needs the token.
8. **Jobs.** A `Hello` may name the client's RL job (`Hello.job`); the controller's `jobs`
   config may bind CURVE keys to a job (`jobs_config.admit_job`): a bound key's session is in
   its job (named or not; naming another is refused), and a job that lists keys refuses
   every other key (and, without CURVE, every client). Refusals get `REJECT`, are counted
   (`job_refused`) and logged; the session keeps the job it had.

`Gateway` inherits these methods; they use its clients, counters, clock, config and `_send`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from tangram import protocol
from tangram.core import events as ev
from tangram.errors import ConfigError
from tangram.sockio import recv_frames, send_frames, shadow
from tangram_cli.controller.jobs_config import admit_job
from tangram_cli.controller.replies import CACHE_TTL_S, ClientState

log = logging.getLogger("tangram.controller.sessions")

SECRET_BYTES = 32
NONCE_BYTES = 8
MAC_BYTES = protocol.TOKEN_BYTES - NONCE_BYTES
GONE_TTL_S = CACHE_TTL_S  # a gone session's token is kept as long as its cached replies
SECRET_SUFFIX = ".session-key"

_NO_SESSION = (
    "no session: this controller speaks protocol {major}.{minor} and serves only requests that carry the "
    "session token its WELCOME gave; say HELLO first (a tangram library older than {major}.{sessions} "
    "cannot: upgrade it)"
)


def client_key(ident: bytes) -> str:
    """The core's (and the ledger's restored records') client key of a routing identity."""
    return hashlib.sha256(ident).hexdigest()[:32]


def client_tag(key: str) -> str:
    """What status shows of a client key: 6 hex digits, enough to tell rows apart."""
    return key[:6]


def load_secret(state: str | None) -> bytes:
    """The session secret: kept next to the state file (created on first use, mode 0600), so a
    restarted controller still verifies the tokens it issued; random per process without one."""
    if not state:
        return secrets.token_bytes(SECRET_BYTES)
    path = state + SECRET_SUFFIX
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_secret(path)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return _read_secret(path)


def _read_secret(path: str) -> bytes:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning("session key %s was readable by others (mode %o): made 0600", path, mode)
        os.chmod(path, 0o600)
    with open(path, encoding="ascii") as fh:
        text = fh.read().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError(
            f"{path}: not a session key",
            hint="remove it (clients of the previous controller then get new sessions)",
        )
    return secret


@dataclass
class Gone:
    """A released session whose token still counts (its cached replies may be asked for again)."""

    token: bytes | None
    user: str
    name: str
    expires: float  # controller clock
    route: int = -1  # its last connection while that stays up: late replies still go there


BEAT_S = 1.0  # at most this long between heartbeats to a client that waits for an answer


class Sessions:
    """Mixed into `Gateway` (which provides the attributes below)."""

    sock: Any
    clients: dict[bytes, ClientState]
    counters: dict[str, int]
    clock: Any
    config: Any
    post: Callable[..., None]
    _send: Callable[..., None]

    def beat_waiting(self) -> None:
        """A `Heartbeat` to each connected client that was sent none for `BEAT_S` (run twice a
        second). A client's own heartbeats wait behind its requests in the pipe, and under a
        burst of many clients the controller reaches each one's frames only now and then; the
        client judges us by what it hears, so it hears this. An idle client got one in answer
        to its own heartbeat less than a second ago: it is skipped."""
        now = self.clock.now()
        for ident, client in list(self.clients.items()):
            if client.route >= 0 and client.welcomed and now - client.beat_sent >= BEAT_S:
                client.beat_sent = now
                self._send(ident, protocol.Heartbeat(), 0)

    def _init_sessions(self, sock: Any) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES)  # the daemon sets the state file's (load_secret)
        self.gone: dict[bytes, Gone] = {}
        self.curve_on = False  # with CURVE: sessions are bound to their User-Id
        self.key_name: Callable[[str], str | None] | None = None  # curve.ServerAuth.name_of
        self.routes: dict[int, bytes] = {}  # connection (descriptor) -> the identity whose route it is
        self._conns = itertools.count(1)  # `ClientState.conn`: one number per route a session was given
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor_sync = shadow(self._monitor)
        for name in (
            "sessions",
            "sessions_resumed",
            "auth_refused",
            "sessions_blocked",
            "client_connects",
            "client_disconnects",
            "client_drops",
        ):
            self.counters[name] = 0

    def use_curve(self, auth: Any) -> None:
        """CURVE is on: read every frame's User-Id and bind each session to it."""
        self.curve_on = True
        self.key_name = getattr(auth, "name_of", None)

    # ------------------------------------------------------------ tokens
    def _mac(self, ident: bytes, nonce: bytes) -> bytes:
        return hmac.digest(self.secret, ident + nonce, "sha256")[:MAC_BYTES]

    def token_for(self, ident: bytes, nonce: bytes | None = None) -> bytes:
        """A token for ``ident`` (a fresh nonce unless given). Tests and tools mint one this way."""
        nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
        return nonce + self._mac(ident, nonce)

    def _issued_here(self, ident: bytes, token: bytes) -> bool:
        """Whether this controller's secret issued ``token`` for ``ident`` (now or before a restart)."""
        if len(token) != protocol.TOKEN_BYTES:
            return False
        return hmac.compare_digest(self._mac(ident, token[:NONCE_BYTES]), token[NONCE_BYTES:])

    # ------------------------------------------------------------ the slow path
    def _admit(
        self, ident: bytes, env: protocol.Envelope, user: str, client: ClientState | None
    ) -> ClientState | None:
        """A frame that is not plainly its session's: the session it may start or resume, or None
        when it was refused (and answered). See rules 1, 2, 4-6 of the module doc."""
        msg = env.msg  # a Hello here passed the gateway's version and role checks
        if client is not None:
            if (
                client.token is None
                and self._issued_here(ident, env.token)
                and self._same_key(client.user, user)
            ):
                client.token, client.user = env.token, user  # restored after a restart: pinned now
                client.owner = self._owner(user, client.name)
                self.counters["sessions_resumed"] += 1
                return client
            if (
                client.alias
                and hmac.compare_digest(env.token, client.alias)
                and self._same_key(client.user, user)
            ):
                return client  # sent before its client had this session's Welcome (see below)
            right = client.token is not None and hmac.compare_digest(env.token, client.token)
            why = "another CURVE key" if right else "no valid session token"
            return self._refuse_frame(ident, env, client, why)
        gone = self.gone.get(ident)
        if gone is not None:
            if gone.token is None:  # restored after a restart and released before it came back
                right = self._issued_here(ident, env.token)
            else:
                right = hmac.compare_digest(env.token, gone.token)
            if right and self._same_key(gone.user, user):
                del self.gone[ident]
                self.counters["sessions_resumed"] += 1
                return self._open_session(ident, env.token, user, gone.name)
            return self._refuse_frame(
                ident, env, None, "no valid session token (the identity's session ended)"
            )
        if env.token and self._issued_here(ident, env.token):
            self.counters["sessions_resumed"] += 1
            return self._open_session(ident, env.token, user, "")  # issued before a restart
        if env.token or isinstance(msg, protocol.Hello):
            # a new session; a token from another secret means a controller restarted without its
            # state: that client had nothing here and simply starts again. Its frames sent before
            # it reads the new Welcome still carry the old token: accepted (`alias`) until one
            # carries the new one; whoever sent that first frame holds it, so it opens nothing more.
            client = self._open_session(ident, self.token_for(ident), user, "")
            client.alias = env.token
            return client
        self.counters["auth_refused"] += 1
        if env.request_id and not isinstance(msg, _NOT_REQUESTS):
            text = _NO_SESSION.format(
                major=protocol.PROTOCOL_MAJOR, minor=protocol.PROTOCOL_MINOR, sessions=protocol.SESSIONS_MINOR
            )
            self._send(ident, protocol.Error("AUTH", text, False), env.request_id)
        return None

    def _same_key(self, bound: str, user: str) -> bool:
        return not self.curve_on or not bound or hmac.compare_digest(bound.encode(), user.encode())

    def _owner(self, user: str, name: str) -> str:
        if user and self.key_name is not None:
            try:
                return self.key_name(user) or name
            except Exception:  # a name is cosmetic: never fail a session over it
                log.exception("naming CURVE key %s failed", user)
        return name

    def _join_job(self, client: ClientState, asked: str, rid: int) -> bool:
        """Rule 8: the RL job a `Hello` names (or the one its CURVE key is bound to) becomes the
        session's, and the core hears of a change (`JobJoined`); a job its key may not claim gets
        `REJECT` (False), and the session keeps the job it had."""
        key_name = None
        if self.curve_on:
            try:
                key_name = self.key_name(client.user) if self.key_name is not None and client.user else None
            except Exception:  # a name is needed to claim a bound job: without it, claim none
                log.exception("naming CURVE key %s failed", client.user)
            key_name = key_name or ""
        job, why = admit_job(self.config.jobs, asked, key_name)
        if why is not None:
            self.counters["job_refused"] = self.counters.get("job_refused", 0) + 1
            log.warning("client %s (%s): %s", client_tag(client.key), client.name or "?", why)
            self._send(client.ident, protocol.Reject(f"refused: {why}"), rid)
            return False
        if job != client.job:
            client.job = job
            self.post(ev.JobJoined(client.key, job))
        return True

    def _open_session(self, ident: bytes, token: bytes, user: str, name: str) -> ClientState:
        now = self.clock.now()
        key = client_key(ident)
        client = ClientState(ident, key, name, last_seen=now, connected=now, token=token, user=user)
        client.owner = self._owner(user, name)
        self.clients[ident] = client
        self.counters["sessions"] += 1
        return client

    def _refuse_frame(
        self, ident: bytes, env: protocol.Envelope, client: ClientState | None, why: str
    ) -> None:
        """Rule 2: answer the frame's sender, touch nothing, and block the session."""
        self.counters["auth_refused"] += 1
        tag = client_tag(client_key(ident))
        if client is not None:
            client.refused += 1
            self._attach(client, -1)  # the route is another connection's now: send the session nothing
            if not client.blocked:
                client.blocked = True
                self.counters["sessions_blocked"] += 1
                log.warning(
                    "client %s (%s): a frame with %s came over its identity's route; nothing is sent to "
                    "that identity until the session's own token and key come back",
                    tag,
                    client.name,
                    why,
                )
        msg = env.msg
        text = f"refused: {why} for this routing identity's session (sessions belong to one client)"
        if isinstance(msg, protocol.Hello):
            self._send(ident, protocol.Reject(text), env.request_id)
        elif env.request_id and not isinstance(msg, _NOT_REQUESTS):
            self._send(ident, protocol.Error("AUTH", text, False), env.request_id)

    # ------------------------------------------------------------ routes (rule 3)
    def _attach(self, client: ClientState, fd: int) -> None:
        """``fd`` is the connection the session's own frame just came over: its replies go there.
        The monitor is read first: a connection that ended before ``fd`` was reused for this one
        left its disconnect there (libzmq writes it before it closes the descriptor), and read
        after the attach it would take this session's new route away."""
        self._watch_routes()
        if client.route >= 0 and self.routes.get(client.route) == client.ident:
            del self.routes[client.route]
        client.route, client.conn = fd, next(self._conns)
        if fd >= 0:
            client.blocked = False
            old = self.routes.get(fd)
            if old is not None and old != client.ident and (other := self.clients.get(old)) is not None:
                other.route, other.conn = -1, next(self._conns)  # reused descriptor, disconnect unread
            self.routes[fd] = client.ident

    def _watch_routes(self) -> None:
        """Read the submit socket's monitor: a dropped connection takes its session's route away.
        Runs before every final reply is sent (cheap when nothing happened: one EVENTS read). A
        disconnect is in the monitor before libzmq can give its identity's route to another
        connection (that takes two more passes of the ROUTER's command queue), so a final reply
        never goes to a connection that took the route after its session's own one dropped."""
        mon = self._monitor_sync
        try:
            while mon.getsockopt(_EVENTS) & _POLLIN:
                frames = mon.recv_multipart(zmq.NOBLOCK)
                event, fd = _EVENT.unpack_from(frames[0])
                if event == zmq.EVENT_DISCONNECTED:
                    self.counters["client_disconnects"] += 1
                    ident = self.routes.pop(fd, None)
                    if ident is None:
                        continue
                    client = self.clients.get(ident)
                    if client is not None and client.route == fd:
                        client.route, client.conn = -1, next(self._conns)
                        self.counters["client_drops"] += 1  # a live session's link ended without Bye
                    gone = self.gone.get(ident)
                    if gone is not None and gone.route == fd:
                        gone.route = -1
                elif event == zmq.EVENT_ACCEPTED:
                    self.counters["client_connects"] += 1
        except zmq.ZMQError:  # closed at shutdown
            return

    def _close_monitor(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._monitor.close(0)

    # ------------------------------------------------------------ gone sessions
    def _bury(self, client: ClientState) -> None:
        """Keep a released session's token while its cached replies live (rule 6)."""
        self.gone[client.ident] = Gone(
            client.token, client.user, client.name, self.clock.now() + GONE_TTL_S, client.route
        )

    def _touch_gone(self, ident: bytes) -> int:
        """A final reply was cached for a released session: keep its token as long. Returns the
        session's route (-1: none: the reply waits in the cache for a resend)."""
        gone = self.gone.get(ident)
        if gone is None:
            return -1
        gone.expires = self.clock.now() + GONE_TTL_S
        return gone.route

    def _expire_gone(self, now: float) -> None:
        for ident in [i for i, g in self.gone.items() if g.expires < now]:
            gone = self.gone.pop(ident)
            if gone.route >= 0 and self.routes.get(gone.route) == ident:
                del self.routes[gone.route]


_EVENT = struct.Struct("=HI")  # a monitor event's first frame: event (u16), value (u32: the descriptor)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no enum objects on the hot path

# Messages that are never answered (a reply to a reply, a heartbeat, a goodbye)
_NOT_REQUESTS = (
    protocol.Heartbeat,
    protocol.Bye,
    protocol.Ack,
    protocol.Accepted,
    protocol.Result,
    protocol.Error,
    protocol.Welcome,
    protocol.Reject,
)


def hello_problem(msg: protocol.Hello) -> str | None:
    """Why a client's Hello is refused (its version or role), or None."""
    problem = protocol.version_problem(msg)
    if problem is None and msg.role != "client":
        problem = f"role {msg.role!r} on the submit socket"
    if problem is None and msg.minor < protocol.SESSIONS_MINOR:
        problem = (
            f"client speaks {msg.major}.{msg.minor}; this controller needs "
            f"{protocol.PROTOCOL_MAJOR}.{protocol.SESSIONS_MINOR} or newer (session tokens): "
            "upgrade tangram on the client"
        )
    return problem


__all__ = [
    "BEAT_S",
    "GONE_TTL_S",
    "Gone",
    "hello_problem",
    "Sessions",
    "client_key",
    "client_tag",
    "load_secret",
]


class SubmitWire:
    """The submit ROUTER as the gateway reads and sends on it (`wire.serve`, `wire.send_now`): the
    first frame of each message (the identity) comes as a `zmq.Frame`, whose properties say which
    connection the message came over (`SRCFD`) and, with CURVE, its key (`User-Id`; sessions.py);
    the other frames come as bytes, since a `zmq.Frame` per frame costs several microseconds."""

    def __init__(self, sync: zmq.Socket[Any]) -> None:
        self.sync = sync
        self.FD = sync.FD

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        first = self.sync.recv(flags, copy=False)
        return [first, *recv_frames(self.sync, flags)]  # the rest of the same message (atomic)

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        send_frames(self.sync, frames, flags)


_SRCFD = int(zmq.SRCFD)
