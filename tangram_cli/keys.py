"""CURVE keys of a cluster ("Ironhouse"): ``$TANGRAM_HOME/clusters/<name>/certs/`` (mode 0700).

    controller.key / controller.key_secret      the controller's server keypair
    client.key / client.key_secret              the default client keypair (TANGRAM_CERTS=this dir)
    status.key / status.key_secret              `tangram status` (read-only status socket)
    agent-<node>.key / agent-<node>.key_secret  one per node; `up` ships it to that node only
    agents/   allow-list of the agents socket: agent-<node>.key (public keys only)
    clients/  allow-list of the submit socket: client.key (add more public keys here)
    status/   allow-list of the status socket besides clients/: status.key

Files are ZeroMQ certificates (``zmq.auth.load_certificate`` reads them); secret files are
created 0600 (never chmod-ed after the fact), public files 0644. Creation is idempotent: an
existing keypair is kept, so re-running `up` changes nothing. The controller re-reads the
allow-list directories when they change, so deleting ``clients/NAME.key`` revokes that key
for new connections.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterable
from pathlib import Path

from tangram_cli import state as st

CONTROLLER = "controller"
CLIENT = "client"
STATUS = "status"
ALLOW_DIRS = ("agents", "clients", "status")


def certs_dir(cluster: str) -> Path:
    return st.cluster_dir(cluster) / "certs"


def agent_role(node: str) -> str:
    return f"agent-{node.replace('/', '_')}"


def _cert_text(public: bytes, secret: bytes | None) -> str:
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ****  Generated on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S} by tangram  ****",
        f"#   ZeroMQ CURVE **{kind}** Certificate",
    ]
    if secret:
        lines.append("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
    lines += ["", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int) -> None:
    """Atomic write with ``mode`` from creation on (no window where a secret is world-readable)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, mode)  # the umask may have narrowed a public file
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """``NAME.key`` (0644) and ``NAME.key_secret`` (0600) in ``directory``; kept if present."""
    import zmq

    pub, sec = directory / f"{name}.key", directory / f"{name}.key_secret"
    if sec.is_file():
        from tangram.certs import keypair

        public, _ = keypair(str(sec))
        if not pub.is_file() or pub.read_text().find(public.decode()) < 0:
            _write(pub, _cert_text(public, None), 0o644)
        return pub, sec
    public, secret = zmq.curve_keypair()
    _write(sec, _cert_text(public, secret), 0o600)
    _write(pub, _cert_text(public, None), 0o644)
    return pub, sec


def _allow(directory: Path, sub: str, pub: Path) -> None:
    target = directory / sub / pub.name
    text = pub.read_text()
    if not target.is_file() or target.read_text() != text:
        _write(target, text, 0o644)


def ensure_cluster_keys(cluster: str, nodes: Iterable[str] = ()) -> Path:
    """Create (idempotently) every key of ``cluster`` plus one per node; returns the certs dir."""
    st.ensure_dirs(cluster)
    d = certs_dir(cluster)
    d.mkdir(mode=0o700, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(d, 0o700)
    for sub in ALLOW_DIRS:
        (d / sub).mkdir(mode=0o755, exist_ok=True)
    ensure_keypair(d, CONTROLLER)
    _allow(d, "clients", ensure_keypair(d, CLIENT)[0])
    _allow(d, "status", ensure_keypair(d, STATUS)[0])
    for node in nodes:
        _allow(d, "agents", ensure_keypair(d, agent_role(node))[0])
    return d


def has_keys(cluster: str) -> bool:
    d = certs_dir(cluster)
    return (d / f"{CONTROLLER}.key_secret").is_file() and (d / f"{CLIENT}.key_secret").is_file()


def agent_files(certs: Path, node: str) -> dict[str, bytes]:
    """What `up` ships to ``node``: its own secret certificate and the controller's public key."""
    return {
        "agent.key_secret": (certs / f"{agent_role(node)}.key_secret").read_bytes(),
        "controller.key": (certs / f"{CONTROLLER}.key").read_bytes(),
    }
