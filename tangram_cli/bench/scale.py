"""`tangram bench scale`: the live controller against many agents, driven by the simulator's workload.

Layout (each its own process): the controller (`tangram controller`); `--agent-procs` bench-agent
processes holding `--agents` agent identities of `--cores` cores each (one DEALER per
identity; tangram_cli/bench/agents.py), whose executor sleeps for each action's modelled
duration `T_ori / (E(dop) dop)`; `--client-procs` client processes (`python -m
tangram_cli.bench.scale`) running the trajectories of the simulator's coding workload
(`tangram.sim.workloads.generate(coding, batch, seed)`, the trace `tangram sim` uses with the
same seed) through real `tangram.AsyncClient`s: per trajectory one sandbox, then per action
its generation time (`think_s`), then `exec` of the action. Every duration and think time is
divided by `--time-scale`. This process samples the status socket every 0.5 s.

Reported: decisions/s (the driver's handled events over the run), the core's decision time
from the status `decide` field (p50/p99/max over its last 4096 events; the highest p99 any
sample showed), dispatch -> result latency per action (client-measured time minus the
controller's queueing and the agent's run time), controller CPU seconds and peak RSS, and
whether every action completed, answered exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import click
from rich.console import Console
from rich.table import Table

import tangram
from tangram.errors import TangramError
from tangram.sim.workloads import generate, load
from tangram_cli.bench.agents import start_bench_agents
from tangram_cli.bench.burst import FinalCounter
from tangram_cli.bench.goals import at_most, styled, summary
from tangram_cli.bench.procs import (
    ControllerProc,
    Procs,
    bench_workdir,
    controller_figures,
    logs_and_json,
    pct,
    run_clients,
    wait_nodes,
)
from tangram_cli.state import query_status

GOALS = {"decide_p99_ms": 2.0, "all_complete": True}
WORKLOAD = "coding"


def _profile(serial: float) -> str:
    return f"bench-amdahl-{serial:g}"


def plans(batch: int, seed: int, proc: int, procs: int, max_turns: int | None) -> list[Any]:
    """This client process's share of the simulator's trajectory plans (every `procs`-th)."""
    mine = generate(load(WORKLOAD), batch, seed)[proc::procs]
    if max_turns is not None:
        for plan in mine:
            tools = [a for a in plan.actions if a.category != "reward"][:max_turns]
            plan.actions = tools + [a for a in plan.actions if a.category == "reward"]
    return mine


# ------------------------------------------------------------------ the client process


async def _trajectory(tg: Any, plan: Any, scale: float, exec_timeout: float, rec: dict[str, Any]) -> None:
    try:
        async with tg.sandbox(mem=plan.mem_mib or None) as sb:
            for a in plan.actions:
                await asyncio.sleep(a.think_s / scale)
                if a.kind != "exec":
                    rec["skipped"] += 1
                    continue
                serial = 1.0 if a.serial is None else a.serial
                cmd = f"{a.action_type.rsplit('/', 1)[-1]} {a.t_ori / scale:.6f} {serial:g}"
                t0 = time.perf_counter()
                try:
                    r = await sb.exec(
                        cmd,
                        cpus=(a.lo, a.hi),
                        timeout=exec_timeout,
                        elastic=_profile(a.serial) if a.serial is not None else None,
                        duration_hint=a.profile / scale if a.profile else None,
                    )
                except TangramError as exc:
                    rec["errors"][str(exc.code.value if exc.code else type(exc).__name__)] += 1
                    continue
                total = time.perf_counter() - t0
                rec["completed"] += 1
                rec["d2r"].append(round(max(0.0, total - r.queued_s - r.run_s) * 1e3, 3))
                rec["queued"].append(round(r.queued_s * 1e3, 3))
                rec["dop"][r.dop] += 1
    except TangramError as exc:
        rec["errors"][f"sandbox:{exc.code.value if exc.code else type(exc).__name__}"] += 1


async def _client(
    addr: str,
    proc: int,
    procs: int,
    batch: int,
    seed: int,
    scale: float,
    exec_timeout: float,
    max_turns: int | None,
) -> dict[str, Any]:
    mine = plans(batch, seed, proc, procs, max_turns)
    rec: dict[str, Any] = {
        "completed": 0,
        "skipped": 0,
        "errors": Counter(),
        "d2r": [],
        "queued": [],
        "dop": Counter(),
    }
    async with tangram.AsyncClient(addr, name=f"scale-{proc}", connect_timeout=60) as tg:
        counter = FinalCounter(tg._transport)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        go = time.time()
        tasks = [asyncio.ensure_future(_trajectory(tg, plan, scale, exec_timeout, rec)) for plan in mine]
        _, pending = await asyncio.wait(tasks, timeout=exec_timeout)
        for task in pending:
            task.cancel()
        end = time.time()
        wire = counter.summary()
    return {
        "name": f"scale-{proc}",
        "trajectories": len(mine),
        "unfinished_trajectories": len(pending),
        "planned": sum(len(p.actions) for p in mine),
        "completed": rec["completed"],
        "skipped": rec["skipped"],
        "failed": dict(rec["errors"]),
        "d2r_ms": rec["d2r"],
        "queued_ms": rec["queued"],
        "dop": {str(k): v for k, v in rec["dop"].items()},
        "wire": wire,
        "go": go,
        "end": end,
    }


def client_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tangram_cli.bench.scale", description="A scale-bench client."
    )
    ap.add_argument("--addr", required=True)
    ap.add_argument("--proc", type=int, required=True)
    ap.add_argument("--procs", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--max-turns", type=int, default=None)
    ns = ap.parse_args(argv)
    report = asyncio.run(
        _client(ns.addr, ns.proc, ns.procs, ns.batch, ns.seed, ns.time_scale, ns.timeout, ns.max_turns)
    )
    print(json.dumps(report), flush=True)
    return 0


# ------------------------------------------------------------------ the orchestrator


def _config() -> dict[str, Any]:
    """Controller config: one Amdahl profile per serial fraction the workload uses."""
    w = load(WORKLOAD)
    serials = {
        a.serial_fraction for a in (*w.tools, w.reward) if a is not None and a.serial_fraction is not None
    }
    return {"profiles": {_profile(s): {"serial_fraction": s} for s in sorted(serials)}}


def _sum(reports: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in reports if "error" not in r]
    d2r = [x for r in ok for x in r["d2r_ms"]]
    queued = [x for r in ok for x in r["queued_ms"]]
    failed: Counter[str] = Counter()
    dop: Counter[str] = Counter()
    wire: Counter[str] = Counter()
    for r in ok:
        failed.update(r["failed"])
        dop.update(r["dop"])
        wire.update({k: v for k, v in r["wire"].items() if isinstance(v, int) and not isinstance(v, bool)})
    planned = sum(r["planned"] - r["skipped"] for r in ok)
    completed = sum(r["completed"] for r in ok)
    go = min((r["go"] for r in ok), default=0.0)
    end = max((r["end"] for r in ok), default=0.0)
    return {
        "planned_actions": planned,
        "completed": completed,
        "failed": dict(failed),
        "unfinished_trajectories": sum(r["unfinished_trajectories"] for r in ok),
        "all_completed": bool(ok) and len(ok) == len(reports) and completed == planned and not failed,
        "answered_once_ok": bool(ok)
        and all(r["wire"].get("checked") for r in ok)
        and wire["unanswered"] == 0
        and wire["answered_twice_or_more"] == 0,
        "wire": dict(wire),
        "client_errors": [r["error"] for r in reports if "error" in r],
        "wall_s": round(end - go, 3),
        "actions_per_s": round(completed / (end - go), 1) if end > go else None,
        "dispatch_to_result_p50_ms": pct(d2r, 0.5),
        "dispatch_to_result_p99_ms": pct(d2r, 0.99),
        "queued_p50_ms": pct(queued, 0.5),
        "queued_p99_ms": pct(queued, 0.99),
        "dop": dict(sorted(dop.items(), key=lambda kv: int(kv[0]))),
    }


def _spawn_clients(procs: Procs, n: int, args: list[str]) -> None:
    assert procs.ctl is not None
    for k in range(n):
        argv = [sys.executable, "-m", "tangram_cli.bench.scale", "--addr", procs.ctl.submit_addr]
        argv += ["--proc", str(k), "--procs", str(n), *args]
        with open(os.path.join(procs.workdir, f"client-{k}.log"), "ab") as log:
            procs.clients.append(
                subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            )


def _events(ctl: ControllerProc) -> int:
    return int(query_status(ctl.status_addr, sections=("cluster",)).get("cluster", {}).get("events") or 0)


def _header(**figures: Any) -> dict[str, Any]:
    return {
        "workload": WORKLOAD,
        **figures,
        "machine_cores": os.cpu_count(),
        "layout": "controller, each bench-agent process and each client process in its own process",
        "goals": GOALS,
    }


def run_scale(
    agents: int,
    cores: int,
    batch: int,
    time_scale: float,
    client_procs: int,
    agent_procs: int,
    max_turns: int | None,
    seed: int,
    timeout: float,
    logs: str | None = None,
) -> dict[str, Any]:
    """The whole run; the trajectories get `timeout` seconds from the go (set-up has its own 60 s).
    With `logs`, every process's log and the status timeline (status.jsonl) are kept there."""
    out = _header(batch=batch, seed=seed, agents=agents, cores_per_agent=cores, total_cores=agents * cores)
    out.update(time_scale=time_scale, max_turns=max_turns, client_procs=client_procs, agent_procs=agent_procs)
    procs = Procs(bench_workdir(logs, "tangram-scale-"), keep=bool(logs))
    try:
        ctl = procs.ctl = ControllerProc(
            procs.workdir, _config(), log_level="INFO" if logs else "WARNING"
        ).start()
        names = [f"node-{i:03d}" for i in range(agents)]
        procs.bench = start_bench_agents(ctl.agents_addr, names, agent_procs, cores, "model", procs.workdir)
        wait_nodes(ctl.status_addr, names, [b for b, _ in procs.bench], 60)
        args = [
            "--batch",
            str(batch),
            "--seed",
            str(seed),
            "--time-scale",
            str(time_scale),
            "--timeout",
            str(timeout),
        ]
        _spawn_clients(
            procs, client_procs, args + (["--max-turns", str(max_turns)] if max_turns is not None else [])
        )
        events0, cpu0 = _events(ctl), ctl.cpu_s() or 0.0
        sampler = procs.start_sampler()
        reports = run_clients(procs.clients, time.monotonic() + 60 + timeout + 10)
        status = sampler.stop()
        out.update(_sum(reports))
        fig = out["controller"] = controller_figures(ctl, status, cpu0)
        fig["events_in_run"] = int(fig.get("events") or 0) - events0
        fig["decisions_per_s"] = round(fig["events_in_run"] / out["wall_s"], 1) if out["wall_s"] else None
    except (RuntimeError, TimeoutError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stats = procs.close()
        if stats:
            out["bench_agent"] = stats
    return out


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if isinstance(v, float) else f"{v}{unit}"


def goals_met(doc: dict[str, Any]) -> dict[str, bool | None]:
    """Each goal's PASS (True) / FAIL (False) / not measured (None) for a run's document."""
    c = doc.get("controller", {})
    st, decide = c.get("status", {}), c.get("decide") or {}
    lost = c.get("counters", {}).get("agents_lost")
    restarts = c.get("agent_restarts")
    return {
        "all_completed": doc.get("all_completed"),
        "none_failed": None if "failed" not in doc else not doc["failed"],
        "answered_once": doc.get("answered_once_ok"),
        "decide_p99_ms": at_most(decide.get("p99_ms"), GOALS["decide_p99_ms"]),
        "decide_p99_ms_highest_sample": at_most(st.get("decide_p99_max_ms"), GOALS["decide_p99_ms"]),
        "status_answer_max_s": at_most(st.get("answer_max_s"), 1.0),
        "no_agent_lost": None if lost is None or restarts is None else lost == 0 and restarts == 0,
    }


# table row (figure) -> the goal it is checked against
_ROW_GOAL = {
    "actions completed": "all_completed",
    "failed (by code)": "none_failed",
    "answered exactly once": "answered_once",
    "decide p50 / p99 / max (last 4096)": "decide_p99_ms",
    "decide p99, highest sample": "decide_p99_ms_highest_sample",
    "status answer max": "status_answer_max_s",
    "agents lost / restarts": "no_agent_lost",
}


def _rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, measured, goal) rows of the table."""
    c = doc.get("controller", {})
    st, decide = c.get("status", {}), c.get("decide") or {}
    goal = f"p99 ≤ {GOALS['decide_p99_ms']} ms"
    done = f"{doc['completed']}/{doc['planned_actions']}" + ("" if doc["all_completed"] else " (NOT ALL)")
    return [
        ("actions completed", done, "all"),
        ("failed (by code)", json.dumps(doc["failed"]) if doc["failed"] else "0", "0"),
        ("answered exactly once", "yes" if doc["answered_once_ok"] else "NO", "yes"),
        ("actions/s", _fmt(doc["actions_per_s"]), "-"),
        ("decisions/s (driver events)", _fmt(c.get("decisions_per_s")), "-"),
        (
            "decide p50 / p99 / max (last 4096)",
            f"{_fmt(decide.get('p50_ms'))} / {_fmt(decide.get('p99_ms'))} / {_fmt(decide.get('max_ms'))} ms",
            goal,
        ),
        ("decide p99, highest sample", _fmt(st.get("decide_p99_max_ms"), " ms"), goal),
        ("loop lag max (sampled)", _fmt(st.get("loop_lag_max_s"), " s"), "-"),
        (
            "dispatch -> result p50 / p99",
            f"{_fmt(doc['dispatch_to_result_p50_ms'])} / {_fmt(doc['dispatch_to_result_p99_ms'])} ms",
            "-",
        ),
        ("queued p50 / p99", f"{_fmt(doc['queued_p50_ms'])} / {_fmt(doc['queued_p99_ms'])} ms", "-"),
        ("controller CPU / wall", f"{c.get('cpu_s')} s / {doc['wall_s']} s", "-"),
        ("controller RSS peak", f"{c.get('rss_peak_mib')} MiB", "-"),
        ("status answer max", _fmt(st.get("answer_max_s"), " s"), "≤ 1 s"),
        (
            "agents lost / restarts",
            f"{c.get('counters', {}).get('agents_lost', '-')} / {c.get('agent_restarts')}",
            "0 / 0",
        ),
    ]


def _print(doc: dict[str, Any]) -> None:
    console = Console()
    if "completed" not in doc:
        console.print(f"scale failed: {doc.get('error')}", markup=False, highlight=False)
        return
    table = Table(
        title=f"tangram bench scale: {doc['agents']} agents x {doc['cores_per_agent']} cores, "
        f"{doc['workload']} batch {doc['batch']}, time / {doc['time_scale']:g}"
    )
    met = goals_met(doc)
    for col in ("figure", "measured", "goal", "met"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for row in _rows(doc):
        goal = _ROW_GOAL.get(row[0])
        table.add_row(*row, styled(met[goal]) if goal else "")
    console.print(table)
    console.print(summary(met), markup=False, highlight=False)
    c = doc.get("controller", {})
    for line in [*(c.get("log", {}).get("first") or []), *doc.get("client_errors", [])]:
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if "error" in doc:
        console.print(f"error: {doc['error']}", markup=False, highlight=False)


@click.command("scale")
@click.option(
    "--agents", type=click.IntRange(1, 1000), default=100, show_default=True, help="Agent identities (nodes)."
)
@click.option(
    "--cores", type=click.IntRange(1, 4096), default=256, show_default=True, help="Cores per agent."
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=256,
    show_default=True,
    help="Trajectories (the issue's target: 2048).",
)
@click.option(
    "--time-scale",
    type=click.FloatRange(0.01, 100_000),
    default=10.0,
    show_default=True,
    help="Divide every modelled duration and think time by this.",
)
@click.option(
    "--max-turns",
    type=click.IntRange(0, 1000),
    default=None,
    help="Keep at most this many tool actions per trajectory (plus its reward).",
)
@click.option("--client-procs", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--agent-procs", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="The workload seed (`tangram sim`'s default)."
)
@click.option(
    "--timeout",
    type=click.FloatRange(1, 7200),
    default=240,
    show_default=True,
    help="Seconds the trajectories may take; unfinished ones are reported.",
)
@logs_and_json
def scale(
    agents: int,
    cores: int,
    batch: int,
    time_scale: float,
    max_turns: int | None,
    client_procs: int,
    agent_procs: int,
    seed: int,
    timeout: float,
    logs: str | None,
    as_json: bool,
) -> None:
    """The live controller against many (bench) agents, driven by the simulator's coding workload."""
    doc = run_scale(
        agents, cores, batch, time_scale, client_procs, agent_procs, max_turns, seed, timeout, logs
    )
    if as_json:
        if "completed" in doc:
            doc["met"] = goals_met(doc)
        click.echo(json.dumps({"scale": doc}, indent=2, default=str))
    else:
        _print(doc)
    if "completed" not in doc:
        raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(client_main())
