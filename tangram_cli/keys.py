"""CURVE keys of a cluster ("Ironhouse"): ``$TANGRAM_HOME/clusters/<name>/certs/`` (mode 0700).

    controller.key / controller.key_secret      the controller's server keypair
    client.key / client.key_secret              the default client keypair (TANGRAM_CERTS=this dir)
    status.key / status.key_secret              `tangram status` (read-only status socket)
    agent-<node>.key / agent-<node>.key_secret  one per node; `up` ships it to that node only
    agents/   allow-list of the agents socket: agent-<node>.key (public keys only)
    clients/  allow-list of the submit socket: client.key, and NAME.key per `tangram keys add NAME`
    status/   allow-list of the status socket besides clients/: status.key
    users/NAME/  what `tangram keys add NAME` made for one user or job (unless --out DIR):
              client.key_secret (0600) + controller.key, a directory for TANGRAM_CERTS / certs=

The local default (`tangram up`, no inventory) has these keys too: its controller runs CURVE
on 127.0.0.1, and the local user's client library, `tangram status` and `demo` find them through
the cluster's state.json (``tangram.discovery.find_certs``). Another local user cannot read the
0700 directory, so cannot connect as an agent or a client.

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
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tangram.errors import ConfigError
from tangram_cli import state as st

# Imported where used, not here (start-up cost, ~40 ms): pyzmq and tangram.certs, which only making or reading
# a key needs; the bootstrap and `down` import this module for its paths and names.

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
    import zmq  # start-up cost: see the note at the top

    pub, sec = directory / f"{name}.key", directory / f"{name}.key_secret"
    if sec.is_file():
        from tangram.certs import keypair  # start-up cost: see the note at the top

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
    return ensure_keys(certs_dir(cluster), nodes)


def ensure_keys(d: Path, nodes: Iterable[str] = ()) -> Path:
    """Every key of a cluster in certs directory ``d`` (made 0700), plus one per node; idempotent.
    ``ensure_cluster_keys`` uses the cluster's directory; `tangram bench dispatch --curve` a temporary one."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
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


def agent_files(certs: Path, node: str) -> dict[str, bytes]:
    """What `up` ships to ``node``: its own secret certificate and the controller's public key."""
    return {
        "agent.key_secret": (certs / f"{agent_role(node)}.key_secret").read_bytes(),
        "controller.key": (certs / f"{CONTROLLER}.key").read_bytes(),
    }


# ---------------------------------------------------------------- per-client keys (`tangram keys`)

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
ROLES = {"clients": "client", "status": "status", "agents": "agent"}


@dataclass(frozen=True)
class KeyInfo:
    """One allow-listed public key: its name (the file's stem), role, fingerprint, where."""

    name: str
    role: str  # client | status | agent
    public: str  # Z85
    fingerprint: str
    path: str  # the allow-list file
    secret: str = ""  # the secret certificate's directory, when `keys add` put it in the cluster dir

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "role": self.role,
            "fingerprint": self.fingerprint,
            "public_key": self.public,
            "file": self.path,
            "secret_dir": self.secret,
        }


def _require_certs(cluster: str) -> Path:
    d = certs_dir(cluster)
    if not (d / f"{CONTROLLER}.key").is_file():
        raise ConfigError(
            f"cluster {cluster!r} has no CURVE keys ({d} holds no controller.key)",
            hint="start it with `tangram up` (CURVE is the default; a cluster started with --insecure "
            "takes no keys: `tangram down` then `tangram up`)",
        )
    return d


def check_key_name(name: str) -> str:
    if not re.fullmatch(NAME_PATTERN, name) or name.endswith(".key"):
        raise ConfigError(
            f"bad key name {name!r}",
            hint="use letters, digits, '_', '.', '-' (at most 64, starting with a letter or digit)",
        )
    return name


def user_dir(cluster: str, name: str) -> Path:
    """Where `tangram keys add NAME` puts the secret when no --out is given."""
    return certs_dir(cluster) / "users" / name


def add_client(cluster: str, name: str, out: Path | None = None) -> tuple[KeyInfo, Path]:
    """A new client keypair ``name`` for ``cluster``: the public key into ``clients/NAME.key`` (so
    the running controller takes it at once), and a directory usable as ``TANGRAM_CERTS`` (``out``,
    else ``certs/users/NAME/``; made 0700) holding ``client.key_secret`` (0600) and the
    controller's public key. Returns (the key, that directory). Refuses a name already in use."""
    import zmq  # start-up cost: see the note at the top

    from tangram.certs import fingerprint  # start-up cost: see the note at the top

    d = _require_certs(cluster)
    check_key_name(name)
    pub_path = d / "clients" / f"{name}.key"
    if pub_path.exists():
        raise ConfigError(
            f"a client key named {name!r} exists already ({pub_path})",
            hint=f"pick another name, or `tangram keys revoke {name}` first",
        )
    target = Path(os.path.expanduser(str(out))) if out is not None else user_dir(cluster, name)
    if (target / f"{CLIENT}.key_secret").exists():
        raise ConfigError(
            f"{target / (CLIENT + '.key_secret')} exists already", hint="give --out an empty or new directory"
        )
    if out is None:
        target.parent.mkdir(mode=0o700, exist_ok=True)  # certs/users/
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(target, 0o700)
    public, secret = zmq.curve_keypair()
    _write(target / f"{CLIENT}.key_secret", _cert_text(public, secret), 0o600)
    _write(target / f"{CLIENT}.key", _cert_text(public, None), 0o644)
    _write(target / f"{CONTROLLER}.key", (d / f"{CONTROLLER}.key").read_text(), 0o644)
    (d / "clients").mkdir(mode=0o755, exist_ok=True)
    _write(pub_path, _cert_text(public, None), 0o644)  # last: the controller takes it from here on
    info = KeyInfo(name, "client", public.decode(), fingerprint(public), str(pub_path), str(target))
    return info, target


def list_keys(cluster: str) -> list[KeyInfo]:
    """Every public key on the cluster's allow-lists (clients/, status/, agents/), by role and name."""
    from tangram.certs import fingerprint, read_cert  # start-up cost: see the note at the top

    d = _require_certs(cluster)
    out: list[KeyInfo] = []
    for sub, role in ROLES.items():
        folder = d / sub
        for path in sorted(folder.glob("*.key")) if folder.is_dir() else ():
            try:
                public = read_cert(str(path))[0]
            except ConfigError:
                continue
            secret = ""
            if role == "client":
                mine = user_dir(cluster, path.stem)
                if path.stem == CLIENT:
                    secret = str(d)
                elif (mine / f"{CLIENT}.key_secret").is_file():
                    secret = str(mine)
            out.append(KeyInfo(path.stem, role, public.decode(), fingerprint(public), str(path), secret))
    return out


def revoke_client(cluster: str, name: str) -> KeyInfo:
    """Remove ``clients/NAME.key`` (the controller refuses new connections with it at once; those
    up stay up) and the secret `keys add` kept in ``certs/users/NAME/``. Returns what was removed."""
    from tangram.certs import fingerprint, read_cert  # start-up cost: see the note at the top

    d = _require_certs(cluster)
    check_key_name(name)
    pub_path = d / "clients" / f"{name}.key"
    if not pub_path.is_file():
        known = ", ".join(k.name for k in list_keys(cluster) if k.role == "client") or "none"
        raise ConfigError(
            f"no client key named {name!r} (client keys: {known})", hint="see `tangram keys list`"
        )
    public = read_cert(str(pub_path))[0]
    pub_path.unlink()
    mine = user_dir(cluster, name)
    if mine.is_dir():
        shutil.rmtree(mine, ignore_errors=True)
    return KeyInfo(name, "client", public.decode(), fingerprint(public), str(pub_path), "")
