"""`tangram logs`: where a cluster's logs are, and printing or following them (docs/operations.md, section 6).

    clusters/<name>/logs/controller.log          the controller (`tangram up` starts it with output here)
    clusters/<name>/logs/agent-<node>.log        an agent on this machine (the local default's `local`)
    <node workdir>/<cluster>/agent.log           an agent started over SSH: read with `tail` over SSH

The nodes come from `state.json` and, once a cluster is down (no state), from the agent log files
left in `logs/`. Lines are printed as they are in the file (`text`), or each one as a JSON object
(`json`): a line of either log format (tangram/logfmt.py) as the JSON format's object, any other
line (a traceback, a process's own output) as ``{"raw": LINE}``. In `text`, a JSON log line is
shown in the text format, so one command reads both.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tangram import logfmt
from tangram.errors import ClusterNotFound, ConfigError, TangramError
from tangram_cli import state as st
from tangram_cli.bootstrap import plan

Emit = Callable[[str], None]
POLL_S = 0.2


@dataclass(frozen=True)
class LogSource:
    name: str  # "controller" or a node's name
    path: str  # a local file, or the agent.log on the node (ssh)
    host: Any = None  # the node's st.HostState when the log is read over SSH


def cluster_name(given: str | None) -> str:
    """``given``; else $TANGRAM_CLUSTER; else the only running cluster, else the only one with a
    directory (its logs outlive `down`), else ``local``."""
    if given or os.environ.get("TANGRAM_CLUSTER"):
        return given or os.environ["TANGRAM_CLUSTER"]
    live = st.running()
    if len(live) == 1:
        return live[0].name
    root = st.clusters_root()
    dirs = sorted(p.name for p in root.iterdir() if (p / "logs").is_dir()) if root.is_dir() else []
    return dirs[0] if len(dirs) == 1 else st.DEFAULT_CLUSTER


def sources(cluster: str) -> dict[str, LogSource]:
    """The controller's and every known node's log, by name (``controller`` first)."""
    logs = st.logs_dir(cluster)
    if not st.cluster_dir(cluster).is_dir():
        known = ", ".join(p.name for p in st.clusters_root().iterdir()) if st.clusters_root().is_dir() else ""
        raise ClusterNotFound(
            f"no cluster named {cluster!r} (known clusters: {known or 'none'})",
            hint="pass -c NAME, or start one with `tangram up`",
        )
    out = {"controller": LogSource("controller", str(logs / "controller.log"))}
    state = st.load(cluster)
    for h in state.hosts if state is not None else ():
        if h.connection == "ssh":
            out[h.name] = LogSource(h.name, f"{plan.sh_path(h.workdir)}/agent.log", h)
        else:
            out[h.name] = LogSource(h.name, str(logs / f"agent-{h.name}.log"))
    for p in sorted(logs.glob("agent-*.log")) if logs.is_dir() else ():
        name = p.name[len("agent-") : -len(".log")]
        out.setdefault(name, LogSource(name, str(p)))
    return out


def pick(cluster: str, which: str) -> LogSource:
    found = sources(cluster)
    if which in found:
        return found[which]
    known = ", ".join(found)
    raise ConfigError(
        f"no node {which!r} in cluster {cluster!r} (known: {known})",
        hint=f"`tangram logs controller`, or `tangram logs NODE` with NODE one of: {known}",
    )


def converter(output: str) -> Callable[[str], str]:
    """A log line as ``output`` wants it (see the module docstring)."""

    def as_text(line: str) -> str:
        if line.startswith("{"):
            doc = logfmt.parse_line(line)
            if doc is not None:
                return logfmt.render_text(doc)
        return line

    def as_json(line: str) -> str:
        doc = logfmt.parse_line(line)
        return json.dumps(doc if doc is not None else {"raw": line}, ensure_ascii=False)

    return as_json if output == "json" else as_text


# ---------------------------------------------------------------- local files


def last_lines(path: str, n: int, partial: bool = False) -> tuple[list[str], int]:
    """The last ``n`` complete lines of a file (``partial``: a last line without its newline counts
    too), and the offset after the last complete one."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        data, pos = b"", end
        while pos > 0 and data.count(b"\n") <= n:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            data = fh.read(step) + data
    complete = data[: data.rfind(b"\n") + 1] if b"\n" in data else b""
    lines = (data if partial else complete).decode("utf-8", "replace").splitlines()
    consumed = end - len(data) + len(complete)
    return (lines[-n:] if n else []), consumed


def print_file(src: LogSource, n: int, emit: Emit) -> None:
    if not os.path.exists(src.path):
        raise TangramError(
            f"no log for {src.name} yet: {src.path} does not exist",
            hint="`tangram logs -f` waits for it; `tangram up` writes it when it starts the process",
        )
    lines, _ = last_lines(src.path, n, partial=True)
    for line in lines:
        emit(line)


def follow_file(src: LogSource, n: int, emit: Emit, stop: Callable[[], bool] = lambda: False) -> None:
    """The last ``n`` lines, then every line appended, until ``stop()`` (or Ctrl-C). A file that is
    missing is waited for; one that is replaced or truncated is read again from its start."""
    while not os.path.exists(src.path):
        if stop():
            return
        time.sleep(POLL_S)
    lines, pos = last_lines(src.path, n)
    for line in lines:
        emit(line)
    fh = open(src.path, "rb")  # noqa: SIM115 - reopened when the file is replaced
    try:
        fh.seek(pos)
        buf = b""
        while not stop():
            chunk = fh.read(65536)
            if chunk:
                buf += chunk
                *done, buf = buf.split(b"\n")
                for raw in done:
                    emit(raw.decode("utf-8", "replace"))
                continue
            if _replaced(fh, src.path):
                fh.close()
                fh, buf = open(src.path, "rb"), b""  # noqa: SIM115
                continue
            time.sleep(POLL_S)
    finally:
        fh.close()


def _replaced(fh: Any, path: str) -> bool:
    try:
        now = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fh.fileno())
    return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev) or now.st_size < fh.tell()


# ---------------------------------------------------------------- over SSH


def remote(src: LogSource, n: int, follow: bool, emit: Emit) -> None:
    """``tail`` the node's agent.log over SSH (Tangram's known_hosts and the inventory's key)."""
    asyncio.run(_remote(src, n, follow, emit))


async def _remote(src: LogSource, n: int, follow: bool, emit: Emit) -> None:
    # start-up cost: asyncssh (and the inventory's models) load only to read a node's log over SSH
    from tangram_cli.bootstrap import ssh
    from tangram_cli.bootstrap.remote import known_hosts_path

    conn = await ssh.connect(src.host, known_hosts_path(), attempts=2)
    async with conn:
        if not follow:
            r = await ssh.run(conn, f"tail -n {int(n)} {src.path}")
            if not r.ok:
                why = (r.stderr.strip().splitlines() or [f"exit {r.exit_status}"])[-1]
                raise TangramError(f"{src.name}: cannot read {src.path}: {why}")
            for line in r.stdout.splitlines():
                emit(line)
            return
        async with conn.create_process(f"tail -n {int(n)} -F {src.path} 2>/dev/null") as proc:
            async for line in proc.stdout:
                emit(str(line).rstrip("\n"))


def show(src: LogSource, n: int, follow: bool, emit: Emit) -> None:
    if src.host is not None:
        remote(src, n, follow, emit)
    elif follow:
        follow_file(src, n, emit)
    else:
        print_file(src, n, emit)


__all__ = ["LogSource", "cluster_name", "pick", "show", "sources"]
