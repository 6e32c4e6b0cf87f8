"""`tangram bench scheduler`: decision latency of ``Scheduler.handle`` under a steady queue.

One node with 256 cores on 2 NUMA domains and 8 GPUs; a mixed stream of elastic test runs
(1-16 cores, Amdahl), short commands (1 core) and reward-model calls (1 GPU). The queue is
held near the target length by finishing one running action and submitting one new action
per step; every ``handle`` call is timed, by the wall clock (``*_ms``) and by the thread's
CPU clock (``cpu_*_ms``: what the decision costs without the time other processes take
the core, the honest figure on a busy machine). Each queue length's p99 is also given as a
ratio to the shortest queue's (128 by default): a decision must not cost more as the queue
grows (goal: at most 2x). Figures are printed with PASS/FAIL per goal, never asserted.
"""
from __future__ import annotations

import json
import statistics
import time
from random import Random

import click
from rich.console import Console
from rich.table import Table

from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.resources import CPU, GPU, Demand
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram_cli.bench.goals import scheduler_goals, summary, word


def _spec(rng: Random, i: int, sandboxes: int) -> ActionSpec:
    roll = rng.random()
    if roll < 0.3:
        return ActionSpec(f"t{i}", Kind.EXEC, ((CPU, Demand.range(1, 16)),), sandbox=f"sb{i % sandboxes}",
                          action_type="pytest", elasticity=Elasticity.amdahl(0.05), t_ori=30.0)
    if roll < 0.85:
        return ActionSpec(f"c{i}", Kind.EXEC, ((CPU, Demand.fixed(1)),), sandbox=f"sb{i % sandboxes}",
                          action_type="cmd", t_ori=0.5)
    return ActionSpec(f"g{i}", Kind.CALL, ((GPU, Demand.fixed(1)),), key=GPU, service="rm", action_type="reward")


def measure(queued: int, steps: int, seed: int = 0, depth: int = 2) -> dict[str, float]:
    rng = Random(seed)
    sched = Scheduler(CoreConfig(depth=depth), seed=seed)
    cpus = tuple(range(256))
    sched.handle(ev.NodeJoined("n1", cpus=cpus, numa=(cpus[:128], cpus[128:]), mem_mib=2_400_000, gpus=8,
                               gpu_mem_mib=80_000), 0.0)
    sched.handle(ev.ServiceDefined("rm", 30_000, (1,), load_s=0.3, t_ori=1.0), 0.0)
    sandboxes = 512
    for s in range(sandboxes):
        sched.handle(ev.SandboxOpened(f"sb{s}", client="bench", mem_mib=1024), 0.0)
    now, i = 0.0, 0
    while sum(len(q) for q in sched.queues.values()) < queued:  # fill: cores and GPUs busy, queue built
        sched.handle(ev.ActionSubmitted(_spec(rng, i, sandboxes)), now)
        i += 1
    wall: list[float] = []
    cpu: list[float] = []

    def timed(event: ev.Event) -> None:
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        sched.handle(event, now)
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        wall.append((w1 - w0) / 1e6)
        cpu.append((c1 - c0) / 1e6)

    for _ in range(steps):
        now += 0.01
        running = sorted(sched.running)
        if running:
            timed(ev.ActionFinished(running[rng.randrange(len(running))]))
        while sum(len(q) for q in sched.queues.values()) < queued:
            timed(ev.ActionSubmitted(_spec(rng, i, sandboxes)))
            i += 1
    wall.sort()
    cpu.sort()
    return {
        "queued": queued,
        "calls": len(wall),
        "p50_ms": wall[len(wall) // 2],
        "p99_ms": _p99(wall),
        "max_ms": wall[-1],
        "mean_ms": statistics.fmean(wall),
        "cpu_p50_ms": cpu[len(cpu) // 2],
        "cpu_p99_ms": _p99(cpu),
        "running": len(sched.running),
    }


def _p99(samples: list[float]) -> float:
    return samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def with_ratios(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each row's p99 (wall and CPU) over the shortest queue's, as ``p99_ratio`` and
    ``cpu_p99_ratio`` (``ratio_to_queued`` says which queue length that is)."""
    if not rows:
        return rows
    base = min(rows, key=lambda r: r["queued"])
    for r in rows:
        r["ratio_to_queued"] = base["queued"]
        r["p99_ratio"] = r["p99_ms"] / base["p99_ms"] if base["p99_ms"] > 0 else 0.0
        r["cpu_p99_ratio"] = r["cpu_p99_ms"] / base["cpu_p99_ms"] if base["cpu_p99_ms"] > 0 else 0.0
    return rows


DEFAULT_QUEUED = (128, 1024)
DEFAULT_QUEUED_JSON = (128, 1024, 10_000, 100_000)  # about 20 s in all on a 2-core machine


@click.command("scheduler")
@click.option("-n", "--steps", default=2000, show_default=True, help="Finish+submit steps per queue length.")
@click.option("--queued", "queued", multiple=True, type=int,
              help="Queue lengths to hold (repeatable) [default: 128 and 1024; --json: also 10^4, 10^5].")
@click.option("--depth", default=2, show_default=True, help="ApproxACTs depth.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def scheduler(steps: int, queued: tuple[int, ...], depth: int, seed: int, as_json: bool) -> None:
    """Decision latency (p50/p99/max, wall and CPU clock) of the scheduling core: a 256-core
    node on two NUMA domains plus 8 GPUs, a mixed queue held at each length, with each
    p99 over the shortest queue's. Goals: p99 <= 1 ms at 1024 queued, and at most 2x the
    shortest queue's p99 at any length."""
    lengths = queued or (DEFAULT_QUEUED_JSON if as_json else DEFAULT_QUEUED)
    rows = with_ratios([measure(q, steps, seed, depth) for q in lengths])
    checked = scheduler_goals(rows)
    met = {k: g["met"] for k, g in checked.items()}
    if as_json:
        goals = {"goal_p99_ms_at_1024": 1.0, "goal_p99_ratio_max": 2.0}
        click.echo(json.dumps({"scheduler": rows, **goals, "goals": checked, "met": met}, indent=2))
        return

    table = Table(title="scheduler decision latency (handle)")
    for col in ("queued", "calls", "p50 ms", "p99 ms", "max ms", "mean ms", "cpu p99 ms", "p99 ratio", "cpu ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["queued"]), str(r["calls"]), f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                      f"{r['max_ms']:.3f}", f"{r['mean_ms']:.3f}", f"{r['cpu_p99_ms']:.3f}",
                      f"{r['p99_ratio']:.2f}", f"{r['cpu_p99_ratio']:.2f}")
    Console().print(table)
    click.echo(f"ratios: p99 over the p99 at {rows[0]['ratio_to_queued']} queued")
    for key, g in checked.items():
        measured = "not measured" if g["measured"] is None else f"{g['measured']:.3f}"
        click.echo(f"{word(g['met']):4} {key}: {measured} (goal {g['goal']})")
    click.echo(summary(met))
