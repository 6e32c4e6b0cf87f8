"""CURVE keys on the connecting side (clients, `tangram status`, agents). Stdlib and pyzmq only.

Key files use ZeroMQ's certificate format (what ``zmq.auth.create_certificates`` writes):
``NAME.key`` holds the public key, ``NAME.key_secret`` the public and the secret key (mode 0600).
A key may also be given inline as its 40-character Z85 text.

A *certs directory* for a client holds ``client.key_secret`` (or ``status.key_secret`` for the
status reader) and ``controller.key`` (the server's public key, which the client pins):

    keys = load_dir("~/.tangram/clusters/rl-exp-42/certs", role="client")
    keys.apply(sock)            # before sock.connect(...)

``tangram up`` creates these (tangram_cli/keys.py); ``tangram env`` prints ``TANGRAM_CERTS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tangram.errors import ConfigError

Z85_KEY_LEN = 40


@dataclass(frozen=True)
class CurveKeys:
    """A client's keypair and the server key it pins (all Z85 bytes)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: Any) -> None:
        """Make ``sock`` a CURVE client of the controller (call before ``connect``)."""
        import zmq

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
    import zmq

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
    from tangram.discovery import find_certs

    found = find_certs(addr)
    return load_dir(found, role) if found else None
