"""CURVE keys on the connecting side (clients, `tangram status`, agents). Stdlib and pyzmq only.

Key files use ZeroMQ's certificate format (what ``zmq.auth.create_certificates`` writes):
``NAME.key`` holds the public key, ``NAME.key_secret`` the public and the secret key (mode 0600).
A key may also be given inline as its 40-character Z85 text.

A *certs directory* for a client holds ``client.key_secret`` (or ``status.key_secret`` for the
status reader) and ``controller.key`` (the server's public key, which the client pins):

    keys = load_dir("~/.tangram/clusters/rl-exp-42/certs", role="client")
    keys.apply(sock)            # before sock.connect(...)

``tangram up`` creates these (tangram_cli/keys.py); ``tangram env`` prints ``TANGRAM_CERTS``;
``tangram keys add NAME`` makes such a directory with a key of its own for one user or job.

A refused key is reported, not waited out: ``HandshakeWatch`` reads the connecting socket's monitor
events (``EVENT_HANDSHAKE_FAILED_AUTH``: the controller's ZAP handler said no;
``EVENT_HANDSHAKE_FAILED_PROTOCOL``: one side speaks CURVE, the other not) and turns them into a
``KeyRefused`` error (a ``ControllerUnreachable``) whose hint names the allow-list directory and
``tangram keys add``. libzmq does not reconnect after either, so waiting longer would not help.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.z85

from tangram.discovery import find_certs
from tangram.errors import ConfigError, ControllerUnreachable

Z85_KEY_LEN = 40


@dataclass(frozen=True)
class CurveKeys:
    """A client's keypair and the server key it pins (all Z85 bytes)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: Any) -> None:
        """Make ``sock`` a CURVE client of the controller (call before ``connect``)."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)

    def __repr__(self) -> str:  # never print the secret
        return f"CurveKeys(public={self.public.decode()!r}, server={self.server.decode()!r})"


def _is_z85(text: str) -> bool:
    return len(text) == Z85_KEY_LEN and os.sep not in text and "." not in text


def read_cert(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file; ConfigError when unreadable."""
    path = os.path.expanduser(path)
    public = secret = None
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                line = raw.strip()
                if line.startswith(b"public-key"):
                    public = line.split(b"=", 1)[1].strip(b" \t'\"")
                elif line.startswith(b"secret-key"):
                    secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    except OSError as exc:
        raise ConfigError(f"cannot read CURVE key {path}: {exc.strerror}") from None
    if public is None or len(public) != Z85_KEY_LEN:
        raise ConfigError(f"{path}: no CURVE public key in it", hint="expected a ZeroMQ certificate file")
    if secret is not None and len(secret) != Z85_KEY_LEN:
        raise ConfigError(f"{path}: malformed CURVE secret key")
    return public, secret


def public_key(spec: str) -> bytes:
    """A public key from a Z85 string or a certificate file path."""
    if _is_z85(spec):
        return spec.encode()
    return read_cert(spec)[0]


def keypair(secret_spec: str, public_spec: str | None = None) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate file (or a Z85 secret plus an optional public key)."""
    if _is_z85(secret_spec):
        secret = secret_spec.encode()
        public = None
    else:
        public, secret = read_cert(secret_spec)
        if secret is None:
            raise ConfigError(f"{secret_spec}: holds no secret key", hint="point at the .key_secret file")
    derived = zmq.curve_public(secret)
    if public_spec:
        public = public_key(public_spec)
    if public is not None and public != derived:
        raise ConfigError("CURVE public key does not match the secret key")
    return derived, secret


def load_dir(directory: str, role: str = "client") -> CurveKeys:
    """The ``role`` keypair and the controller's public key from a certs directory."""
    d = os.path.expanduser(directory)
    if not os.path.isdir(d):
        raise ConfigError(
            f"CURVE certs directory {directory} does not exist",
            hint="use the directory `tangram env` prints as TANGRAM_CERTS",
        )
    public, secret = keypair(os.path.join(d, f"{role}.key_secret"))
    server = public_key(os.path.join(d, "controller.key"))
    return CurveKeys(public, secret, server)


def client_keys(addr: str, certs: str | CurveKeys | None, role: str = "client") -> CurveKeys | None:
    """What a client of ``addr`` uses: ``certs`` if given, else ``$TANGRAM_CERTS``, else the certs
    of the recorded cluster whose address is ``addr`` (on the machine that ran `tangram up`), else
    None (plain TCP, which only a loopback controller without CURVE accepts)."""
    if isinstance(certs, CurveKeys):
        return certs
    if certs:
        return load_dir(certs, role)
    env = os.environ.get("TANGRAM_CERTS")
    if env:
        return load_dir(env, role)

    found = find_certs(addr)
    return load_dir(found, role) if found else None


def fingerprint(public: bytes) -> str:
    """A short, stable name for a public key (Z85): the first 16 hex digits of SHA-256 of its 32 bytes."""
    return hashlib.sha256(zmq.utils.z85.decode(public)).hexdigest()[:16]


# ---------------------------------------------------------------- refused handshakes


class KeyRefused(ControllerUnreachable):
    """The controller refused the handshake: the key is not on its allow-list, or one side uses CURVE
    and the other does not. Not retryable: libzmq does not reconnect after it, and the same key would be
    refused again until the operator changes the allow-list."""

    retryable = False


def handshake_events() -> int:
    """The monitor events ``HandshakeWatch`` reads (OR them into a monitor's event mask)."""
    return int(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )


class HandshakeWatch:
    """Turns the connecting side's handshake events into a ``KeyRefused`` (or None).

    ``role`` is ``client``, ``agent`` or ``status``; ``curve`` the keys this side uses (None: plain
    TCP). Feed every monitor event to ``seen(event, value)``: it returns the error to raise or log
    for an auth refusal (ZAP said no), a mechanism mismatch (CURVE against plain), or
    ``NO_DETAIL_LIMIT`` handshakes in a row that failed without detail (with CURVE: the pinned
    controller key is most likely not this controller's; without: the controller closed on a
    mechanism mismatch before saying which), else None.
    """

    NO_DETAIL_LIMIT = 3

    def __init__(self, addr: str, role: str, curve: CurveKeys | None, node: str = "") -> None:
        self.addr = addr
        self.role = role
        self.curve = curve
        self.node = node
        self.failed_no_detail = 0
        self.refused: KeyRefused | None = None

    def seen(self, event: int, value: int) -> KeyRefused | None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failed_no_detail = 0
            return None
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refused = self._auth(value)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.refused = self._protocol(value)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.failed_no_detail += 1
            if self.failed_no_detail < self.NO_DETAIL_LIMIT:
                return None
            self.refused = self._no_detail()
        else:
            return None
        return self.refused

    # -------------------------------------------------------- messages
    def _allow_dir(self) -> str:
        if self.role == "agent":
            node = self.node.replace("/", "_") or "NODE"
            return f"certs/agents/ (agent-{node}.key)"
        if self.role == "status":
            return "certs/status/ or certs/clients/"
        return "certs/clients/"

    def _auth(self, value: int) -> KeyRefused:
        key = self.curve.public.decode() if self.curve is not None else "?"
        fp = fingerprint(self.curve.public) if self.curve is not None else "?"
        who = f"agent {self.node}" if self.role == "agent" and self.node else f"this {self.role}"
        if self.role == "agent":
            fix = (
                f"the controller's allow-list is {self._allow_dir()} in the cluster's certs directory: "
                "re-run `tangram up` (it ships each node its own key), or check that this agent's "
                '"curve" keys belong to this cluster'
            )
        else:
            fix = (
                f"the controller's allow-list is {self._allow_dir()} in the cluster's certs directory; "
                "on the controller's machine `tangram keys add NAME` makes a key that is on it (then "
                "TANGRAM_CERTS=DIR or certs=DIR), `tangram keys list` shows the keys it takes; or point "
                "TANGRAM_CERTS at the certs directory of the cluster you mean"
            )
        return KeyRefused(
            f"the controller at {self.addr} refused {who}'s CURVE key {key} (fingerprint {fp}; "
            f"ZAP status {value}): it is not on the allow-list",
            hint=fix,
        )

    def _protocol(self, value: int) -> KeyRefused:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve is None:
                return KeyRefused(
                    f"the controller at {self.addr} requires CURVE keys and this {self.role} has none",
                    hint='use the cluster\'s keys: `eval "$(tangram env)"` sets TANGRAM_CERTS, or pass '
                    "certs=DIR; a cluster of another user needs a key of your own on its allow-list "
                    "(its owner runs `tangram keys add NAME`)",
                )
            return KeyRefused(
                f"this {self.role} uses CURVE keys but the controller at {self.addr} runs plain TCP",
                hint="for a plain (--insecure) controller unset TANGRAM_CERTS / certs=; "
                "else check the address",
            )
        return KeyRefused(
            f"the handshake with the controller at {self.addr} failed (ZMTP protocol error {value:#x})",
            hint="check that the address is a Tangram controller of the same version",
        )

    def _no_detail(self) -> KeyRefused:
        if self.curve is not None:
            return KeyRefused(
                f"the CURVE handshake with the controller at {self.addr} failed "
                f"{self.failed_no_detail} times in a row: the pinned controller key is not this "
                "controller's, or the controller runs plain TCP",
                hint="use the certs directory of the cluster you mean (`tangram env` prints it; its "
                "controller.key is the key pinned), or, for a plain (--insecure) controller, no keys",
            )
        return KeyRefused(
            f"the handshake with the controller at {self.addr} failed {self.failed_no_detail} times in a "
            f"row: it most likely requires CURVE keys and this {self.role} has none",
            hint='use the cluster\'s keys: `eval "$(tangram env)"` sets TANGRAM_CERTS, or pass certs=DIR; '
            "else check that the address is a Tangram controller",
        )
