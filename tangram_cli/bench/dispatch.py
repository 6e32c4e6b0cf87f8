"""`tangram bench dispatch`: per-action overhead and control-plane throughput on this machine.

One real agent (`python -m agent`, a subprocess) per executor: `process`, and `docker` when
dockerd answers. Layouts (`--layout`, printed in the output):

- `separate` (default): the controller runs in its own process (`tangram controller`), the
  clients in this one, as rollout code would.
- `inprocess`: the controller and the clients share this process's asyncio loop (the
  controller then pays for the clients' CPU).

Security (`--curve`, printed as `security`): plain TCP on 127.0.0.1 by default; with `--curve`
every socket is CURVE (keys made in the run's temporary directory), as on `tangram up`'s local
default, so the two runs show what encryption and authentication cost per action.

Measured, in one run per executor:

- Overhead: `-n` no-op actions (`true`, 1 core) one after another from one client; per
  action, overhead = client-measured submit -> result time minus the agent-measured run time
  (setup included: cpuset change, process start). Reported as p50/p99 with the end-to-end
  latency next to it.
- Throughput: `--clients` clients, each with its own sandbox, submit `-n` no-op actions in
  total as fast as replies come back; actions per second over the whole run.
- Raw spawn baseline, before any daemon starts: an asyncio loop spawning `taskset -c N true`
  (`asyncio.create_subprocess_exec`, cores round-robin) at the throughput run's concurrency,
  and a plain `os.posix_spawn` loop (vfork + exec, reaped through pidfds) at the same
  concurrency. The asyncio loop runs again once the daemons are gone; `ratio_to_raw_spawn` is
  the throughput over the mean of its two runs.
- With `--floor`, the layout's floor (`tangram bench floor`): the same processes and hops with trivial
  logic in each, run after the process executor's throughput run; `ratio_to_floor` is the throughput
  over the floor's.

Figures only; the goals (issue 9) are printed next to them with PASS/FAIL, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

import tangram
from tangram_cli import keys as cluster_keys
from tangram_cli.bench.floor import run_variant
from tangram_cli.bench.goals import at_least, at_most, styled, summary
from tangram_cli.bench.procs import (
    ChildCpu,
    ControllerProc,
    children_cpu_s,
    cpu_delta,
    machine_cpu_s,
    proc_cpu_s,
    start_real_agent,
    wait_nodes,
)
from tangram_cli.bench.raw_spawn import cores_of, default_cpus, pct_or_nan, raw_baselines, raw_spawn_asyncio
from tangram_cli.state import query_status

GOALS = {
    "process": {"throughput_actions_per_s": 1000, "ratio_to_raw_spawn": 1.3, "latency_p50_ms": 3.0},
    "docker": {"throughput_actions_per_s": 700, "latency_p50_ms": 4.0},
}
LAYOUTS = {
    "separate": "controller in its own process; agent in its own process; clients in the bench process",
    "inprocess": "controller and clients in one asyncio loop (the bench process); agent in its own process",
}


def _docker_url() -> str | None:
    try:
        import docker  # start-up cost: docker-py ~0.3 s
    except ImportError:
        return None
    url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if url.startswith("unix://") and not os.path.exists(url[len("unix://") :]):
        return None
    try:
        client = docker.DockerClient(base_url=url, timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no docker"
        return None
    return url


# ------------------------------------------------------------------ the live path


@dataclass
class _Cluster:
    """A controller (in this process or its own) plus one real agent."""

    layout: str
    workdir: str
    submit_addr: str = ""
    controller: Any = None
    proc: ControllerProc | None = None
    agent: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    certs: str | None = None  # --curve: the CURVE certs directory (tangram_cli/keys.py layout)
    cores: int = 1  # the cores the agent hands out

    def make_keys(self) -> None:
        """--curve: the keys of a cluster with one node `bench`, in this run's directory."""
        self.certs = str(cluster_keys.ensure_keys(Path(self.workdir) / "certs", ["bench"]))

    def _agent_config(self, agents_addr: str) -> str | None:
        if self.certs is None:
            return None

        path = os.path.join(self.workdir, "agent.json")
        curve = {
            "controller_public": os.path.join(self.certs, f"{cluster_keys.CONTROLLER}.key"),
            "secret": os.path.join(self.certs, f"{cluster_keys.agent_role('bench')}.key_secret"),
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"controller": agents_addr, "curve": curve}, fh)
        return path

    async def start(self, executor: str, cpus: str, image: str | None, env: dict[str, str],
                    staging: bool = True) -> None:
        self.cores = len(cores_of(cpus))
        if self.layout == "inprocess":
            # start-up cost: the controller's modules load for the in-process layout only
            from tangram_cli.controller.config import ControllerConfig
            from tangram_cli.controller.daemon import Controller, Options

            config = ControllerConfig(cluster="bench", stage_starts=staging)
            self.controller = Controller(config, Options(certs=self.certs))
            self.controller.start()
            await self.controller.check_security()
            agents_addr, self.submit_addr = self.controller.agents_addr, self.controller.submit_addr
        else:
            args = ("--certs", self.certs) if self.certs else ()
            ctl = ControllerProc(self.workdir, config={"scheduler": {"stage_starts": staging}}, args=args)
            self.proc = await asyncio.to_thread(ctl.start)
            agents_addr, self.submit_addr = self.proc.agents_addr, self.proc.submit_addr
        self.agent = start_real_agent(
            agents_addr, "bench", executor, cpus, self.workdir, image, env, self._agent_config(agents_addr)
        )
        deadline = time.monotonic() + 30
        if self.proc is not None:
            await asyncio.to_thread(
                wait_nodes, self.proc.status_addr, ["bench"], [self.agent], 30, self.certs
            )
            return
        while "bench" not in self.controller.core.cpu.nodes:
            if self.agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the agent did not register (see its log in " + self.workdir + ")")
            await asyncio.sleep(0.05)

    def core_counters(self) -> dict[str, int]:
        """The scheduler's counters now (``started``, ``staged``, ...)."""
        if self.proc is None:
            return dict(self.controller.core.counters)
        records = query_status(self.proc.status_addr, sections=("cluster",), timeout_s=10, certs=self.certs)
        return dict((records.get("cluster") or {}).get("counters") or {})

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds so far of the controller process (None in process), the agent and this process."""
        return {
            "controller": self.proc.cpu_s() if self.proc is not None else None,
            "agent": proc_cpu_s(self.agent.pid) if self.agent is not None else None,
            "bench": proc_cpu_s(os.getpid()),
        }

    def children(self) -> ChildCpu:
        """The agent's children (its spawners): CPU so far, their own and the actions' they reaped."""
        return children_cpu_s(self.agent.pid) if self.agent is not None else {}

    async def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            try:
                await asyncio.to_thread(self.agent.wait, 10)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        if self.controller is not None:
            await self.controller.stop()
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)
        shutil.rmtree(self.workdir, ignore_errors=True)


async def _overhead(addr: str, n: int, certs: str | None = None) -> dict[str, Any]:
    async with (
        tangram.AsyncClient(addr, name="bench-overhead", certs=certs) as tg,
        tg.sandbox(mem="256MiB") as sb,
    ):
        for _ in range(min(5, n)):  # warm-up: sandbox creation, first exec
            await sb.exec("true", timeout=60)
        latency, overhead, ctl = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            r = await sb.exec("true", timeout=60)
            total = time.perf_counter() - t0
            latency.append(total)
            overhead.append(max(0.0, total - r.run_s))
            ctl.append(r.overhead_s)
    return {
        "latency_p50_ms": pct_or_nan(latency, 0.5) * 1e3,
        "latency_p99_ms": pct_or_nan(latency, 0.99) * 1e3,
        "overhead_p50_ms": pct_or_nan(overhead, 0.5) * 1e3,
        "overhead_p99_ms": pct_or_nan(overhead, 0.99) * 1e3,
        "controller_overhead_p50_ms": pct_or_nan(ctl, 0.5) * 1e3,
        "overhead_mean_ms": statistics.fmean(overhead) * 1e3 if overhead else float("nan"),
    }


async def _throughput(cluster: _Cluster, n: int, clients: int) -> dict[str, Any]:
    async def worker(k: int, count: int, go: asyncio.Event) -> int:
        async with (
            tangram.AsyncClient(cluster.submit_addr, name=f"bench-{k}", certs=cluster.certs) as c,
            c.sandbox(mem="64MiB") as s,
        ):
            await s.exec("true", timeout=60)
            ready.append(k)
            await go.wait()
            for _ in range(count):
                r = await s.exec("true", timeout=120)
                holds.append((r.run_s, r.overhead_s))
            finished.append(time.perf_counter())
            await measured.wait()  # the sandbox (and its spawner) stays until the figures are read
        return count

    per = [n // clients + (1 if k < n % clients else 0) for k in range(clients)]
    ready: list[int] = []
    holds: list[tuple[float, float]] = []  # per action: (agent run_s, controller overhead_s)
    finished: list[float] = []
    go, measured = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.ensure_future(worker(k, c, go)) for k, c in enumerate(per) if c]
    while len(ready) < len(tasks) and not any(t.done() for t in tasks):  # noqa: ASYNC110 - a failed worker ends it
        await asyncio.sleep(0.01)
    counted0 = await asyncio.to_thread(cluster.core_counters)
    cpu0, kids0, machine0 = cluster.cpu(), cluster.children(), machine_cpu_s()
    t0 = time.perf_counter()
    go.set()
    while len(finished) < len(tasks) and not any(t.done() for t in tasks):  # noqa: ASYNC110 - as above
        await asyncio.sleep(0.005)
    wall = (max(finished) if finished else time.perf_counter()) - t0
    cpu1, kids1, machine1 = cluster.cpu(), cluster.children(), machine_cpu_s()
    measured.set()
    done = await asyncio.gather(*tasks)
    counted1 = await asyncio.to_thread(cluster.core_counters)
    started = counted1.get("started", 0) - counted0.get("started", 0)
    out = {
        "throughput_actions_per_s": sum(done) / wall if wall > 0 else float("nan"),
        "throughput_wall_s": wall,
        # starts decided before their cores were free (tangram/core/staging.py), of all starts
        "staged_share": (counted1.get("staged", 0) - counted0.get("staged", 0)) / started if started else 0.0,
        **_hold_figures(holds, cluster.cores),
        # busy share of all the machine's cores over the run: near 1, it was bound by CPU
        "machine_busy_share": _share(machine1[0] - machine0[0], machine1[1] - machine0[1]),
    }
    if cluster.agent is not None:
        cpu0["spawners"], cpu0["actions"] = 0.0, 0.0
        cpu1["spawners"], cpu1["actions"] = cpu_delta(kids0, kids1)
    for who, name in (("controller", "controller"), ("agent", "agent"), ("spawners", "spawners"),
                      ("actions", "actions"), ("bench", "bench_process")):
        a, b = cpu0.get(who), cpu1.get(who)
        if (
            a is not None and b is not None
        ):  # the bench process holds the clients (and the controller if inprocess)
            out[f"{name}_cpu_ms_per_action"] = (b - a) * 1e3 / max(1, sum(done))
    out.update(_own_cpu(out))
    return out


def _own_cpu(out: dict[str, Any]) -> dict[str, float]:
    """Tangram's CPU per action (controller, agent, spawners and the bench process's clients;
    separate layout only) and its ratio to the no-op's own CPU (an exec of ``sh -c true``): both
    move with this VM's speed, which swings by up to 40% within an hour, so the ratio compares runs
    of different hours where the throughput cannot."""
    parts = [out.get(f"{n}_cpu_ms_per_action") for n in ("controller", "agent", "spawners", "bench_process")]
    own = out.get("actions_cpu_ms_per_action")
    if any(v is None for v in parts) or not own:
        return {}
    total = sum(v for v in parts if v is not None)
    return {"tangram_cpu_ms_per_action": total, "tangram_cpu_per_action_cpu": total / own}


def _share(busy: float, total: float) -> float | None:
    """busy / total CPU seconds of the machine; None when the run was shorter than one clock tick."""
    return busy / total if total > 0 else None


def _hold_figures(holds: list[tuple[float, float]], cores: int) -> dict[str, Any]:
    """How long each action held its core, and the throughput that caps. A core is given to one
    action from the decision to the controller's handling of its end: the agent's run (spawn to
    exit, as the agent measures it) plus the controller's overhead (its submit-to-final time
    minus queueing and run: the trip to the agent and back, and the controller's own work). With
    every action on one core, throughput cannot pass cores / mean hold — unless starts are
    staged (tangram/core/staging.py): then the next action starts at this one's exit and the
    controller's part leaves the hold (``staged_share`` says how many starts were)."""
    if not holds:
        return {}
    runs = [r for r, _ in holds]
    hold = [r + o for r, o in holds]
    mean = statistics.fmean(hold)
    return {
        "hold_run_p50_ms": pct_or_nan(runs, 0.5) * 1e3,
        "hold_controller_p50_ms": pct_or_nan([o for _, o in holds], 0.5) * 1e3,
        "hold_p50_ms": pct_or_nan(hold, 0.5) * 1e3,
        "hold_bound_actions_per_s": cores / mean if mean > 0 else float("nan"),
    }


async def _bench_one(
    executor: str,
    n: int,
    clients: int,
    cpus: str,
    image: str | None,
    env: dict[str, str],
    layout: str,
    curve: bool = False,
    staging: bool = True,
    floor: bool = False,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "executor": executor,
        "n": n,
        "clients": clients,
        "layout": layout,
        "security": "curve" if curve else "plain",
        "staged_starts": staging,
        "layout_detail": LAYOUTS[layout],
        "throughput_concurrency": clients,
        "goals": GOALS.get(executor, {}),
    }
    try:
        out.update(await raw_baselines(n, clients, cpus))
    except OSError as exc:
        out["raw_spawn_error"] = f"{type(exc).__name__}: {exc}"
    cluster = _Cluster(layout, tempfile.mkdtemp(prefix="tangram-bench-"))
    try:
        if curve:
            cluster.make_keys()
        await cluster.start(executor, cpus, image, env, staging)
        out.update(await _overhead(cluster.submit_addr, n, cluster.certs))
        out.update(await _throughput(cluster, n, clients))
    except Exception as exc:  # noqa: BLE001 - report per executor, keep going
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        await cluster.stop()
    if floor and executor == "process" and "throughput_actions_per_s" in out:
        await _floor(out, n, clients, cpus)
    if "throughput_actions_per_s" in out and "raw_spawn_actions_per_s" in out:
        await _raw_after(out, n, clients, cpus)
    return out


async def _floor(out: dict[str, Any], n: int, clients: int, cpus: str) -> None:
    """`tangram bench floor`'s `spawners` variant right after the throughput run, and the ratio to it."""
    try:
        row = await asyncio.to_thread(run_variant, "spawners", n, clients, cores_of(cpus))
    except (OSError, RuntimeError, ValueError) as exc:
        out["floor_error"] = f"{type(exc).__name__}: {exc}"
        return
    out.update(floor_actions_per_s=row["actions_per_s"], floor_latency_p50_ms=row["latency_p50_ms"],
               floor_cpu_ms_per_action=row["floor_cpu_ms_per_action"],
               ratio_to_floor=out["throughput_actions_per_s"] / row["actions_per_s"])


async def _raw_after(out: dict[str, Any], n: int, clients: int, cpus: str) -> None:
    """The asyncio baseline again, once the daemons are gone, and the ratios to the mean of both runs:
    this VM's speed moves by a fifth within a minute, and the throughput run falls between the two
    (docs/performance.md, "raw spawn")."""
    before = out["raw_spawn_actions_per_s"]
    try:
        after = (await raw_spawn_asyncio(n, clients, cpus))["actions_per_s"]
    except OSError as exc:
        out["raw_spawn_error"] = f"{type(exc).__name__}: {exc}"
        after = before
    out.update(raw_spawn_before_actions_per_s=before, raw_spawn_after_actions_per_s=after,
               raw_spawn_actions_per_s=(before + after) / 2)
    out["ratio_to_raw_spawn"] = out["throughput_actions_per_s"] / out["raw_spawn_actions_per_s"]
    if out.get("raw_posix_spawn_actions_per_s"):
        out["ratio_to_posix_spawn"] = out["throughput_actions_per_s"] / out["raw_posix_spawn_actions_per_s"]


# (label, JSON keys shown "a / b", number format, unit, goal key, goal text)
_FIGURES = (
    ("overhead p50 / p99", ("overhead_p50_ms", "overhead_p99_ms"), "{:.2f}", " ms", None, ""),
    (
        "latency p50 / p99",
        ("latency_p50_ms", "latency_p99_ms"),
        "{:.2f}",
        " ms",
        "latency_p50_ms",
        "p50 ≤ {} ms",
    ),
    ("throughput", ("throughput_actions_per_s",), "{:.0f}", " /s", "throughput_actions_per_s", "≥ {} /s"),
    ("raw spawn (asyncio): before / after",
     ("raw_spawn_before_actions_per_s", "raw_spawn_after_actions_per_s"), "{:.0f}", " /s", None, ""),
    ("raw spawn (asyncio): mean", ("raw_spawn_actions_per_s",), "{:.0f}", " /s", None, ""),
    ("raw spawn (posix_spawn)", ("raw_posix_spawn_actions_per_s",), "{:.0f}", " /s", None, ""),
    ("ratio to raw spawn", ("ratio_to_raw_spawn",), "{:.2f}", "x", "ratio_to_raw_spawn", "≥ {}x"),
    ("the layout's floor (--floor)", ("floor_actions_per_s",), "{:.0f}", " /s", None, ""),
    ("ratio to the floor", ("ratio_to_floor",), "{:.2f}", "x", None, ""),
    ("core hold p50: run + controller", ("hold_run_p50_ms", "hold_controller_p50_ms"), "{:.2f}", " ms", None,
     ""),
    ("cores / mean hold", ("hold_bound_actions_per_s",), "{:.0f}", " /s", None, ""),
    ("starts staged", ("staged_share",), "{:.0%}", "", None, ""),
    ("CPU / action: controller", ("controller_cpu_ms_per_action",), "{:.2f}", " ms", None, ""),
    ("CPU / action: agent", ("agent_cpu_ms_per_action",), "{:.2f}", " ms", None, ""),
    ("CPU / action: bench process", ("bench_process_cpu_ms_per_action",), "{:.2f}", " ms", None, ""),
    ("CPU / action: spawners", ("spawners_cpu_ms_per_action",), "{:.2f}", " ms", None, ""),
    ("CPU / action: the actions", ("actions_cpu_ms_per_action",), "{:.2f}", " ms", None, ""),
    ("CPU / action: Tangram in all", ("tangram_cpu_ms_per_action",), "{:.2f}", " ms", None, ""),
    ("Tangram's CPU / the action's", ("tangram_cpu_per_action_cpu",), "{:.2f}", "x", None, ""),
    ("machine busy (all cores)", ("machine_busy_share",), "{:.0%}", "", None, ""),
)


def goals_met(row: dict[str, Any]) -> dict[str, bool | None]:
    """One executor's goals: PASS (True) / FAIL (False) / not measured (None)."""
    goals = GOALS.get(row.get("executor", ""), {})
    checks = {"latency_p50_ms": at_most, "throughput_actions_per_s": at_least, "ratio_to_raw_spawn": at_least}
    return {key: checks[key](row.get(key), limit) for key, limit in goals.items()}


def _cell(row: dict[str, Any], keys: tuple[str, ...], number: str, unit: str) -> str:
    values = [row.get(k) for k in keys]
    if all(v is None for v in values):
        return "failed" if "error" in row else "-"
    return " / ".join("-" if v is None else number.format(v) for v in values) + unit


def _print_table(rows: list[dict[str, Any]]) -> None:
    """One row per figure, one column per executor, the goals beside them."""
    first = rows[0] if rows else {}
    table = Table(
        title=f"tangram bench dispatch: no-op actions, one local agent, n={first.get('n', '-')}, "
        f"{first.get('clients', '-')} clients"
    )
    table.add_column("figure")
    for r in rows:
        table.add_column(r["executor"], justify="right")
    table.add_column("goal (process; docker)", justify="right")
    met = [goals_met(r) for r in rows]
    for label, keys, number, unit, goal_key, goal_text in _FIGURES:
        goals = "; ".join(goal_text.format(g[goal_key]) for g in GOALS.values() if goal_key in g)
        cells = [
            _cell(r, keys, number, unit) + (f" {styled(m[goal_key])}" if goal_key in m else "")
            for r, m in zip(rows, met, strict=True)
        ]
        table.add_row(label, *cells, goals or "-")
    console = Console()
    console.print(table)
    for r, m in zip(rows, met, strict=True):
        console.print(f"{r['executor']}: {summary(m)}", markup=False, highlight=False)
    if rows:
        console.print(f"layout: {first['layout_detail']}", markup=False, highlight=False)
        console.print(f"security: {first.get('security', 'plain')}", markup=False, highlight=False)
        console.print(
            f"raw spawn: `{first.get('raw_spawn_cmd', '-')}` (cores round-robin) at the clients' concurrency",
            markup=False,
            highlight=False,
        )
    for r in rows:
        if "error" in r:
            console.print(f"{r['executor']}: {r['error']}", markup=False, highlight=False, soft_wrap=True)


@click.command("dispatch")
@click.option(
    "-n",
    "n",
    type=click.IntRange(1, 1_000_000),
    default=200,
    show_default=True,
    help="No-op actions per measurement.",
)
@click.option(
    "--clients",
    type=click.IntRange(1, 1024),
    default=16,
    show_default=True,
    help="Concurrent clients for the throughput run (and spawners for the raw baseline).",
)
@click.option(
    "--executor",
    "executors",
    type=click.Choice(["process", "docker"]),
    multiple=True,
    help="Executor(s) to measure (default: process, and docker when dockerd answers).",
)
@click.option("--cpus", default=None, help="Cores the agent hands out (default: 0-1, or 0 on one core).")
@click.option("--image", default=None, help="Sandbox image for the docker executor (default: the agent's).")
@click.option(
    "--layout",
    type=click.Choice(sorted(LAYOUTS)),
    default="separate",
    show_default=True,
    help="separate: the controller in its own process; inprocess: controller and clients in one loop.",
)
@click.option(
    "--curve",
    is_flag=True,
    help="CURVE on every socket (keys in the run's temporary directory), as `tangram up` runs; "
    "default: plain TCP on 127.0.0.1.",
)
@click.option(
    "--no-staging",
    "no_staging",
    is_flag=True,
    help="Decide each start only once its cores are free (scheduler.stage_starts: false, the default of "
    "`tangram up`); without it the bench's controller runs with staged starts on, to measure them.",
)
@click.option(
    "--floor",
    "with_floor",
    is_flag=True,
    help="Also run `tangram bench floor` (its spawners variant) after the process executor's throughput "
    "run, and print the throughput as a ratio of it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def dispatch(
    n: int,
    clients: int,
    executors: tuple[str, ...],
    cpus: str | None,
    image: str | None,
    layout: str,
    curve: bool,
    no_staging: bool,
    with_floor: bool,
    as_json: bool,
) -> None:
    """Per-action overhead (p50/p99) and control-plane throughput, per executor, next to raw spawns."""
    logging.getLogger("tangram").setLevel(logging.ERROR)
    if cpus is None:
        cpus = default_cpus()
    chosen = list(executors) or ["process"]
    docker_env: dict[str, str] = {}
    if not executors or "docker" in executors:
        url = _docker_url()
        if url is not None:
            docker_env["DOCKER_HOST"] = url
            if "docker" not in chosen:
                chosen.append("docker")
        elif "docker" in executors:
            raise click.UsageError("--executor docker: no dockerd answers (set DOCKER_HOST)")

    async def run_all() -> list[dict[str, Any]]:
        rows = []
        for ex in chosen:
            rows.append(
                await _bench_one(
                    ex,
                    n,
                    clients,
                    cpus,
                    image if ex == "docker" else None,
                    docker_env if ex == "docker" else {},
                    layout,
                    curve,
                    not no_staging,
                    with_floor,
                )
            )
        return rows

    rows = asyncio.run(run_all())
    if as_json:
        for r in rows:
            r["met"] = goals_met(r)
        click.echo(json.dumps({"dispatch": rows}, indent=2, default=str))
    else:
        _print_table(rows)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(dispatch())
