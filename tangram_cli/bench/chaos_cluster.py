"""The local cluster of `tangram bench chaos` and what the bench observes of it.

- `ChaosCluster`: the controller (`tangram controller` on three fixed 127.0.0.1 ports, with
  `--journal` and, when the controller has the option, `--state`, so that a restart reuses
  them), one agent (`python -m agent --config agent.json`, same node name and work directory
  after a restart), and the load clients (`python -m tangram_cli.bench.chaos_load`); kill -9
  and restart for each; status queries that never raise.
- `markers`: the processes of this run's actions (their environment holds
  `TANGRAM_CHAOS=RUN/CLIENT/TOKEN`), read from /proc: containers' processes included.
- `Leftovers`: marker processes still alive more than `slack` seconds after their action
  ended (per the clients' done files) or after a dead client's grace; which of them burn CPU
  and on which cores.
- `tangram_containers`: the Docker containers labelled with this run's cluster.
- `drain`, `quiesce`, `quit_clients`, `end_checks`: the end of a fault kind (the clients'
  reports, then what is still held or running) and of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tangram_cli.bench.chaos_load import MARKER
from tangram_cli.bench.procs import ControllerProc, Procs, _readline, stop_proc
from tangram_cli.state import query_status

NODE = "chaos"


def free_ports(n: int) -> list[int]:
    """n ports that were free on 127.0.0.1 a moment ago (the controller binds them next)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def controller_has_state_option() -> bool:
    """True when `tangram controller` takes `--state FILE` (durable controller state)."""
    from tangram_cli.commands.controller import command  # start-up cost: the controller's modules

    return any(p.name == "state" for p in command.params)


def wait_until(pred: Callable[[], Any], timeout_s: float, step: float = 0.1) -> float | None:
    """Seconds until `pred()` was true, or None after `timeout_s`."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if pred():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(step)


@dataclass
class LoadClient:
    name: str
    proc: subprocess.Popen[str]
    done: str  # its done file: `TOKEN TIME OUTCOME` per finished action
    started: bool = False  # it said `ready`


@dataclass
class Marker:
    pid: int
    client: str
    tok: str
    cpu_s: float
    core: int


def markers(run: str) -> list[Marker]:
    """Live processes whose environment carries this run's marker."""
    want = f"{MARKER}={run}/".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
            with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if want not in env or fields[0] == "Z":
            continue
        value = env.split(want, 1)[1].split(b"\0", 1)[0].decode("utf-8", "replace")
        client, _, tok = value.partition("/")
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out.append(Marker(int(entry), client, tok, cpu, int(fields[36])))
    return out


def tangram_containers(cluster: str) -> list[str]:
    """Names of the containers labelled with `cluster` ([] without a Docker daemon)."""
    try:
        import docker  # start-up cost: docker-py ~0.3 s

        from agent.executors.docker import LABEL_CLUSTER

        client = docker.from_env(timeout=10)
    except Exception:  # noqa: BLE001 - no Docker: no containers
        return []
    try:
        found = client.containers.list(all=True, filters={"label": [f"{LABEL_CLUSTER}={cluster}"]})
        return sorted(c.name for c in found)
    finally:
        client.close()


def remove_containers(cluster: str) -> int:
    try:
        import docker  # start-up cost: docker-py ~0.3 s

        from agent.executors.docker import LABEL_CLUSTER

        client = docker.from_env(timeout=30)
    except Exception:  # noqa: BLE001
        return 0
    removed = 0
    try:
        for c in client.containers.list(all=True, filters={"label": [f"{LABEL_CLUSTER}={cluster}"]}):
            with contextlib.suppress(Exception):
                c.remove(force=True, v=True)
                removed += 1
    finally:
        client.close()
    return removed


@dataclass
class Leftovers:
    """Marker processes that outlived their action (or their dead client's grace)."""

    run: str
    slack: float = 1.0
    found: dict[str, Marker] = field(default_factory=dict)  # "client/tok" -> the process seen
    burning: set[tuple[str, int]] = field(default_factory=set)  # (client/tok, core) seen burning
    _cpu: dict[int, tuple[float, float]] = field(default_factory=dict)  # pid -> (time, cpu_s)

    def scan(self, ended: dict[str, float], victims: dict[str, float], everything: bool = False) -> int:
        """One look at /proc; `ended`: "CLIENT/TOKEN" -> when its action ended; `victims`: dead client ->
        when its grace is over; `everything`: no action is running, so every marker is left over."""
        now = time.time()
        for m in markers(self.run):
            key = f"{m.client}/{m.tok}"
            last = self._cpu.get(m.pid)
            self._cpu[m.pid] = (time.monotonic(), m.cpu_s)
            done = ended.get(key)
            dead = victims.get(m.client)
            if not (everything or (done and now - done > self.slack) or (dead and now > dead)):
                continue
            self.found.setdefault(key, m)
            if last and (m.cpu_s - last[1]) > 0.5 * (time.monotonic() - last[0]):
                self.burning.add((key, m.core))
        return len(self.found)

    def take(self) -> dict[str, Any]:
        out = {
            "processes": len(self.found),
            "burning": len({k for k, _ in self.burning}),
            "cores_burned": len(self.burning),
            "examples": [f"pid {m.pid} {m.client}/{m.tok}" for m in list(self.found.values())[:5]],
        }
        self.found, self.burning = {}, set()
        return out


class ChaosCluster:
    """The processes of one chaos run; every start, kill -9 and restart goes through here."""

    def __init__(self, procs: Procs, run: str, executor: str, opts: dict[str, Any]) -> None:
        self.procs, self.run, self.executor, self.opts = procs, run, executor, opts
        self.cluster = f"chaos-{run}"
        self.clients: list[LoadClient] = []
        self.ports = free_ports(3)
        self.state = controller_has_state_option()
        self.agent: subprocess.Popen[bytes] | None = None
        self.leftovers = Leftovers(run)

    # ------------------------------------------------------------ controller
    def start_controller(self) -> ControllerProc:
        wd = self.procs.workdir
        grace = self.opts["client_grace_s"]
        config = {
            "cluster": self.cluster,
            "scheduler": {"client_grace_s": grace},
            "services": [
                {
                    "name": "reward",
                    "runtime": "emulated",
                    "model": "agent.gpu.demo_services:reward",
                    "gpu_mem_mib": 1024,
                    "host_mem_mib": 64,
                    "chunk_sizes": [1],
                    "load_s": 0.05,
                }
            ],
            "apis": [{"name": "search", "mode": "concurrency", "limit": 2}],
        }
        if self.opts.get("stage_starts") is not None:  # --staging/--no-staging; else the default
            config["scheduler"]["stage_starts"] = bool(self.opts["stage_starts"])
        a, s, st = (str(p) for p in self.ports)
        args = ["--agents-port", a, "--submit-port", s, "--status-port", st]
        args += ["--journal", os.path.join(wd, "controller.journal")]
        if self.state:
            args += ["--state", os.path.join(wd, "controller.state")]
        level = "INFO" if self.procs.keep else "WARNING"
        self.procs.ctl = ControllerProc(wd, config=config, args=tuple(args), log_level=level)
        return self.procs.ctl.start()

    def kill_controller(self) -> float:
        ctl = self.procs.ctl
        assert ctl is not None
        assert ctl.proc is not None
        t = time.time()
        stop_proc(ctl.proc, signal.SIGKILL)
        return t

    def restart_controller(self) -> None:
        """The same ports, journal and state file; returns once its sockets are bound."""
        ctl = self.procs.ctl
        assert ctl is not None
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.procs.workdir, "controller.ready"))
        ctl.start()

    # ------------------------------------------------------------ agent
    def start_agent(self) -> subprocess.Popen[bytes]:
        ctl = self.procs.ctl
        assert ctl is not None
        wd = self.procs.workdir
        path = os.path.join(wd, "agent.json")
        ncpu = len(os.sched_getaffinity(0))
        conf = {
            "controller": ctl.agents_addr,
            "name": NODE,
            "cluster": self.cluster,
            "executor": self.executor,
            "cpus": f"0-{ncpu - 1}" if ncpu > 1 else "0",
            "workdir": os.path.join(wd, "agent"),
            "emulated_gpus": 2,
            "gpu_mem_mib": 4096,
            "mem_mib": 8192,
            "log_level": "INFO" if self.procs.keep else "WARNING",
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(conf, fh)
        os.makedirs(conf["workdir"], exist_ok=True)
        with open(os.path.join(wd, "agent.log"), "ab") as log:
            argv = [sys.executable, "-m", "agent", "--config", path]
            self.agent = subprocess.Popen(argv, stdout=log, stderr=log)
        self.procs.agents.append(self.agent)
        return self.agent

    def kill_agent(self) -> float:
        assert self.agent is not None
        t = time.time()
        stop_proc(self.agent, signal.SIGKILL)
        return t

    def node(self) -> dict[str, Any] | None:
        rows = self.status(("nodes",)).get("nodes") or []
        return next((r for r in rows if r.get("node") == NODE), None)

    def agent_up(self) -> bool:
        """The current agent process is registered and up."""
        row = self.node()
        return bool(
            row and row.get("agent_state") == "up" and self.agent and row.get("pid") == self.agent.pid
        )

    # ------------------------------------------------------------ status
    def status(self, sections: tuple[str, ...], timeout_s: float = 1.5) -> dict[str, Any]:
        """The status records, {} when the controller does not answer."""
        ctl = self.procs.ctl
        if ctl is None or not ctl.info:
            return {}
        try:
            return query_status(ctl.status_addr, sections=sections, limit=500, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - no answer is an answer here
            return {}

    # ------------------------------------------------------------ load clients
    def spawn_client(self, name: str) -> LoadClient:
        ctl = self.procs.ctl
        assert ctl is not None
        wd = self.procs.workdir
        done = os.path.join(wd, f"done-{name}.tsv")
        argv = [sys.executable, "-m", "tangram_cli.bench.chaos_load", "--addr", ctl.submit_addr]
        argv += ["--name", name, "--run", self.run, "--lanes", str(self.opts["lanes"])]
        argv += ["--timeout", str(self.opts["action_timeout_s"]), "--done", done]
        with open(os.path.join(wd, f"client-{name}.log"), "ab") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self.procs.clients.append(proc)
        client = LoadClient(name, proc, done)
        self.clients.append(client)
        return client

    def tell(self, client: LoadClient, line: str) -> bool:
        assert client.proc.stdin is not None
        try:
            client.proc.stdin.write(line + "\n")
            client.proc.stdin.flush()
        except OSError:
            return False
        return True

    def answer(self, client: LoadClient, timeout_s: float) -> str:
        """The client's next stdout line ('' when it died or said nothing within timeout_s)."""
        try:
            return _readline(client.proc, time.monotonic() + timeout_s).strip()
        except TimeoutError:
            return ""

    def kill_client(self, client: LoadClient) -> float:
        t = time.time()
        stop_proc(client.proc, signal.SIGKILL)
        self.clients.remove(client)
        _close_pipes(client.proc)
        return t

    def ended(self) -> dict[str, tuple[float, str]]:
        """ "CLIENT/TOKEN" -> (when its action ended, outcome), from every client's done file."""
        out: dict[str, tuple[float, str]] = {}
        for path in sorted(os.listdir(self.procs.workdir)):
            if path.startswith("done-") and path.endswith(".tsv"):
                client = path[len("done-") : -len(".tsv")]
                with open(os.path.join(self.procs.workdir, path), encoding="utf-8") as fh:
                    for line in fh:
                        parts = line.split("\t")
                        if len(parts) == 3:
                            out[f"{client}/{parts[0]}"] = (float(parts[1]), parts[2].strip())
        return out

    def scan(self, victims: dict[str, float], everything: bool = False) -> int:
        ended = {tok: t for tok, (t, _) in self.ended().items()}
        return self.leftovers.scan(ended, victims, everything)

    # ------------------------------------------------------------ the end
    def cleanup(self) -> dict[str, int]:
        """SIGKILL every marker process and remove this run's containers (after the figures)."""
        killed = 0
        for m in markers(self.run):
            with contextlib.suppress(OSError):
                os.kill(m.pid, signal.SIGKILL)
                killed += 1
        return {"killed_processes": killed, "removed_containers": remove_containers(self.cluster)}

    def close_pipes(self) -> None:
        """Close the pipes of every load client (after `Procs.close()` has stopped them)."""
        for proc in self.procs.clients:
            _close_pipes(proc)


_GATEWAY_COUNTERS = ("joined", "replayed", "resends_already_answered")


def _close_pipes(proc: subprocess.Popen[str]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


# ------------------------------------------------------------------ drain, quiesce, the end


def drain(c: ChaosCluster) -> list[dict[str, Any]]:
    wait = c.opts["lost_after_s"]
    late = c.opts["action_timeout_s"] + 10.0  # by its timeout the controller owes each a final reply
    told = [cl for cl in c.clients if c.tell(cl, f"drain {wait} {late}")]
    reports = []
    for cl in told:
        line = c.answer(cl, wait + late + 60)
        try:
            reports.append(json.loads(line))
        except ValueError:
            reports.append({"name": cl.name, "error": f"no report (said {line[:200]!r})"})
    return reports


def quiesce(c: ChaosCluster, victims: dict[str, float]) -> dict[str, Any]:
    """After the drain: every dead client's grace over, then what the controller still holds and
    what still runs (every action has an outcome now, so every marker process is left over)."""
    while time.time() < max(victims.values(), default=0.0):
        c.scan(victims)
        time.sleep(0.25)
    seen: dict[str, Any] = {}

    def idle() -> bool:
        st = seen["st"] = c.status(("cluster", "nodes", "apis"))
        cl, nodes = st.get("cluster") or {}, st.get("nodes") or []
        return bool(cl) and cl.get("running") == 0 and sum(n.get("cpus_used", 0) for n in nodes) == 0

    settled = wait_until(idle, 8, step=0.25)
    cl, nodes = seen["st"].get("cluster") or {}, seen["st"].get("nodes") or []
    wait_until(lambda: not markers(c.run), 3, step=0.2)
    c.scan(victims, everything=True)
    if c.executor == "docker":
        wait_until(lambda: not tangram_containers(c.cluster), 5, step=0.5)
    return {
        "settled": settled is not None,
        "answered": bool(cl),
        "running": cl.get("running"),
        "queue": cl.get("queue"),
        "sandboxes_left": cl.get("sandboxes"),
        "cores_used": sum(n.get("cpus_used", 0) for n in nodes),
        "gpus_busy": sum(n.get("gpus_busy", 0) for n in nodes),
        "api_in_flight": sum(a.get("in_flight", 0) for a in seen["st"].get("apis") or []),
        "gateway": {k: v for k, v in (cl.get("counters") or {}).items() if k in _GATEWAY_COUNTERS},
        "containers": tangram_containers(c.cluster) if c.executor == "docker" else [],
    }


def quit_clients(c: ChaosCluster) -> dict[str, int]:
    """Close the clients; the final replies that came after their phase's report, per phase."""
    told = [cl for cl in c.clients if c.tell(cl, "quit")]
    late: Counter[str] = Counter()
    for cl in told:
        with contextlib.suppress(ValueError):
            late.update(json.loads(c.answer(cl, 20)).get("late_duplicate_finals") or {})
    return dict(late)


def end_checks(c: ChaosCluster) -> dict[str, Any]:
    """After the run, with every client closed: what is still there."""
    if c.executor == "docker":
        wait_until(lambda: not tangram_containers(c.cluster), 10, step=0.5)
    cluster = c.status(("cluster",)).get("cluster") or {}
    return {
        "containers": tangram_containers(c.cluster),
        "processes": len(markers(c.run)),
        "sandboxes": cluster.get("sandboxes"),
        "clients": cluster.get("clients"),
    }
