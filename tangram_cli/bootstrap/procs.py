"""Processes on the operator's machine: start the controller and local agents detached, wait
for the controller's ready file and for agents to register, stop processes by pid.

Shared by the local default (local.py), restart in place (restart.py) and `up` over SSH
(remote.py), which all run the controller here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tangram import logfmt
from tangram.errors import ControllerUnreachable, TangramError
from tangram_cli import state as st
from tangram_cli.bootstrap import netaddr
from tangram_cli.errors import BootstrapError
from tangram_cli.render import status as rs

if TYPE_CHECKING:
    from tangram_cli.controller.config import ControllerConfig

CONTROLLER_READY_TIMEOUT_S = 30.0
DOWN_STATES = ("down", "down*", "unreach", "boot", "lost", "gone")

# The controller CLI, runnable without a console script on PATH (and recognisable in /proc).
CONTROLLER_ARGV = [sys.executable, "-c", "from tangram_cli.main import cli; cli()", "controller"]
AGENT_ARGV = [sys.executable, "-m", "agent"]


def spawn_detached(
    argv: list[str], log_path: Path, *, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session, stdin from /dev/null, stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        return subprocess.Popen(
            argv,
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            close_fds=True,
        )


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def parse_ready(text: str) -> dict[str, int]:
    """The controller's ready line -> ``{"agents": P, "submit": P, "status": P}`` (key spellings vary)."""
    for line in reversed([ln for ln in text.splitlines() if ln.strip().startswith("{")]):
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict):
            continue
        flat = dict(raw)
        if isinstance(raw.get("ports"), dict):
            flat.update(raw["ports"])
        ports: dict[str, int] = {}
        for key, value in flat.items():
            for want in ("agents", "submit", "status"):
                if isinstance(value, int) and not isinstance(value, bool) and str(key).startswith(want):
                    ports[want] = value
                elif isinstance(value, str) and str(key).startswith(want) and ":" in value:
                    with contextlib.suppress(ValueError):
                        ports[want] = int(value.rsplit(":", 1)[1])
        if len(ports) == 3:
            return ports
    return {}


def start_controller(
    name: str,
    *,
    bind: str,
    ports: Mapping[str, int],
    config: ControllerConfig,
    timeout_s: float = CONTROLLER_READY_TIMEOUT_S,
    foreground_argv: bool = False,
    certs: str | None = None,
) -> tuple[subprocess.Popen[bytes] | None, list[str], dict[str, int]]:
    """Write ``controller.json`` and start ``tangram controller`` detached; wait for its ready file.

    Returns (process, argv, ports). With ``foreground_argv`` nothing is started: the argv is
    returned for the caller to exec.
    """
    d = st.ensure_dirs(name)
    cfg_path = st.controller_config_path(name)
    cfg_path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    ready = d / "controller.ready"
    with contextlib.suppress(FileNotFoundError):
        ready.unlink()
    argv = controller_argv(name, bind=bind, ports=ports, config_path=cfg_path, ready=ready, certs=certs)
    if foreground_argv:
        return None, argv, {}
    log = st.logs_dir(name) / "controller.log"
    offset = log.stat().st_size if log.exists() else 0  # the log is appended to across starts
    proc = spawn_detached(argv, log, cwd=d)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            got = parse_ready(ready.read_text(errors="replace"))
            if got:
                return proc, argv, got
        if proc.poll() is not None:
            raise controller_failed(proc.returncode, log, offset, bind)
        time.sleep(0.05)
    terminate(proc.pid, timeout_s=3)
    raise BootstrapError(
        f"the controller did not report ready within {timeout_s:g}s", hint=f"read {log}", detail=log_tail(log)
    )


def last_error(text: str) -> str:
    """The last error a process wrote: an ``error: ...`` line (the CLI's), a log record at ERROR or
    above (either log format), or a traceback's final ``SomeError: ...`` line; "" if none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("error: "):
            return line.removeprefix("error: ")
        doc = logfmt.parse_line(line)
        if doc is not None and str(doc.get("level")) in ("ERROR", "CRITICAL"):
            return str(doc.get("msg", ""))
        if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line):
            return line
    return ""


def controller_failed(code: int | None, log: Path, offset: int, bind: str) -> BootstrapError:
    """The error `up` shows when the controller exited during start: the reason from its log (only
    what this start wrote, from ``offset``) and a hint for the common ones."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        text = ""
    reason = last_error(text)
    if "Cannot assign requested address" in reason or "not an address of this machine" in reason:
        hint = (
            f"the controller's address {bind} is not an address of this machine: {netaddr.not_local_hint()}"
        )
    elif "Address already in use" in reason:
        hint = "another process holds that port: stop it, or set controller.ports in the inventory (0: free)"
    else:
        hint = "see the reason above"
    return BootstrapError(
        f"the controller exited with status {code} during start" + (f": {reason}" if reason else ""),
        hint=f"{hint}; the controller's log: {log}",
        detail="\n".join(text.strip().splitlines()[-8:]),
    )


def controller_argv(
    name: str, *, bind: str, ports: Mapping[str, int], config_path: Path, ready: Path, certs: str | None
) -> list[str]:
    """`tangram controller` for cluster ``name``: its journal (appended to) and durable state
    (``--state``) live in the cluster directory, so a restart finds them."""
    argv = [*CONTROLLER_ARGV, "--bind", bind]
    for role in ("agents", "submit", "status"):
        argv += [f"--{role}-port", str(ports.get(role, 0))]
    argv += [
        "--journal",
        str(st.journal_path(name)),
        "--state",
        str(st.controller_state_path(name)),
        "--config",
        str(config_path),
        "--ready-file",
        str(ready),
    ]
    return argv + (["--certs", str(certs)] if certs else [])


def terminate(
    pid: int | None,
    *,
    timeout_s: float = 10.0,
    words: tuple[str, ...] = (),
    first: signal.Signals = signal.SIGTERM,
) -> str:
    """``first`` (SIGTERM), wait; then SIGTERM again if ``first`` was another signal, wait a little;
    then SIGKILL. Returns "gone" (was not running), "stopped" or "killed"."""
    if not st.pid_alive(pid, words):
        return "gone"
    assert pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    if _wait_gone(pid, timeout_s):
        return "stopped"
    if first != signal.SIGTERM:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if _wait_gone(pid, 5.0):
            return "stopped"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, 5.0)
    return "killed"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        if not st.pid_alive(pid):
            return True
        time.sleep(0.05)
    return not st.pid_alive(pid)


# ---------------------------------------------------------------- waiting for agents


def wait_registered(
    status_address: str,
    names: Iterable[str],
    *,
    timeout_s: float,
    on_update: Callable[[dict[str, str]], None] | None = None,
    alive: Callable[[], str | None] | None = None,
    certs: str | None = None,
) -> dict[str, str]:
    """Poll the status socket until every node in ``names`` is registered and not down.

    Returns ``{node: state}``. Stops early when ``alive()`` returns a reason (a process died).
    On timeout the states seen last are returned (the caller reports the missing ones).
    """
    want = list(names)
    seen: dict[str, str] = dict.fromkeys(want, "waiting")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = st.query_status(status_address, sections=(), limit=0, timeout_s=2.0, certs=certs)
            rows = {rs.node_name(r): r for r in rs.rows(records, "nodes")}
            for n in want:
                if n in rows:
                    seen[n] = rs.node_state(rows[n]) or "registered"
        except ControllerUnreachable:
            pass
        except TangramError:
            pass
        if on_update:
            on_update(dict(seen))
        if all(is_up(seen[n]) for n in want):
            return seen
        if alive is not None and (why := alive()):
            for n in want:
                if not is_up(seen[n]):
                    seen[n] = why
            return seen
        if time.monotonic() >= deadline:
            return seen
        time.sleep(0.2)


def is_up(state: str) -> bool:
    return state not in ("waiting", "") and not state.startswith(DOWN_STATES) and " " not in state


def stop_local_agents(state: st.ClusterState, timeout_s: float = 10.0, grace_s: float = 5.0) -> list[str]:
    """Give local agents ``grace_s`` to finish their own shutdown (the controller sent them
    ``Shutdown``), then SIGTERM and SIGKILL those still running (by recorded pid or agent.pid)."""
    stopped = []
    for h in state.hosts:
        if h.connection != "local":
            continue
        pids = {h.pid}
        with contextlib.suppress(OSError, ValueError):
            pids.add(int((Path(h.workdir) / "agent.pid").read_text().strip()))
        for pid in pids:
            if pid is None or not st.pid_alive(pid, ("agent",)):
                continue
            if _wait_gone(pid, grace_s):
                continue
            if terminate(pid, timeout_s=timeout_s, words=("agent",)) != "gone":
                stopped.append(f"{h.name} (pid {pid})")
    return stopped


def local_agent_pid(h: st.HostState) -> int | None:
    """The pid of the local agent of ``h`` if it runs (the recorded pid, else its ``agent.pid``)."""
    if st.pid_alive(h.pid, ("agent",)):
        return h.pid
    with contextlib.suppress(OSError, ValueError):
        pid = int((Path(h.workdir) / "agent.pid").read_text().strip())
        if st.pid_alive(pid, ("agent",)):
            return pid
    return None


def start_local_agent(cluster: str, h: st.HostState) -> subprocess.Popen[bytes]:
    """Start the local agent of ``h`` again from the ``agent.json`` in its workdir (detached).

    A stale ``agent.pid`` goes first: the new agent refuses to start while that pid exists, and a
    killed agent stays a zombie until its parent (init here) reaps it."""
    log = st.logs_dir(cluster) / f"agent-{h.name}.log"
    cfg = Path(h.workdir) / "agent.json"
    if local_agent_pid(h) is None:
        with contextlib.suppress(OSError):
            (Path(h.workdir) / "agent.pid").unlink()
    return spawn_detached([*AGENT_ARGV, "--config", str(cfg)], log, cwd=Path(h.workdir))
