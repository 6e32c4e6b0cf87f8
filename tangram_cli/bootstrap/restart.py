"""Restart in place: a controller that died comes back on the bind address and ports recorded in
``state.json``, so the agents that survived (libzmq reconnects them by itself) and running clients
(they keep dialling the same address) find it again.

    recorded ports free?    no -> PortTaken (names the port and the process holding it)
    start `tangram controller` with the recorded bind and ports, ``--state`` and ``--journal``
    local agents: alive -> kept ("still running"); dead -> started again from agent.json
    wait until every local agent has registered with the new controller

`tangram up` (the local default and an inventory: the controller runs on this machine in both)
calls this when the recorded controller pid is gone or no longer runs this cluster's controller.
`tangram down` then `tangram up` starts afresh and may pick new ports. A supervisor such as
systemd gets the same effect by running `tangram controller` with fixed ports (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tangram.errors import ConfigError
from tangram_cli import state as st
from tangram_cli.bootstrap import procs
from tangram_cli.errors import BootstrapError

if TYPE_CHECKING:
    from tangram_cli.controller.config import ControllerConfig
    from tangram_cli.inventory import Inventory

PORT_ROLES = ("agents", "submit", "status")
PORT_SETTLE_S = 3.0


class PortTaken(BootstrapError):
    """A port the controller must reuse to restart in place is held by another process."""

    def __init__(self, cluster: str, role: str, bind: str, port: int, owner: str | None) -> None:
        self.cluster, self.role, self.bind, self.port, self.owner = cluster, role, bind, port, owner
        holder = owner or "another process"
        super().__init__(
            f"cannot restart the controller of cluster {cluster!r} on its recorded ports: "
            f"{role} port {port} on {bind} is taken by {holder}",
            hint=f"stop what holds port {port} and run `tangram up` again; or run `tangram down` then "
            "`tangram up` to start on new ports (running clients then need the new TANGRAM_ADDR)",
        )


@dataclass(frozen=True)
class AgentOutcome:
    """What `up` did about one local agent: ``how`` is "still running" or "restarted"."""

    name: str
    how: str
    pid: int | None

    def describe(self) -> str:
        return f"agent {self.name}: {self.how}" + (f" (pid {self.pid})" if self.how == "restarted" else "")


@dataclass(frozen=True)
class Restarted:
    """The controller was restarted in place."""

    controller_pid: int
    ports: dict[str, int]
    why: str  # e.g. "controller pid 123 is gone"
    agents: tuple[AgentOutcome, ...] = ()

    def summary(self) -> str:
        head = f"controller restarted on the same ports (pid {self.controller_pid})"
        return "; ".join([head, *(a.describe() for a in self.agents)])


# ---------------------------------------------------------------- ports


def ports_text(state: st.ClusterState) -> str:
    """``bind 127.0.0.1, agents P, submit P, status P``."""
    return ", ".join([f"bind {state.bind}", *(f"{r} {state.ports.get(r, 0)}" for r in PORT_ROLES)])


def missing_record(state: st.ClusterState) -> str | None:
    """Why ``state`` cannot be restarted in place (no recorded ports, no configuration), or None."""
    if any(not state.ports.get(r) for r in PORT_ROLES):
        return "no ports are recorded"
    if not st.controller_config_path(state.name).is_file():
        return f"{st.controller_config_path(state.name)} is missing"
    return None


def _probe(bind: str, port: int) -> OSError | None:
    """Bind ``bind:port`` as libzmq does (SO_REUSEADDR, so TIME_WAIT leftovers do not count)."""
    host = bind.strip("[]")
    host = "0.0.0.0" if host in ("*", "") else host
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None  # let the controller report it
    family, _type, _proto, _name, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(1)
        return None
    except OSError as exc:
        return exc
    finally:
        s.close()


def check_ports_free(state: st.ClusterState, *, settle_s: float = PORT_SETTLE_S) -> None:
    """Raise PortTaken for the first recorded port another process holds. A port held by no
    process we can see is probed again for up to ``settle_s`` (a controller killed a moment ago
    may still be closing its sockets)."""
    for role in PORT_ROLES:
        port = int(state.ports.get(role) or 0)
        exc = _probe(state.bind, port) if port else None
        deadline = time.monotonic() + settle_s
        while exc is not None and exc.errno == errno.EADDRINUSE and time.monotonic() < deadline:
            if port_owner(port) is not None:
                break
            time.sleep(0.1)
            exc = _probe(state.bind, port)
        if exc is None:
            continue
        if exc.errno == errno.EADDRINUSE:
            raise PortTaken(state.name, role, state.bind, port, port_owner(port))
        raise BootstrapError(
            f"cannot bind the recorded {role} address {state.bind}:{port}: {exc.strerror or exc}",
            hint="run `tangram down` then `tangram up` (the controller may then get new ports)",
        )


def _socket_inodes(port: int) -> list[str]:
    """Inodes of TCP sockets bound to local ``port`` (listening ones first), from /proc/net."""
    listening, other = [], []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) < 10 or int(cols[1].rsplit(":", 1)[1], 16) != port:
                    continue
                (listening if cols[3] == "0A" else other).append(cols[9])
    return [i for i in listening + other if i != "0"]


def port_owner(port: int) -> str | None:
    """``pid N (command line)`` of a process holding TCP ``port`` here, best effort (None if unknown)."""
    wanted = {f"socket:[{i}]" for i in _socket_inodes(port)}
    if not wanted:
        return None
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (pid_dir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        return f"pid {pid_dir.name} ({' '.join(cmd.split())[:100]})"
    return None


# ---------------------------------------------------------------- the controller


def restart_controller(
    state: st.ClusterState, config: ControllerConfig, *, timeout_s: float = procs.CONTROLLER_READY_TIMEOUT_S
) -> subprocess.Popen[bytes]:
    """Start the controller of ``state`` on its recorded bind address and ports; update ``state``
    (pid, start time; the caller writes it). Raises PortTaken when a port is held by another process."""
    check_ports_free(state)
    try:
        proc, _argv, got = procs.start_controller(
            state.name,
            bind=state.bind,
            ports=state.ports,
            config=config,
            certs=state.certs or None,
            timeout_s=timeout_s,
        )
    except BootstrapError as exc:
        if "Address already in use" in (exc.detail or ""):
            check_ports_free(state)  # taken between the check and the bind: name it
        raise
    assert proc is not None
    if {r: got.get(r) for r in PORT_ROLES} != {r: state.ports.get(r) for r in PORT_ROLES}:
        procs.terminate(proc.pid, timeout_s=5)
        raise BootstrapError(
            f"the controller bound ports {got}, not the recorded {state.ports}",
            hint="run `tangram down` then `tangram up`",
        )
    state.controller_pid = proc.pid
    state.started_at = time.time()
    return proc


def forget_controller_state(name: str) -> None:
    """A fresh start (no controller to restart in place): the previous controller's durable state
    describes sandboxes and actions that are gone, so it is moved aside (``state.jsonl.old``)
    rather than replayed."""
    path = st.controller_state_path(name)
    with contextlib.suppress(FileNotFoundError):
        path.replace(path.with_name(path.name + ".old"))


def recorded_config(state: st.ClusterState) -> ControllerConfig:
    """The controller configuration `up` recorded (``controller.json``)."""
    path = st.controller_config_path(state.name)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BootstrapError(
            f"cannot read {path}: {exc}", hint="run `tangram down` then `tangram up`"
        ) from None
    if not isinstance(raw, dict):
        raise BootstrapError(f"{path} is not a JSON object", hint="run `tangram down` then `tangram up`")
    # start-up cost: the controller's config module (with the protocol) loads only for a restart
    from tangram_cli.controller.config import parse_config

    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise BootstrapError(f"{path}: {exc.message}", hint="run `tangram down` then `tangram up`") from None


# ---------------------------------------------------------------- local agents


def ensure_local_agents(
    state: st.ClusterState,
    *,
    timeout_s: float,
    say: Callable[[str], None],
    wait_all: bool,
    controller: subprocess.Popen[bytes] | None = None,
) -> tuple[AgentOutcome, ...]:
    """Keep the local agents of ``state`` that run, start the dead ones again from their
    ``agent.json``, then wait until they registered: every local agent with ``wait_all`` (a new
    controller), else only those started now. Raises BootstrapError naming the agent that failed."""
    outcomes: list[AgentOutcome] = []
    started: dict[str, subprocess.Popen[bytes]] = {}
    for h in state.hosts:
        if h.connection != "local" or not h.workdir:
            continue
        pid = procs.local_agent_pid(h)
        if pid is not None:
            outcomes.append(AgentOutcome(h.name, "still running", pid))
            continue
        if not (Path(h.workdir) / "agent.json").is_file():
            continue
        say(f"agent {h.name} is not running; starting it again")
        proc = procs.start_local_agent(state.name, h)
        h.pid = proc.pid
        started[h.name] = proc
        outcomes.append(AgentOutcome(h.name, "restarted", proc.pid))
    if started:
        st.write(state)
    names = [o.name for o in outcomes] if wait_all else list(started)
    if names:
        wait_agents(state, names, started, controller, timeout_s)
    return tuple(outcomes)


def wait_agents(
    state: st.ClusterState,
    names: list[str],
    started: Mapping[str, subprocess.Popen[bytes]],
    controller: subprocess.Popen[bytes] | None,
    timeout_s: float,
) -> None:
    def died() -> str | None:
        for name, proc in started.items():
            if proc.poll() is not None:
                log = st.logs_dir(state.name) / f"agent-{name}.log"
                return f"agent {name} exited with status {proc.returncode}: {procs.log_tail(log, 1)}"
        if controller is not None and controller.poll() is not None:
            return f"controller exited with status {controller.returncode}"
        if controller is None and not state.controller_alive():
            return f"controller pid {state.controller_pid} exited"
        return None

    seen = procs.wait_registered(
        state.status_address, names, timeout_s=timeout_s, alive=died, certs=state.certs or None
    )
    for name in names:
        if procs.is_up(seen[name]):
            continue
        log = st.logs_dir(state.name) / f"agent-{name}.log"
        why = seen[name]
        if why == "waiting":
            verb = "was started again" if name in started else "still runs"
            why = f"agent {name} {verb} but did not register within {timeout_s:g}s"
        raise BootstrapError(
            f"local agent failed: {why}",
            hint=f"read {log} and {st.logs_dir(state.name) / 'controller.log'}; "
            "`tangram down` then `tangram up` starts afresh",
            detail=procs.log_tail(log, 20),
        )


def restart_local(
    state: st.ClusterState, *, why: str, timeout_s: float, say: Callable[[str], None]
) -> Restarted:
    """Restart in place the controller of a local-default cluster, then settle its agent."""
    say(f"{why}: restarting the controller on its recorded address ({ports_text(state)})")
    proc = restart_controller(state, recorded_config(state))
    st.write(state)
    agents = ensure_local_agents(state, timeout_s=timeout_s, say=say, wait_all=True, controller=proc)
    return Restarted(proc.pid, dict(state.ports), why, agents)


# ---------------------------------------------------------------- an inventory's controller


def inventory_controller(
    inv: Inventory,
    state: st.ClusterState | None,
    *,
    config: ControllerConfig,
    certs: str,
    inventory: str,
    bundle: str,
    say: Callable[[str], None],
) -> tuple[st.ClusterState, Restarted | None]:
    """The controller of an inventory cluster, on this machine: kept when it runs, restarted in
    place when it died (agents are then settled by the bootstrap: running ones are kept), else
    started afresh on the inventory's ports, with a new cluster id (a restarted one keeps its own, as its
    agents and containers carry it). Returns (state, what was restarted or None)."""
    if state is not None and state.controller_is_ours():
        say(f"cluster {inv.cluster}: controller already running (pid {state.controller_pid})")
        return state, None
    if state is not None and missing_record(state) is None:
        ctl = inv.controller
        wanted = {"agents": ctl.ports.agents, "submit": ctl.ports.submit, "status": ctl.ports.status}
        if ctl.bind != state.bind or any(p and p != state.ports.get(r) for r, p in wanted.items()):
            say(
                f"the inventory asks for bind {ctl.bind}, ports {wanted}; keeping the recorded "
                f"{ports_text(state)} so running agents and clients reconnect "
                "(`tangram down` then `tangram up` applies the inventory's)"
            )
        pid = state.controller_pid
        why = f"controller pid {pid} " + ("now runs another program" if st.pid_alive(pid) else "is gone")
        proc = restart_controller(state, replace(config, cluster_id=state.cluster_id))
        st.write(state)
        r = Restarted(proc.pid, dict(state.ports), why)
        say(f"{why}: {r.summary()}: agents {state.agents_address}, clients {state.address}")
        return state, r
    if state is not None:
        st.remove(inv.cluster)
    forget_controller_state(inv.cluster)
    ctl = inv.controller
    ports = {"agents": ctl.ports.agents, "submit": ctl.ports.submit, "status": ctl.ports.status}
    cluster_id = st.new_cluster_id()
    proc, _argv, got = procs.start_controller(
        inv.cluster, bind=ctl.bind, ports=ports, config=replace(config, cluster_id=cluster_id), certs=certs
    )
    assert proc is not None
    state = st.ClusterState(
        name=inv.cluster,
        controller_pid=proc.pid,
        bind=ctl.bind,
        advertise=ctl.advertise,
        ports=got,
        started_at=time.time(),
        inventory=inventory,
        bundle=bundle,
        certs=certs,
        cluster_id=cluster_id,
    )
    say(f"controller pid {proc.pid}: agents {state.agents_address}, clients {state.address}")
    return state, None
