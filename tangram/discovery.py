"""Find a running cluster from its state file. Stdlib only: the client imports this, not tangram_cli.

    from tangram.discovery import find_address
    addr = os.environ.get("TANGRAM_ADDR") or find_address("local")   # "tcp://127.0.0.1:PORT" or None

`tangram up` writes ``$TANGRAM_HOME/clusters/<cluster>/state.json`` (``TANGRAM_HOME`` defaults to
``~/.tangram``); ``address`` is the controller's submit socket. A state whose controller process is
gone (or whose pid now belongs to another program) is stale and yields None.
"""

from __future__ import annotations

import json
import os

DEFAULT_CLUSTER = "local"

__all__ = [
    "DEFAULT_CLUSTER",
    "find_address",
    "find_certs",
    "pid_alive",
    "read_state",
    "state_file",
    "tangram_home",
]


def tangram_home() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get("TANGRAM_HOME") or "~/.tangram"))


def state_file(cluster: str = DEFAULT_CLUSTER) -> str:
    return os.path.join(tangram_home(), "clusters", cluster, "state.json")


def read_state(cluster: str = DEFAULT_CLUSTER) -> dict | None:
    """The parsed state.json of ``cluster``, or None when missing or unreadable."""
    if not cluster or "/" in cluster or cluster.startswith("."):
        return None
    try:
        with open(state_file(cluster), encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def pid_alive(pid: object, cmdline_words: tuple[str, ...] = ()) -> bool:
    """True when ``pid`` runs (not a zombie) and, if words are given, its command line has one."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            if fh.read().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        pass
    if not cmdline_words:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc: trust kill(0)
    return any(w in cmd for w in cmdline_words)


def find_address(cluster: str = DEFAULT_CLUSTER) -> str | None:
    """``tcp://HOST:PORT`` of the running cluster's submit socket, or None."""
    raw = read_state(cluster)
    if raw is None:
        return None
    if not pid_alive(raw.get("controller_pid"), ("tangram", "controller")):
        return None
    addr = raw.get("address")
    if isinstance(addr, str) and addr.startswith("tcp://"):
        return addr
    ports = raw.get("ports") or {}
    host = raw.get("advertise") or raw.get("bind") or "127.0.0.1"
    port = ports.get("submit") if isinstance(ports, dict) else None
    if not isinstance(port, int) or port <= 0:
        return None
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


def find_certs(addr: str) -> str | None:
    """The CURVE certs directory of the recorded cluster whose submit or status address is ``addr``,
    or None (no such cluster, or it runs without CURVE)."""
    root = os.path.join(tangram_home(), "clusters")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        raw = read_state(name)
        if raw is None:
            continue
        if addr not in (raw.get("address"), raw.get("status_address"), raw.get("submit_addr")):
            continue
        certs = raw.get("certs")
        if isinstance(certs, str) and certs and os.path.isdir(certs):
            return certs
    return None
