"""Processes around the live benchmarks (`tangram bench dispatch | burst | scale`).

- `ControllerProc`: `tangram controller` in its own process on 127.0.0.1 port 0, found through
  `--ready-file`; its CPU seconds and memory come from /proc.
- `start_real_agent`: `python -m agent` (the shipped agent, any executor); `wait_nodes` waits
  until the controller's status lists the nodes as up.
- `StatusSampler`: a thread asking the status socket every `interval` s, recording how long
  each answer took, the driver's `loop_lag_s` and `decide`, and the controller's resident memory.
- `run_clients`: the ready/go/report handshake with client processes (each prints `ready`,
  reads `go` on stdin, then prints one JSON report line).
- `Procs`: every child of one run, stopped together however the run ends.
- `proc_cpu_s`, `children_cpu_s` with `cpu_delta`, `machine_cpu_s`: CPU seconds of a process, of
  a process's children by pid, and of the whole machine (busy and total), from /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import click

from tangram_cli.state import query_status


def logs_and_json(fn: Any) -> Any:
    """The `--logs DIR` and `--json` options that `bench burst` and `bench scale` share."""
    fn = click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")(fn)
    return click.option(
        "--logs",
        type=click.Path(file_okay=False),
        default=None,
        help="Keep every process's log and the status timeline (status.jsonl) in this directory.",
    )(fn)


CONTROLLER_ARGV = [sys.executable, "-c", "from tangram_cli.main import cli; cli()", "controller"]


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 on), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (from /proc), None when it is gone."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ChildCpu = dict[int, tuple[float, float]]


def children_cpu_s(pid: int) -> ChildCpu:
    """CPU seconds of each live child of ``pid`` (e.g. an agent's spawners), by pid: (its own, that of
    its children it reaped, e.g. the actions it spawned). Compare two readings by pid (``cpu_delta``):
    a child that exits in between takes its seconds with it."""
    out: ChildCpu = {}
    hz = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None and int(fields[1]) == pid:
            own, reaped = int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])
            out[int(entry)] = (own / hz, reaped / hz)
    return out


def cpu_delta(before: ChildCpu, after: ChildCpu) -> tuple[float, float]:
    """What the children alive at ``after`` used since ``before`` (one born in between: all of it)."""
    own = sum(v[0] - before.get(p, (0.0, 0.0))[0] for p, v in after.items())
    reaped = sum(v[1] - before.get(p, (0.0, 0.0))[1] for p, v in after.items())
    return own, reaped


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat's first line (busy: all
    but idle and iowait), so a window's busy share says whether a run was bound by CPU or by waiting."""
    with open("/proc/stat", encoding="ascii") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def proc_mem_mib(pid: int) -> dict[str, float]:
    """`rss_mib` (VmRSS) and `hwm_mib` (VmHWM, the peak) of a live process; {} when it is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_mib" if key == "VmRSS" else "hwm_mib"] = int(rest.split()[0]) / 1024
    except OSError:
        return {}
    return out


def bench_workdir(keep: str | None, prefix: str) -> str:
    """`keep` (created; its logs stay) or a fresh temporary directory (removed after the run)."""
    if keep:
        os.makedirs(keep, exist_ok=True)
        return os.path.abspath(keep)

    return tempfile.mkdtemp(prefix=prefix)


def stop_proc(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:]).strip()
    except OSError:
        return ""


class ControllerProc:
    """`tangram controller` as a child process; `start()` returns once its sockets are bound."""

    def __init__(
        self,
        workdir: str,
        config: dict[str, Any] | None = None,
        args: tuple[str, ...] = (),
        log_level: str = "WARNING",
    ) -> None:
        self.workdir = workdir
        self.log_level = log_level
        self.config = config or {}
        self.args = args
        self.log_path = os.path.join(workdir, "controller.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout_s: float = 30.0) -> ControllerProc:
        ready = os.path.join(self.workdir, "controller.ready")
        cfg = os.path.join(self.workdir, "controller.json")
        with open(cfg, "w", encoding="utf-8") as fh:
            json.dump({"cluster": "bench", **self.config}, fh)
        argv = [*CONTROLLER_ARGV, "--bind", "127.0.0.1", "--agents-port", "0", "--submit-port", "0"]
        argv += ["--status-port", "0", "--ready-file", ready, "--config", cfg, *self.args]
        env = {**os.environ, "TANGRAM_LOG": self.log_level}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the controller did not start: {_tail(self.log_path) or 'no log'}")
            time.sleep(0.02)
        with open(ready, encoding="utf-8") as fh:
            self.info = json.load(fh)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def submit_addr(self) -> str:
        return str(self.info["submit_addr"])

    @property
    def agents_addr(self) -> str:
        return str(self.info["agents_addr"])

    @property
    def status_addr(self) -> str:
        return str(self.info["status_addr"])

    def cpu_s(self) -> float | None:
        return proc_cpu_s(self.pid) if self.proc is not None else None

    def mem(self) -> dict[str, float]:
        return proc_mem_mib(self.pid) if self.proc is not None else {}

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)

    def log_lines(self, limit: int = 8) -> dict[str, Any]:
        """WARNING/ERROR lines of the controller's log: counts and the first distinct ones."""
        counts = {"WARNING": 0, "ERROR": 0}
        first: list[str] = []
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    for level in counts:
                        if f" {level} " in line:
                            counts[level] += 1
                            text = line.split(f" {level} ", 1)[1].strip()[:200]
                            if len(first) < limit and text not in first:
                                first.append(text)
        except OSError:
            pass
        return {"warnings": counts["WARNING"], "errors": counts["ERROR"], "first": first}


def start_real_agent(
    agents_addr: str,
    name: str,
    executor: str,
    cpus: str,
    workdir: str,
    image: str | None = None,
    env: dict[str, str] | None = None,
    config: str | None = None,
) -> subprocess.Popen[bytes]:
    """`python -m agent` with these flags; ``config``: an agent.json too (e.g. its "curve" keys)."""
    argv = [
        sys.executable,
        "-m",
        "agent",
        "--controller",
        agents_addr,
        "--name",
        name,
        "--executor",
        executor,
        "--cpus",
        cpus,
        "--workdir",
        workdir,
        "--cluster",
        "bench",
        "--log-level",
        "WARNING",
    ]
    if image:
        argv += ["--image", image]
    if config:
        argv += ["--config", config]
    with open(os.path.join(workdir, f"agent-{name}.log"), "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, **(env or {})})


def wait_nodes(
    status_addr: str,
    names: list[str],
    procs: list[subprocess.Popen[Any]],
    timeout_s: float,
    certs: str | None = None,
) -> None:
    """Return once every node in `names` is up in the controller's status; RuntimeError otherwise."""
    deadline = time.monotonic() + timeout_s
    want = set(names)
    while True:
        with contextlib.suppress(Exception):
            rows = query_status(status_addr, sections=("nodes",), timeout_s=5, certs=certs).get("nodes", [])
            if want <= {r["node"] for r in rows if r.get("agent_state") == "up"}:
                return
        dead = [pr.args for pr in procs if pr.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = (
                "an agent process exited"
                if dead
                else f"not all {len(want)} agents registered in {timeout_s:g}s"
            )
            raise RuntimeError(why)
        time.sleep(0.1)


class StatusSampler(threading.Thread):
    """Asks the status socket every `interval` s (a thread, so a busy bench loop does not delay it)."""

    def __init__(
        self,
        status_addr: str,
        pid: int | None,
        interval: float = 0.5,
        sections: tuple[str, ...] = ("cluster",),
        timeline: str | None = None,
    ) -> None:
        super().__init__(daemon=True, name="status-sampler")
        self.addr, self.pid, self.interval, self.sections = status_addr, pid, interval, sections
        self.answers: list[float] = []
        self.failed = 0
        self.loop_lag_max = 0.0
        self.rss_peak = 0.0
        self.decide: dict[
            str, float
        ] = {}  # the highest `decide` p99/max the status reported (a sliding window)
        self.last: dict[str, Any] = {}
        self.first: dict[str, Any] = {}
        self._halt = threading.Event()
        self.timeline = timeline  # a JSONL file: one line per sample (time, answer, cluster record)

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.monotonic()
            cluster: dict[str, Any] | None = None
            try:
                rec = query_status(self.addr, sections=self.sections, timeout_s=5.0)
                self.answers.append(time.monotonic() - t0)
                cluster = rec.get("cluster") or {}
                self.first = self.first or cluster
                self.last = cluster
                self.loop_lag_max = max(self.loop_lag_max, float(cluster.get("loop_lag_s") or 0.0))
                decide = cluster.get("decide") or {}
                for key in ("p99_ms", "max_ms"):
                    if isinstance(decide.get(key), (int, float)):
                        self.decide[key] = max(self.decide.get(key, 0.0), float(decide[key]))
            except Exception:  # noqa: BLE001 - an unanswered query is the figure
                self.failed += 1
            rss = proc_mem_mib(self.pid).get("rss_mib", 0.0) if self.pid is not None else 0.0
            self.rss_peak = max(self.rss_peak, rss)
            if self.timeline:
                line = {
                    "t": round(time.time(), 3),
                    "answer_s": round(time.monotonic() - t0, 4),
                    "rss_mib": rss,
                    "answered": cluster is not None,
                    "cluster": {k: v for k, v in (cluster or {}).items() if k != "addresses"},
                }
                with open(self.timeline, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(line) + "\n")
            self._halt.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def stop(self) -> dict[str, Any]:
        self._halt.set()
        self.join(10)
        return {
            "samples": len(self.answers),
            "unanswered": self.failed,
            "answer_p50_s": pct(self.answers, 0.5),
            "answer_p99_s": pct(self.answers, 0.99),
            "answer_max_s": max(self.answers) if self.answers else None,
            "loop_lag_max_s": self.loop_lag_max,
            "rss_sampled_peak_mib": round(self.rss_peak, 1),
            "decide_p99_max_ms": self.decide.get("p99_ms"),
            "decide_max_ms": self.decide.get("max_ms"),
        }


def run_clients(procs: list[subprocess.Popen[str]], deadline: float) -> list[dict[str, Any]]:
    """Wait for every client's `ready`, say go to all, collect their JSON reports (or errors)."""
    for proc in procs:
        line = _readline(proc, deadline)
        if line.strip() != "ready":
            raise RuntimeError(f"a client did not get ready (said {line.strip()[:200]!r})")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = []
    for k, proc in enumerate(procs):
        try:
            text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError("the run passed its --timeout") from None
        line = text.strip().rsplit("\n", 1)[-1]
        try:
            reports.append(json.loads(line))
        except ValueError:
            reports.append(
                {"name": f"client-{k}", "error": f"no report (exit {proc.returncode}): {line[:200]!r}"}
            )
    return reports


def _readline(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the run passed its --timeout")
            if sel.select(min(left, 1.0)) or proc.poll() is not None:
                return proc.stdout.readline()
    finally:
        sel.close()


def controller_figures(ctl: ControllerProc, sampler: dict[str, Any], cpu0: float) -> dict[str, Any]:
    """Status, counters and /proc figures of the controller at the end of a run."""
    records = query_status(ctl.status_addr, sections=("cluster", "nodes"), timeout_s=10)
    cluster = records.get("cluster") or {}
    nodes = records.get("nodes") or []
    mem = ctl.mem()
    return {
        "counters": cluster.get("counters") or {},
        "events": cluster.get("events"),
        "agents_up": cluster.get("agents_up"),
        "agents_total": cluster.get("agents_total"),
        "agent_restarts": sum(int(n.get("restarts") or 0) for n in nodes),
        "agents_not_up": [n["node"] for n in nodes if n.get("agent_state") != "up"],
        "status": sampler,
        "cpu_s": round((ctl.cpu_s() or 0.0) - cpu0, 2),
        "rss_peak_mib": round(max(mem.get("hwm_mib", 0.0), sampler.get("rss_sampled_peak_mib") or 0.0), 1),
        "log": ctl.log_lines(),
        **{k: v for k, v in cluster.items() if "decision" in k or "decide" in k},
    }


@dataclass
class Procs:
    """Every child process of one benchmark run; `close()` stops them all (clients first, the
    controller last) and removes the work directory unless `keep`."""

    workdir: str
    keep: bool = False
    ctl: ControllerProc | None = None
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    bench: list[tuple[subprocess.Popen[bytes], str]] = field(default_factory=list)
    clients: list[subprocess.Popen[str]] = field(default_factory=list)
    sampler: StatusSampler | None = None

    def start_sampler(self) -> StatusSampler:
        assert self.ctl is not None
        timeline = os.path.join(self.workdir, "status.jsonl") if self.keep else None
        self.sampler = StatusSampler(self.ctl.status_addr, self.ctl.pid, timeline=timeline)
        self.sampler.start()
        return self.sampler

    def close(self) -> dict[str, Any]:
        """Stop everything; the bench agents' summed stats ({} without bench agents)."""
        # an import cycle: tangram_cli.bench.agents imports this module
        from tangram_cli.bench.agents import stop_bench_agents

        if self.sampler is not None and self.sampler.is_alive():
            self.sampler.stop()
        for proc in self.clients:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(5)
        stats = stop_bench_agents(self.bench) if self.bench else {}
        for agent in self.agents:
            stop_proc(agent)
        if self.ctl is not None:
            self.ctl.stop()
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return stats
