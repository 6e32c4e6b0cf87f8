"""CURVE "Ironhouse" on the controller's three ROUTER sockets (reliability.md section 4).

- The controller holds the server keypair (``controller.key_secret`` in the certs directory).
- One ``AsyncioAuthenticator`` runs in the controller's own context, started before any bind.
- Each socket has its own ZAP domain and allow-list: ``agents`` takes only agent keys
  (``certs/agents/``), ``submit`` only client keys (``certs/clients/``), ``status`` client keys
  and the status key (``certs/clients/`` + ``certs/status/``). Allow-lists are re-read when a
  directory changes, so removing a public key revokes it for new connections.
- Fail closed: ``ZAP_ENFORCE_DOMAIN`` is set on every socket (refuse when no ZAP handler
  answers), and ``self_test`` connects to each socket with an unknown key and with NULL; the
  controller refuses to serve unless both are rejected. If the authenticator task dies, the
  controller is told to stop (``on_dead``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tangram.certs import keypair, read_cert
from tangram.errors import ConfigError

log = logging.getLogger("tangram.controller.auth")

DOMAINS = {"agents": ("agents",), "submit": ("clients",), "status": ("clients", "status")}
ZAP_DOMAIN = "tangram-{}"


class AllowList:
    """Public keys (Z85) read from certificate files in some directories; re-read on change."""

    def __init__(self, dirs: list[Path], quiet: set[bytes] | None = None) -> None:
        self.dirs = dirs
        self.quiet = quiet if quiet is not None else set()  # the self-test's own probe keys
        self._stamp: tuple[float, ...] = ()
        self._keys: frozenset[bytes] = frozenset()

    def keys(self) -> frozenset[bytes]:
        stamp = tuple(_mtime(d) for d in self.dirs)
        if stamp != self._stamp:
            found: set[bytes] = set()
            for d in self.dirs:
                for path in sorted(d.glob("*.key")) if d.is_dir() else ():
                    with contextlib.suppress(ConfigError):
                        found.add(read_cert(str(path))[0])
            self._keys, self._stamp = frozenset(found), stamp
        return self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys()
        if not ok and key not in self.quiet:
            log.warning(
                "refused CURVE key %s on %s (not on its allow-list)", key.decode(errors="replace"), domain
            )
        return ok


def _mtime(d: Path) -> float:
    try:
        return d.stat().st_mtime_ns
    except OSError:
        return -1.0


class ServerAuth:
    """The controller side of CURVE: server keys, ZAP handler, per-socket domains."""

    def __init__(self, ctx: zmq.asyncio.Context, certs: str) -> None:
        self.ctx = ctx
        self.dir = Path(os.path.expanduser(certs))
        secret_file = self.dir / "controller.key_secret"
        if not secret_file.is_file():
            raise ConfigError(
                f"--certs {certs}: no controller.key_secret there",
                hint="`tangram up` creates the keys; see docs/operations.md (Security)",
            )
        self.public, self.secret = keypair(str(secret_file))
        self._probe_keys: set[bytes] = set()
        self.allow = {
            name: AllowList([self.dir / sub for sub in subs], self._probe_keys)
            for name, subs in DOMAINS.items()
        }
        self.auth: Any = None
        self.enforce_domain = False
        self._node_keys: dict[str, str] = {}
        self._node_stamp = -2.0

    def node_key_matches(self, ident: bytes, user_id: str) -> bool:
        """True when ``user_id`` (the Z85 key ZAP accepted) is the key of node ``ident``, i.e. the
        public key in ``agents/agent-<node>.key``: a node cannot speak as another node."""
        node = ident.decode(errors="replace")
        path = self.dir / "agents" / f"agent-{node.replace('/', '_')}.key"
        stamp = _mtime(self.dir / "agents")
        if stamp != self._node_stamp:
            self._node_keys, self._node_stamp = {}, stamp
        key = self._node_keys.get(node)
        if key is None and len(self._node_keys) < 100_000:
            try:
                key = read_cert(str(path))[0].decode()
            except ConfigError:
                key = ""
            self._node_keys[node] = key
        return bool(key) and key == user_id

    def start(self, on_dead: Callable[[str], None] | None = None) -> None:
        """Start the ZAP handler in the controller's context; call before any bind."""
        from zmq.auth.asyncio import AsyncioAuthenticator

        self.auth = AsyncioAuthenticator(self.ctx, log=logging.getLogger("tangram.controller.zap"))
        self.auth.start()
        for name, allow in self.allow.items():
            self.auth.configure_curve_callback(ZAP_DOMAIN.format(name), allow)
        task = getattr(self.auth, "_AsyncioAuthenticator__task", None)
        if task is not None and on_dead is not None:

            def died(t: asyncio.Future[Any]) -> None:
                if t.cancelled() and self.auth is None:
                    return  # stopped on purpose
                why = "cancelled" if t.cancelled() else repr(t.exception())
                log.error("the ZAP authenticator died (%s): closing down", why)
                on_dead(why)

            task.add_done_callback(died)

    def secure(self, sock: zmq.Socket[Any], name: str) -> None:
        """Make ``sock`` a CURVE server in the ``name`` domain; call before bind."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.format(name).encode())
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            self.enforce_domain = True
        except (zmq.ZMQError, AttributeError) as exc:
            log.warning("ZAP_ENFORCE_DOMAIN unavailable in this libzmq (%s); relying on the self-test", exc)

    def stop(self) -> None:
        auth, self.auth = self.auth, None
        if auth is not None:
            auth.stop()

    async def self_test(self, addrs: dict[str, str], timeout_s: float = 5.0) -> None:
        """Refuse to serve unless an unknown CURVE key and a NULL client are both rejected on
        every socket. Raises RuntimeError naming what got in."""
        problems = []
        for name, addr in addrs.items():
            for mode in ("unknown-key", "null"):
                keys = zmq.curve_keypair() if mode == "unknown-key" else None
                if keys is not None:
                    self._probe_keys.add(keys[0])
                outcome = await probe(self.ctx, addr, self.public if keys else None, timeout_s, keys)
                if outcome != "refused":
                    problems.append(f"{name} socket: a {mode} client was {outcome}")
        if problems:
            raise RuntimeError("CURVE self-test failed (refusing to serve): " + "; ".join(problems))
        log.info(
            "CURVE on: unknown keys and NULL refused on agents, submit, status (ZAP_ENFORCE_DOMAIN %s)",
            "set" if self.enforce_domain else "unavailable",
        )


async def probe(
    ctx: zmq.asyncio.Context,
    addr: str,
    server_key: bytes | None,
    timeout_s: float = 5.0,
    keys: tuple[bytes, bytes] | None = None,
) -> str:
    """Connect once (a fresh random CURVE key when ``server_key`` is given, else NULL) and report
    ``refused``, ``accepted`` or ``not answered`` from the socket monitor's handshake events."""
    from zmq.utils.monitor import parse_monitor_message

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = keys or zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    events = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    mon = sock.get_monitor_socket(events)
    try:
        sock.connect(addr)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not await mon.poll(int(left * 1000) + 1):
                break
            event = parse_monitor_message(await mon.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "accepted"
            return "refused"
        return "not answered"
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        mon.close(0)
        sock.close(0)
