"""The client's DEALER transport: one asyncio task owns the socket.

- `request(msg, blobs)` sends a request with a fresh request id and returns a `Pending` whose
  `final` future resolves with the `Result` envelope or fails with the typed error of the `Error`
  reply (`accepted` says whether an `Accepted` came first: a flag, since nobody waits for it).
- Sends go straight to libzmq (non-blocking, through the socket's synchronous shadow); frames
  it cannot take yet wait in order. Receives come from one loop reader on the socket's
  descriptor that drains every ready reply per wake-up: no future per message.
- The routing identity is a random 16 bytes chosen once per transport, so a reconnect (libzmq
  reconnects by itself) reaches the same client state on the controller. The controller's
  `Welcome` gives a session token (protocol 1.3); every frame sent after it carries the token,
  resends included, and only frames with it reach this client's sandboxes, leases and replies.
  While the controller stays silent the transport reconnects every 5 heartbeat intervals: the
  controller gives a routing identity one route at a time, and a connection made while its dead
  predecessor still held the route gets none until it reconnects.
- Heartbeats: a `Heartbeat` after `heartbeat_s` without sending; the controller answers each.
  Silence for 3 intervals marks the link down; when traffic returns, the transport says
  `Hello` again. Pending requests are resent (with their original ids) only when something
  may have lost them: libzmq reported a disconnect since the last Welcome, or the controller
  restarted (another `controller_epoch`). A slow controller on an unbroken link has every
  request already (TCP), so nothing is resent. The controller's reply cache makes a resend
  safe (it joins its action or replays its result); a restarted controller replays the same
  from its state file, and answers NODE_LOST for what was running when it died.
- Depends only on pyzmq, msgpack and tangram.protocol / tangram.errors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tangram import protocol
from tangram.aiotasks import cancel_tasks
from tangram.certs import CurveKeys, HandshakeWatch, KeyRefused, handshake_events
from tangram.errors import (
    ActionTimeout,
    ControllerUnreachable,
    NodeLost,
    ProtocolError,
    TangramError,
    VersionMismatch,
)
from tangram.sockio import SocketReader, send_frames, shadow

log = logging.getLogger("tangram.client")
# requests per batch: a controller reads a drain's worth of messages (256) at a time and takes the
# clients' pipes in turn, so smaller batches keep many clients' turns short
SEND_BATCH = 64

_CONTEXTS: dict[int, zmq.asyncio.Context] = {}  # by pid: one made in a forked child is its own


def shared_context() -> zmq.asyncio.Context:
    """The ZeroMQ context of every client transport of this process (made by its first one, and
    again in a forked child, where the parent's, kept unused, has no I/O thread): one I/O thread
    serves them all. A context per transport gave each client its own I/O thread, so a rollout
    process with many clients woke one thread per client for the replies of one controller batch.
    Transports close their sockets and leave the context up."""
    pid = os.getpid()
    ctx = _CONTEXTS.get(pid)
    if ctx is None or ctx.closed:
        ctx = _CONTEXTS[pid] = zmq.asyncio.Context()
    return ctx


@dataclass
class Pending:
    request_id: int
    frames: list[bytes]
    idempotent: bool
    final: asyncio.Future[protocol.Envelope]
    accepted: bool = False
    sent_at: float = field(default_factory=time.monotonic)


class Transport:
    def __init__(
        self,
        addr: str,
        name: str,
        *,
        heartbeat_s: float = 1.0,
        connect_timeout: float = 10.0,
        curve: CurveKeys | None = None,
        job: str = "",
    ) -> None:
        self.addr = addr
        self.curve = curve
        self.name = name
        self.job = job  # its RL job, said in every Hello ("": the default job)
        self.heartbeat_s = heartbeat_s
        self.connect_timeout = connect_timeout
        self.identity = secrets.token_bytes(16)
        self.epoch: int | None = None
        self.max_outstanding = 0  # the controller's per-client cap (Welcome); 0: not said
        self._sock: zmq.asyncio.Socket | None = None
        self._out: collections.deque[list[bytes]] = collections.deque()  # frames libzmq could not take yet
        self._sync: zmq.Socket | None = None  # the socket's synchronous shadow: sends and receives
        self._monitor: zmq.asyncio.Socket | None = None  # disconnect events: resend after a lost link
        self._handshake = HandshakeWatch(addr, "client", curve)  # refused keys: KeyRefused at once
        self.refused: KeyRefused | None = None  # the controller refused this client's key after connect
        self._disconnected = False  # a disconnect was seen since the last Welcome
        self._lost_at = 0.0  # when the last one was seen (monotonic)
        self._reader: SocketReader | None = None  # drains replies on the loop (tangram.sockio)
        self.resent = 0  # requests sent again after a lost link or a new controller
        self.restarts = 0  # new controller epochs seen after the first Welcome
        self.stray_replies = 0  # final replies for no pending request (a duplicate, or after a cancel)
        self._pending: dict[int, Pending] = {}
        self._rid = int.from_bytes(secrets.token_bytes(4), "big") << 16  # distinct per transport
        self._task: asyncio.Task[None] | None = None
        self._welcome: asyncio.Future[protocol.Welcome] | None = None
        self._hello_rid = 0
        self._last_recv = time.monotonic()
        self._last_sent = time.monotonic()
        self._down = False
        self._closed = False
        self.token = b""  # the session token from the controller's Welcome (protocol 1.3)
        self._batches = False  # the controller's Welcome said minor >= BATCH_MINOR
        self._flag_resends = False  # ... >= RESEND_MINOR: resends carry the flag (`protocol.as_resend`)
        self._batch: list[list[bytes]] = []  # requests of this loop iteration, sent as one batch
        self.batches_sent = 0  # BATCH messages sent (each carries 2 to SEND_BATCH requests)
        self._reconnected = 0.0  # when the transport last reconnected by itself (monotonic)
        self.reconnects = 0
        self.pid = os.getpid()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        sock = shared_context().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        sock.setsockopt(zmq.SNDHWM, 100000)
        sock.setsockopt(zmq.RCVHWM, 100000)
        if self.curve is not None:
            self.curve.apply(sock)
        # before connect, so no handshake event is missed (a refused key fails start() at once)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | handshake_events())
        try:
            sock.connect(self.addr)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
            sock.close(0)
            raise ControllerUnreachable(f"bad controller address {self.addr!r}: {exc}") from None
        self._sock = sock
        self._sync = shadow(sock)
        self._task = asyncio.ensure_future(self._own())
        self._welcome = asyncio.get_running_loop().create_future()
        self._send_hello()
        try:
            welcome = await asyncio.wait_for(asyncio.shield(self._welcome), self.connect_timeout)
        except TimeoutError:
            await self.close()
            hint = (
                "CURVE is on: is this client's public key on the controller's allow-list "
                "(certs/clients/), and TANGRAM_CERTS the cluster's certs directory?"
                if self.curve is not None
                else "if the cluster uses CURVE (every `tangram up INVENTORY` does), set TANGRAM_CERTS "
                "(`tangram env` prints it)"
            )
            raise ControllerUnreachable(
                f"no answer from the controller at {self.addr} within {self.connect_timeout:g}s", hint=hint
            ) from None
        except TangramError:
            await self.close()
            raise
        self.epoch = welcome.controller_epoch
        self.heartbeat_s = min(self.heartbeat_s, welcome.heartbeat_s)
        self.max_outstanding = welcome.max_outstanding

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in list(self._pending.values()):
            if not p.final.done():
                p.final.set_exception(ControllerUnreachable("the client was closed"))
                p.final.exception()
        self._pending.clear()
        if self._task is not None:  # `_watch` waits in wait_for, which can drop a cancel (aiotasks.py)
            await cancel_tasks([self._task])
        if self._sock is not None:
            if self.epoch is not None:  # say goodbye: the controller releases this client's work now
                with contextlib.suppress(Exception):
                    bye = protocol.encode(protocol.Bye("close"), 0, token=self.token)
                    await asyncio.wait_for(self._sock.send_multipart(bye), 0.2)
            if self._monitor is not None:
                with contextlib.suppress(Exception):
                    self._sock.disable_monitor()
                self._monitor.close(0)
            self._sock.close(0)

    # ------------------------------------------------------------ requests
    def _next_rid(self) -> int:
        self._rid = (self._rid + 1) & ((1 << 63) - 1)
        return self._rid

    def request(
        self,
        msg: protocol.Message,
        blobs: Sequence[bytes] = (),
        *,
        idempotent: bool = False,
        request_id: int | None = None,
    ) -> Pending:
        """Queue `msg`; the returned Pending's futures carry the replies. Raises ProtocolError
        (BadRequest-like) when the message would not decode on the controller."""
        if self._closed:
            raise ControllerUnreachable("the client is closed")
        if self.refused is not None:
            raise self.refused
        rid = self._next_rid() if request_id is None else request_id
        frames = protocol.encode(msg, rid, blobs, token=self.token)
        loop = asyncio.get_running_loop()
        pending = Pending(rid, frames, idempotent, loop.create_future())
        self._pending[rid] = pending
        if self._batches:
            self._batch.append(frames)  # with the others of this loop iteration (`_send_batch`)
            if len(self._batch) == 1:
                loop.call_soon(self._send_batch)
        else:
            self._send(frames)
        return pending

    def _send_batch(self) -> None:
        """The requests of one loop iteration as one message per `SEND_BATCH` (protocol rule 7)."""
        items, self._batch = self._batch, []
        if self._closed:
            return
        token = self.token  # a Welcome in between may have given a new one
        items = [f if f[2][8:] == token else protocol.stamp(f, token) for f in items]
        for message in protocol.pack(items, token, SEND_BATCH):
            self.batches_sent += protocol.is_batch(message)
            self._send(message)

    def send_raw(self, msg: protocol.Message, request_id: int = 0) -> None:
        """Fire and forget (Cancel, Heartbeat)."""
        if not self._closed:
            self._send(protocol.encode(msg, request_id, token=self.token))

    def forget(self, request_id: int) -> None:
        self._pending.pop(request_id, None)

    def _send_hello(self) -> None:
        self._hello_rid = self._next_rid()
        self._send(
            protocol.encode(
                protocol.Hello(
                    "client", self.name, protocol.PROTOCOL_MAJOR, protocol.PROTOCOL_MINOR, job=self.job
                ),
                self._hello_rid,
                token=self.token,  # a reconnect: the session goes on
            )
        )

    # ------------------------------------------------------------ the owner task
    def _send(self, frames: list[bytes]) -> None:
        """Hand frames to libzmq now; what it cannot take (high-water mark) waits in order."""
        if self._out or self._sync is None:
            self._out.append(frames)
        else:
            try:
                send_frames(self._sync, frames)
            except zmq.Again:
                self._out.append(frames)
        self._last_sent = time.monotonic()
        self._poke()

    def _poke(self) -> None:
        """Service the socket on the next loop iteration (its descriptor is edge-triggered: a send
        may consume the signal of a message that arrived meanwhile)."""
        if self._reader is not None:
            self._reader.poke()

    def _flush_out(self) -> None:
        """Hand libzmq what it could not take before (run at the start of every drain)."""
        while self._out and self._sync is not None:
            try:
                send_frames(self._sync, self._out[0])
            except zmq.ZMQError:
                return
            self._out.popleft()

    async def _own(self) -> None:
        """The socket's reader, heartbeats and disconnect events, until closed."""
        assert self._sync is not None
        # `tangram bench burst` wraps `_on_envelope` (looked up per message) to count finals
        self._reader = SocketReader(self._sync, self._on_frames, before=self._flush_out)
        try:
            while not self._closed:
                await self._watch(self.heartbeat_s / 2)
                self._tick()
                self._poke()
        finally:
            self._reader.close()

    async def _watch(self, seconds: float) -> None:
        """Wait `seconds`, noting libzmq's disconnect events (a request sent before a lost link may
        never have reached the controller, so it is resent on the next Welcome)."""
        mon = self._monitor
        if mon is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            self._on_monitor(await asyncio.wait_for(mon.recv_multipart(), seconds))
            while True:  # the rest of a burst of events
                self._on_monitor(await asyncio.wait_for(mon.recv_multipart(), 0))

    def _on_monitor(self, frames: list[bytes]) -> None:
        """One monitor event. A disconnect: resend on the next Welcome. A refused handshake
        (tangram.certs.HandshakeWatch): start() fails with KeyRefused; once connected, pending and
        later requests fail with it (libzmq does not reconnect after a refusal)."""
        msg = parse_monitor_message(frames)
        event = int(msg["event"])
        if event == zmq.EVENT_DISCONNECTED:
            self._disconnected, self._lost_at = True, time.monotonic()
            self._down = True  # the next frame from a controller makes the transport say Hello again
            return
        refused = self._handshake.seen(event, int(msg["value"]))
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.refused = None  # a later connection was let in (its key is back on the allow-list)
        if refused is None:
            return
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(refused)
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or self.refused is not None:
            return  # after a Welcome: libzmq keeps reconnecting after these; a restart may cause them
        self.refused = refused
        log.error("%s (to fix: %s)", refused.message, refused.hint)
        for p in list(self._pending.values()):
            if not p.final.done():
                p.final.set_exception(refused)
        self._pending.clear()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_sent >= self.heartbeat_s and self.epoch is not None:  # after a Welcome
            self._send(protocol.encode(protocol.Heartbeat(), 0, token=self.token))
        if not self._down and now - self._last_recv > 3 * self.heartbeat_s and self._reader is not None:
            self._reader.drain()  # what arrived while this process waited for a core counts
        if not self._down and now - self._last_recv > 3 * self.heartbeat_s:
            self._down = True
            log.warning("controller %s silent for %.1fs", self.addr, now - self._last_recv)
        quiet = 5 * self.heartbeat_s
        if self._down and now - self._last_recv > quiet and now - self._reconnected > quiet:
            self._reconnect(now)

    def _reconnect(self, now: float) -> None:
        """A new connection: a route the controller keeps for a dead one frees up only once its
        ZMTP heartbeats time out, and a connection made before that never gets one (sessions)."""
        if self._sync is None:
            return
        self._reconnected = now
        self.reconnects += 1
        with contextlib.suppress(zmq.ZMQError):
            self._sync.disconnect(self.addr)
        with contextlib.suppress(zmq.ZMQError):
            self._sync.connect(self.addr)
        self._disconnected, self._lost_at = True, now  # what libzmq still held is gone: resend on Welcome

    def _on_frames(self, frames: list[bytes]) -> int:
        """One message from the controller (a batch: each item); returns how many it carried."""
        self._last_recv = time.monotonic()
        try:
            envs = protocol.decode_all(frames)
        except ProtocolError as exc:
            log.warning("undecodable reply from the controller dropped: %s", exc)
            return 1
        if self._down:
            self._down = False
            self._send_hello()  # re-register; pending requests are resent on Welcome
        for env in envs:  # one, or the items of a batch
            if isinstance(env, protocol.BadItem):
                log.warning("undecodable reply to request %d: %s", env.request_id, env.error)
                pending = self._pending.pop(env.request_id, None)
                if pending is not None and not pending.final.done():
                    pending.final.set_exception(env.error)
            else:
                self._on_envelope(env)
        return len(envs)

    def _on_envelope(self, env: protocol.Envelope) -> None:
        msg = env.msg
        if isinstance(msg, protocol.Welcome):
            self._on_welcome(msg)
            return
        if isinstance(msg, protocol.Reject):
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_exception(VersionMismatch(f"controller refused the client: {msg.reason}"))
            return
        if isinstance(msg, protocol.Heartbeat):
            return
        pending = self._pending.get(env.request_id)
        if pending is None:
            if isinstance(msg, (protocol.Result, protocol.Error)) and env.request_id != self._hello_rid:
                self.stray_replies += 1  # a second final, or one for a request given up on
            return
        pending.accepted = True
        if isinstance(msg, protocol.Accepted):
            return
        self._pending.pop(env.request_id, None)
        if pending.final.done():
            return
        if isinstance(msg, protocol.Error):
            exc = msg.to_exception()
            if isinstance(exc, ActionTimeout) and env.blobs:  # what a timed-out exec wrote (1.4)
                exc.with_output(env.blobs)
            pending.final.set_exception(exc)
        else:
            pending.final.set_result(env)

    def _on_welcome(self, msg: protocol.Welcome) -> None:
        self._batches = msg.minor >= protocol.BATCH_MINOR
        self._flag_resends = msg.minor >= protocol.RESEND_MINOR
        token = bytes.fromhex(msg.session)
        if token != self.token:  # a new session (the first, or a controller restarted without state)
            self.token = token
            self._out = collections.deque(protocol.stamp(f, token) for f in self._out)
            for p in self._pending.values():
                p.frames = protocol.stamp(p.frames, token)
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_result(msg)
            return
        restarted = self.epoch is not None and msg.controller_epoch != self.epoch
        self.epoch = msg.controller_epoch
        lost, self._disconnected = self._disconnected, False
        if not restarted and not lost:
            return  # the same controller over an unbroken link: it has every request (TCP), none resent
        if restarted:
            self.restarts += 1
            log.warning("controller %s restarted (epoch %d): resending %d pending requests",
                        self.addr, msg.controller_epoch, len(self._pending))
        # Requests sent after the link was seen lost waited in libzmq's queue and reach the new
        # peer by themselves, and so do those sent after this Welcome: resending them would only
        # earn a second copy of their reply. The resend waits until the rest of what is on the
        # socket was read: a final reply that crossed the Welcome answers its request, which is
        # then not resent (nor answered twice).
        cut = self._lost_at if lost else time.monotonic()
        asyncio.get_running_loop().call_soon(self._resend, cut, restarted, msg.durable)

    def _resend(self, cut: float, restarted: bool, durable: bool) -> None:
        if self._closed:
            return
        if self._reader is not None:
            self._reader.drain()
        for rid, p in list(self._pending.items()):
            if p.sent_at > cut:
                continue
            # With its original id: a restarted controller that kept its state (``--state``,
            # Welcome.durable) answers a request that ran with its recorded reply, or NODE_LOST
            # when it was still running, and submits one that had only been queued: nothing runs
            # twice. A controller without state cannot tell: only idempotent requests go again.
            if restarted and not durable and not p.idempotent:
                self._pending.pop(rid, None)
                if not p.final.done():
                    p.final.set_exception(
                        NodeLost("the controller restarted without its state; the request's outcome is "
                                 "unknown and it was not resent")
                    )
                continue
            self.resent += 1
            p.sent_at = time.monotonic()
            # Marked (1.8): if its final reply is already on its way over this connection, the
            # controller does not send it again (a copy would only be a stray reply here).
            self._send(protocol.as_resend(p.frames) if self._flag_resends and self.token else p.frames)

