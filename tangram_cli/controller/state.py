"""Controller-side records shared by the gateway (clients) and the agent link (nodes).

The core decides; these records only remember what the driver needs to turn commands into
messages and agent replies into client replies: who asked (client identity, request id),
what to run (command, environment, payload), and what came back.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from tangram import protocol
from tangram.clock import Clock, WallClock
from tangram.errors import ConfigError, ProtocolError
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
    deadline: float  # controller clock: the whole request, queueing included
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
    run_limit_s: float = 0.0  # exec/call: the longest run once started (the client's timeout); 0: none

    def run_budget(self, now: float) -> float:
        """Seconds an exec or call dispatched now may run: its run limit, within its deadline."""
        left = self.deadline - now
        return max(0.001, min(left, self.run_limit_s) if self.run_limit_s > 0 else left)


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


WILDCARDS = ("*", "", "0", "0.0.0.0", "::", "[::]")


def bind_addresses(bind: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """What ``bind`` listens on, as addresses: an IP literal (``[...]`` allowed; an IPv4-mapped IPv6
    address counts as its IPv4 address), ``localhost``, or a host name, which is resolved (every
    address it resolves to). ValueError when it is none of these."""
    host = bind.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return [ipaddress.ip_address("127.0.0.1")]
    try:
        found = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            raise ValueError(
                f"--bind {bind!r} is neither an IP address nor a host name that resolves ({exc})"
            ) from None
        found = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    out: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for addr in found:
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        out.append(mapped if mapped is not None else addr)
    return out


def check_bind(bind: str, *, curve: bool) -> None:
    """Refuse what would listen beyond this machine without keys, in any spelling.

    Never (CURVE or not) a wildcard: ``*``, ``0.0.0.0``, ``::``, ``[::]``, ``::ffff:0.0.0.0`` and
    names resolving to one (bind one configured interface address: docs/security.md). Without
    CURVE only loopback: ``127.0.0.0/8``, ``::1``, ``::ffff:127.x.y.z``, ``localhost``, and host names
    whose every address is loopback (names are resolved here, and the controller binds the address
    they resolve to: ``bind_host``)."""
    if bind.strip() in WILDCARDS:
        raise ValueError(f"refusing to bind {bind!r}: name one interface address, not every interface")
    addrs = bind_addresses(bind)
    if not addrs:
        raise ValueError(f"--bind {bind!r} resolves to no address")
    if any(a.is_unspecified for a in addrs):
        raise ValueError(f"refusing to bind {bind!r}: it means every interface; name one interface address")
    outside = [str(a) for a in addrs if not a.is_loopback]
    if not curve and outside:
        what = f"{bind} ({', '.join(outside)})" if outside != [bind.strip("[] ")] else bind
        raise ValueError(
            f"refusing to bind {what}: plain TCP is only allowed on loopback addresses; "
            "pass --certs DIR (CURVE keys, which `tangram up` creates) or use --bind 127.0.0.1"
        )


def bind_host(bind: str) -> str:
    """The IP literal to hand libzmq for ``bind`` (libzmq resolves no host names when binding):
    ``localhost`` -> ``127.0.0.1``, a host name -> the first address it resolves to."""
    host = bind.strip()
    if host == "localhost":
        return "127.0.0.1"
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return host
    except ValueError:
        pass
    addrs = bind_addresses(bind)
    return str(addrs[0]) if addrs else host


def make_router(
    ctx: zmq.asyncio.Context,
    bind: str,
    port: int,
    secure: Callable[[zmq.asyncio.Socket], None] | None = None,
    *,
    handover: bool = True,
    heartbeat_s: float = 0.0,
) -> tuple[zmq.asyncio.Socket, int]:
    """A ROUTER bound to ``bind:port``; ``secure`` (CURVE server options) runs before the bind.
    ``handover=False``: a second connection with a live routing identity gets no route (the submit
    socket: sessions.py); ``heartbeat_s`` > 0: ZMTP pings every that many seconds, and a connection
    silent for 5 of them is dropped (so a dead peer's route frees up)."""
    sock = ctx.socket(zmq.ROUTER)
    if secure is not None:
        secure(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1 if handover else 0)
    if heartbeat_s > 0:
        ivl = max(100, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * ivl)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    sock.setsockopt(zmq.SNDTIMEO, 0)
    sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
    host = bind_host(bind)
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

        raise ConfigError(
            f"cannot bind tcp://{host}:{port or '*'}: {exc}", hint="pick another port, or 0 for a free one"
        ) from None
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return sock, int(endpoint.rsplit(":", 1)[1])


def encode_to(
    ident: bytes, msg: protocol.Message, request_id: int, blobs: tuple[bytes, ...] | list[bytes] = ()
) -> list[bytes]:
    return [ident, *protocol.encode(msg, request_id, blobs)]
