"""Cluster state on the operator's machine: ``~/.tangram/clusters/<name>/`` (root: ``TANGRAM_HOME``).

    clusters/<name>/state.json    controller pid, address, ports, hosts, bundle hash, started_at
    clusters/<name>/state.lock    flock held while `up`/`down` change the cluster
    clusters/<name>/logs/         controller.log, agent logs of local nodes
    clusters/<name>/journal       the controller's event journal (appended to across restarts)
    clusters/<name>/state.jsonl   the controller's durable state (``--state``), replayed at start
    clusters/<name>/controller.json, controller.ready   its configuration and its bound ports

Each cluster gets a unique ``cluster_id`` when `up` starts it afresh (``new_cluster_id``). It is in the
controller's configuration, in every agent's ``agent.json``, and on every sandbox container (label
``tangram.cluster-id``, and in the container's name), so two clusters of one name (two users, or two
``TANGRAM_HOME``s, on one Docker daemon) never touch each other's containers: agents list, adopt and sweep
only their id's, and `down` removes only its own. A state written before ids existed has none
(``cluster_id == ""``, legacy): then nothing is swept by the bare name.

``state.json`` is written atomically (temporary file, fsync, rename) under an exclusive flock, and is
used only to *find* a cluster: the controller's status socket is the truth about what runs. A state
whose controller pid is gone (or now belongs to another program) is stale; ``load`` reports it and
``find_address`` ignores it.

Clients that must not import ``tangram_cli`` use the stdlib twin ``tangram.discovery``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tangram import discovery
from tangram.errors import ClusterNotFound, ControllerUnreachable, TangramError

# Imported where used, not here (start-up cost, ~0.15 s): pyzmq, the protocol and the CURVE keys, which only
# asking a controller (`query_status`) needs; `env`, `keys`, `logs`, `down` and the bootstrap only read and
# write the state files.

STATE_VERSION = 1
DEFAULT_CLUSTER = discovery.DEFAULT_CLUSTER


def home() -> Path:
    return Path(discovery.tangram_home())


def clusters_root() -> Path:
    return home() / "clusters"


def cluster_dir(name: str) -> Path:
    return clusters_root() / name


def state_path(name: str) -> Path:
    return cluster_dir(name) / "state.json"


def logs_dir(name: str) -> Path:
    return cluster_dir(name) / "logs"


def journal_path(name: str) -> Path:
    return cluster_dir(name) / "journal"


def controller_state_path(name: str) -> Path:
    """The controller's durable state (``tangram controller --state``); kept across restarts.
    (``state_path`` is the operator's ``state.json``, a different file.)"""
    return cluster_dir(name) / "state.jsonl"


def controller_config_path(name: str) -> Path:
    """The controller's resolved configuration (``--config``), written by `up`."""
    return cluster_dir(name) / "controller.json"


def ensure_dirs(name: str) -> Path:
    d = cluster_dir(name)
    for p in (home(), clusters_root(), d, d / "logs"):
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def new_cluster_id() -> str:
    """A fresh cluster id: 12 random hex digits (48 bits)."""
    return secrets.token_hex(6)


@dataclass
class HostState:
    """One node of the cluster as `up` left it."""

    name: str
    host: str = "localhost"
    connection: str = "local"  # "local" (process on this machine) or "ssh"
    port: int = 22
    user: str = ""
    workdir: str = ""  # the agent's run directory (where agent.pid lives)
    pid: int | None = None  # local agents only
    identity_file: str | None = None
    host_key_policy: str = "accept-new"
    connect_timeout_ms: int = 10_000
    python: str = "python3"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HostState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass
class ClusterState:
    name: str
    controller_pid: int | None = None
    bind: str = "127.0.0.1"
    advertise: str = "127.0.0.1"
    ports: dict[str, int] = field(default_factory=dict)  # agents, submit, status
    hosts: list[HostState] = field(default_factory=list)
    bundle: str = ""
    started_at: float = 0.0  # time.time() when the controller started
    inventory: str = ""  # the inventory file, or "<local default>"
    executor: str = ""
    gpus: str = ""  # e.g. "8 emulated x 80GiB"
    certs: str = ""  # CURVE certs directory (tangram_cli/keys.py); "" = plain TCP on loopback
    cluster_id: str = ""  # unique per cluster (new_cluster_id); "" = a legacy state, made before ids
    # Hosts the last `up` could not bootstrap: {"node", "destination", "step", "reason", "at"} each
    # (bootstrap/failures.py); `status` shows them as failed nodes.
    failed: list[dict[str, Any]] = field(default_factory=list)
    version: int = STATE_VERSION

    # ---------------------------------------------------------------- addresses

    def _url(self, port_name: str) -> str:
        host = self.advertise or self.bind or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.ports.get(port_name, 0)}"

    @property
    def address(self) -> str:
        """What clients dial (TANGRAM_ADDR): the submit socket."""
        return self._url("submit")

    @property
    def status_address(self) -> str:
        return self._url("status")

    @property
    def agents_address(self) -> str:
        return self._url("agents")

    def controller_alive(self) -> bool:
        return pid_alive(self.controller_pid, ("tangram", "controller"))

    def controller_is_ours(self) -> bool:
        """Stricter than ``controller_alive``: the recorded pid runs *this* cluster's controller
        (its command line names our ``controller.json``), so a recycled pid is never mistaken
        for it, nor signalled."""
        return pid_alive(self.controller_pid, (str(controller_config_path(self.name)),))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["address"] = self.address
        d["status_address"] = self.status_address
        d["submit_addr"] = self.address  # the key tangram.client reads
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterState:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values["hosts"] = [HostState.from_dict(h) for h in raw.get("hosts") or () if isinstance(h, dict)]
        values["ports"] = {str(k): int(v) for k, v in (raw.get("ports") or {}).items()}
        values["failed"] = [f for f in raw.get("failed") or () if isinstance(f, dict)]
        return cls(**values)


# -------------------------------------------------------------------- processes


def pid_alive(pid: int | None, cmdline_words: tuple[str, ...] = ()) -> bool:
    """True when ``pid`` runs and (if words are given) its command line mentions one of them,
    so a pid recycled by an unrelated program counts as dead (stale)."""
    return discovery.pid_alive(pid, cmdline_words)


# -------------------------------------------------------------------- locking and I/O


@contextlib.contextmanager
def locked(name: str, *, timeout_s: float = 30.0) -> Iterator[None]:
    """Exclusive flock on ``clusters/<name>/state.lock`` (one `up`/`down` at a time)."""
    ensure_dirs(name)
    fd = os.open(cluster_dir(name) / "state.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise ClusterNotFound(
                        f"cluster {name!r} is locked by another `tangram up`/`down`",
                        hint="wait for it to finish, then retry",
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def write(state: ClusterState) -> Path:
    """Write ``state.json`` atomically (tmp + fsync + rename). Callers hold ``locked(name)``."""
    ensure_dirs(state.name)
    path = state_path(state.name)
    tmp = path.with_name(f".state.json.{os.getpid()}.tmp")
    data = json.dumps(state.to_dict(), indent=2, sort_keys=True) + "\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def load(name: str) -> ClusterState | None:
    """The recorded state of cluster ``name``, or None (no file, or unreadable)."""
    raw = discovery.read_state(name)
    if raw is None:
        return None
    try:
        return ClusterState.from_dict(raw)
    except (TypeError, ValueError):
        return None


def remove(name: str, *, purge: bool = False) -> None:
    """Forget the cluster: state.json (and with ``purge`` the whole directory, logs included)."""
    d = cluster_dir(name)
    if purge:
        shutil.rmtree(d, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        state_path(name).unlink()


def names() -> list[str]:
    """Every cluster with a state file, sorted."""
    root = clusters_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())


def running() -> list[ClusterState]:
    out = []
    for n in names():
        st = load(n)
        if st is not None and st.controller_alive():
            out.append(st)
    return out


def find(name: str | None = None) -> ClusterState:
    """The cluster to talk to: ``name``; else $TANGRAM_CLUSTER; else the only running one; else
    ``local``. Raises ClusterNotFound (exit 4) when there is no state or its controller is gone."""
    name = name or os.environ.get("TANGRAM_CLUSTER") or None
    if name is None:
        live = running()
        name = live[0].name if len(live) == 1 else DEFAULT_CLUSTER
    st = load(name)
    if st is None:
        others = ", ".join(names()) or "none"
        raise ClusterNotFound(
            f"no cluster named {name!r} (known clusters: {others})",
            hint="start one with `tangram up` (local) or `tangram up INVENTORY`, or pass -c NAME",
        )
    if not st.controller_alive():
        raise ClusterNotFound(
            f"cluster {name!r} is not running (controller pid {st.controller_pid} is gone; stale state)",
            hint="run `tangram up` to start it again, or `tangram down` to clean up",
        )
    return st


def find_address(name: str = DEFAULT_CLUSTER) -> str | None:
    """The client address (``tcp://host:port`` of the submit socket) of a running cluster, or None."""
    return discovery.find_address(name)


# -------------------------------------------------------------------- the status socket
# pyzmq, tangram.protocol and tangram.certs are imported inside these functions, not at the top:
# only a status query needs them, and commands that never query (`env`, `keys`) import this module.


def query_status(
    address: str,
    *,
    sections: tuple[str, ...] = (),
    limit: int = 50,
    timeout_s: float = 2.0,
    certs: str | None = None,
) -> dict[str, Any]:
    """One ``StatusReq`` to the controller's status socket; the ``Status.records`` mapping.

    ``certs``: the cluster's CURVE certs directory (``ClusterState.certs``); the status keypair
    there is used. Without it, the recorded cluster of ``address`` (if any) supplies its certs.

    Raises ControllerUnreachable (exit 4) when nothing answers within ``timeout_s``. If the
    controller wants a ``Hello(role="status")`` first (it answers the bare request with an
    error), the hello is sent and the request repeated once.
    """
    import zmq  # start-up cost: see the note at the top

    sock = _status_socket(address, timeout_s, certs)
    try:
        sock.connect(address)
        return _ask_status(sock, address, sections, limit, timeout_s)
    except zmq.ZMQError as exc:
        raise ControllerUnreachable(f"cannot talk to the controller at {address}: {exc}") from None
    finally:
        sock.close(0)


def _status_socket(address: str, timeout_s: float, certs: str | None) -> Any:
    """A DEALER for the status socket: bounded waits and message size, the status CURVE keys."""
    import zmq  # start-up cost: see the note at the top

    from tangram import protocol as p  # start-up cost: see the note at the top
    from tangram.certs import load_dir  # start-up cost: see the note at the top

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    try:
        certs = certs or discovery.find_certs(address)
        if certs:
            load_dir(certs, role="status").apply(sock)
    except BaseException:
        sock.close(0)
        raise
    return sock


def _ask_status(
    sock: Any, address: str, sections: tuple[str, ...], limit: int, timeout_s: float
) -> dict[str, Any]:
    """Send the request (and, when refused before any hello, the hello and the request again);
    the records of the answer to it."""
    from tangram import protocol as p  # start-up cost: see the note at the top

    deadline = time.monotonic() + timeout_s
    rid = 1
    said_hello = False
    while True:
        sock.send_multipart(p.encode(p.StatusReq(sections=list(sections), limit=limit), rid))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise ControllerUnreachable(f"no answer from the controller's status socket {address}")
            env = p.decode(sock.recv_multipart())
            if env.request_id != rid:
                continue
            msg = env.msg
            if isinstance(msg, p.Status):
                return dict(msg.records)
            if isinstance(msg, p.Error | p.Reject) and not said_hello:
                break
            if isinstance(msg, p.Error):
                raise TangramError(f"status request refused: {msg.code}: {msg.message}")
            if isinstance(msg, p.Reject):
                raise TangramError(f"status request refused: {msg.reason}")
        said_hello = True
        rid += 1
        hello = p.Hello(
            role="status", name=f"status-{os.getpid()}", major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR
        )
        sock.send_multipart(p.encode(hello, 0))
        rid += 1
