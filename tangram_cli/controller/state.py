"""Controller-side records shared by the gateway (clients) and the agent link (nodes).

The core decides; these records only remember what the driver needs to turn commands into
messages and agent replies into client replies: who asked (client identity, request id),
what to run (command, environment, payload), and what came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from tangram import protocol
from tangram.clock import Clock, WallClock
from tangram.errors import ProtocolError
from tangram.outcomes import CallOutcome, ExecOutcome

log = logging.getLogger("tangram.controller")


@dataclass(slots=True)
class Outcome:
    """What an agent answered for one dispatch: a typed result + blobs, or an error."""

    result: ExecOutcome | CallOutcome | None = None
    blobs: tuple[bytes, ...] = ()
    error: protocol.Error | None = None

    @classmethod
    def of_reply(cls, kind: type[ExecOutcome | CallOutcome], env: protocol.Envelope) -> Outcome:
        """The agent's `Result` or `Error`; a result body of the wrong shape becomes an INTERNAL error."""
        if isinstance(env.msg, protocol.Error):
            return cls(error=env.msg)
        try:
            return cls(result=kind.from_body(env.msg.body), blobs=env.blobs)  # type: ignore[union-attr]
        except ProtocolError as exc:
            return cls(error=protocol.Error("INTERNAL", f"the agent's result does not parse: {exc}", False))


@dataclass(slots=True)  # one per unfinished action: at 10^5 of them, slots halve the memory
class ActionRecord:
    action_id: str
    kind: str  # exec | call | lease | open
    ident: bytes  # the client's routing identity
    request_id: int
    client: str  # the core's client key (identity hex)
    submitted: float  # controller clock (Registry.clock)
    deadline: float  # controller clock
    sandbox: str = ""
    cmd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    stdin: bytes | None = None
    service: str = ""
    payload: bytes = b""
    units: int = 1
    started: float | None = None
    node: str = ""
    cores: tuple[int, ...] = ()
    dop: int = 0
    gpus: tuple[int, ...] = ()
    loaded: bool = False
    kill_reason: str = ""
    outcome: Outcome | None = None
    final_sent: bool = False
    granted: bool = False
    release: tuple[bytes, int] | None = None  # (ident, request id) of a Release waiting for Done


@dataclass
class SandboxRecord:
    sandbox: str
    ident: bytes
    client: str
    image: str
    mem_mib: int
    reserve: int
    opened: float = 0.0  # controller clock
    node: str = ""
    ready: asyncio.Future[None] | None = None  # set when CreateSandbox (and pending puts) finished
    pending_puts: list[tuple[str, bytes]] = field(default_factory=list)
    pending_bytes: int = 0
    closed: bool = False
    lost: bool = False
    busy: int = 0  # actions running in it now
    restoring: bool = False  # restored after a controller restart, waiting for its node's agent
    deferred: list[tuple[bytes, int, Any, tuple[bytes, ...]]] = field(default_factory=list)  # held requests


class Registry:
    """Actions and sandboxes by id, and the controller's one clock; one instance per controller.

    Every time the controller keeps (submission, deadlines, heartbeats, cache expiry) is read
    from `clock` (a `tangram.clock.Clock`: `WallClock` live, `VirtualClock` in tests)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or WallClock()
        self.actions: dict[str, ActionRecord] = {}
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.waits: list[float] = []  # recent queueing delays (s), for the status p50

    def record_wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        if len(self.waits) > 2048:
            del self.waits[:1024]

    def wait_p50(self) -> float | None:
        if not self.waits:
            return None
        tail = sorted(self.waits[-1000:])
        return tail[len(tail) // 2]


# ---------------------------------------------------------------- sockets


def check_loopback(bind: str) -> None:
    """Plain TCP only on loopback; with CURVE (``check_bind(bind, curve=True)``) any interface address."""
    check_bind(bind, curve=False)


def check_bind(bind: str, *, curve: bool) -> None:
    host = bind.strip("[]")
    if host == "localhost":
        return
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"--bind must be an IP address, got {bind!r}") from None
    if addr.is_unspecified:
        raise ValueError(f"refusing to bind {bind}: name one interface address, not every interface")
    if not curve and not addr.is_loopback:
        raise ValueError(
            f"refusing to bind {bind}: plain TCP is only allowed on loopback addresses; "
            "pass --certs DIR (CURVE keys, which `tangram up INVENTORY` creates) or use --bind 127.0.0.1"
        )


def make_router(
    ctx: zmq.asyncio.Context,
    bind: str,
    port: int,
    secure: Callable[[zmq.asyncio.Socket], None] | None = None,
) -> tuple[zmq.asyncio.Socket, int]:
    """A ROUTER bound to ``bind:port``; ``secure`` (CURVE server options) runs before the bind."""
    sock = ctx.socket(zmq.ROUTER)
    if secure is not None:
        secure(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    sock.setsockopt(zmq.SNDTIMEO, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    host = "127.0.0.1" if bind == "localhost" else bind
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return sock, port
        sock.bind(f"tcp://{host}:*")
    except zmq.ZMQError as exc:
        sock.close(0)
        from tangram.errors import ConfigError

        raise ConfigError(
            f"cannot bind tcp://{host}:{port or '*'}: {exc}", hint="pick another port, or 0 for a free one"
        ) from None
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return sock, int(endpoint.rsplit(":", 1)[1])


def encode_to(
    ident: bytes, msg: protocol.Message, request_id: int, blobs: tuple[bytes, ...] | list[bytes] = ()
) -> list[bytes]:
    return [ident, *protocol.encode(msg, request_id, blobs)]


async def cancel_tasks(tasks: set[asyncio.Task[Any]]) -> None:
    for t in list(tasks):
        t.cancel()
    for t in list(tasks):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
