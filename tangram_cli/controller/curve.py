"""CURVE "Ironhouse" on the controller's three ROUTER sockets (docs/security.md).

- The controller holds the server keypair (``controller.key_secret`` in the certs directory).
- One ``AsyncioAuthenticator`` runs in the controller's own context, started before any bind.
- Each socket has its own ZAP domain and allow-list: ``agents`` takes only agent keys
  (``certs/agents/``), ``submit`` only client keys (``certs/clients/``), ``status`` client keys
  and the status key (``certs/clients/`` + ``certs/status/``). Allow-lists are re-read when a
  directory changes, so removing a public key revokes it for new connections (``tangram keys
  revoke NAME`` does that for ``certs/clients/NAME.key``).
- A key's *name* is its allow-list file's stem (``clients/alice.key`` -> ``alice``);
  ``ServerAuth.name_of(user_id)`` maps the User-Id ZAP gave a connection to it.
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
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from tangram.certs import keypair, read_cert
from tangram.errors import ConfigError

log = logging.getLogger("tangram.controller.auth")

DOMAINS = {"agents": ("agents",), "submit": ("clients",), "status": ("clients", "status")}
ZAP_DOMAIN = "tangram-{}"


class AllowList:
    """Public keys (Z85) read from certificate files in some directories; re-read on change.

    Each key's name is the stem of the first file holding it (``clients/alice.key`` -> ``alice``)."""

    def __init__(self, dirs: list[Path], quiet: set[bytes] | None = None) -> None:
        self.dirs = dirs
        self.quiet = quiet if quiet is not None else set()  # the self-test's own probe keys
        self._stamp: tuple[float, ...] = ()
        self._names: dict[bytes, str] = {}

    def _fresh(self) -> dict[bytes, str]:
        stamp = tuple(_mtime(d) for d in self.dirs)
        if stamp != self._stamp:
            found: dict[bytes, str] = {}
            for d in self.dirs:
                for path in sorted(d.glob("*.key")) if d.is_dir() else ():
                    with contextlib.suppress(ConfigError):
                        found.setdefault(read_cert(str(path))[0], path.stem)
            self._names, self._stamp = found, stamp
        return self._names

    def keys(self) -> frozenset[bytes]:
        return frozenset(self._fresh())

    def name_of(self, key: bytes) -> str | None:
        return self._fresh().get(key)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self._fresh()
        if not ok and key not in self.quiet:
            log.warning(
                "refused CURVE key %s on %s (not on its allow-list %s; `tangram keys add NAME` adds one)",
                key.decode(errors="replace"),
                domain,
                " + ".join(f"{d}/" for d in self.dirs),
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

    def name_of(self, user_id: str | bytes) -> str | None:
        """The name of the key a connection authenticated with, or None.

        ``user_id`` is the ``User-Id`` property of a received frame (``frame.get("User-Id")``): the
        Z85 public key ZAP accepted for that connection. The name is the stem of the allow-list file
        that holds the key: ``clients/alice.key`` -> ``"alice"`` (``tangram keys add alice``),
        ``clients/client.key`` -> ``"client"`` (the cluster's default client key, what the local
        user's client library uses), ``status/status.key`` -> ``"status"``, ``agents/agent-n1.key``
        -> ``"agent-n1"``. Looked up in ``clients/``, then ``status/``, then ``agents/``.

        None when the key is on no allow-list (now): it was revoked after this connection was
        accepted (connections that are up stay up), or ``user_id`` is empty (plain TCP: no keys,
        no names). The allow-lists are re-read when their directories change, so the answer follows
        ``tangram keys add/revoke`` without a restart; each call costs a ``stat`` per directory,
        so call it when a session starts (Hello), not per message."""
        key = user_id.encode() if isinstance(user_id, str) else bytes(user_id)
        if not key:
            return None
        for domain in ("submit", "status", "agents"):
            name = self.allow[domain].name_of(key)
            if name is not None:
                return name
        return None

    def start(self, on_dead: Callable[[str], None] | None = None) -> None:
        """Start the ZAP handler in the controller's context; call before any bind."""
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
        """Close the ZAP handler now (sync callers; ``aclose`` on a loop that lives on)."""
        auth, self.auth = self.auth, None
        if auth is not None:
            auth.stop()

    async def aclose(self) -> None:
        """Stop the ZAP handler: its task first, then its socket. pyzmq's ``stop`` closes the socket
        while the cancelled task has yet to unregister its descriptor from the loop; a ZAP socket
        made next on the same loop (a controller restarted in this process) may get that descriptor
        number and lose its reader to the late cleanup, and then no handshake is ever answered."""
        auth, self.auth = self.auth, None  # None: stopped on purpose, `died` stays quiet
        if auth is None:
            return
        task = getattr(auth, "_AsyncioAuthenticator__task", None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
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
