"""`tangram bench scheduler`: decision latency of ``Scheduler.handle`` under a steady queue.

One node with 256 cores on 2 NUMA domains and 8 GPUs; a mixed stream of elastic test runs
(1-16 cores, Amdahl), short commands (1 core) and reward-model calls (1 GPU). The queue is
held near the target length by finishing one running action and submitting one new action
per step; every ``handle`` call is timed. Figures are printed, never asserted.
"""
from __future__ import annotations

import json
import statistics
import time
from random import Random

import click

from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.resources import CPU, GPU, Demand
from tangram.core.scheduler import CoreConfig, Scheduler


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
    samples: list[float] = []
    for _ in range(steps):
        now += 0.01
        running = sorted(sched.running)
        if running:
            aid = running[rng.randrange(len(running))]
            t0 = time.perf_counter_ns()
            sched.handle(ev.ActionFinished(aid), now)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
        while sum(len(q) for q in sched.queues.values()) < queued:
            t0 = time.perf_counter_ns()
            sched.handle(ev.ActionSubmitted(_spec(rng, i, sandboxes)), now)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
            i += 1
    samples.sort()
    return {
        "queued": queued,
        "calls": len(samples),
        "p50_ms": samples[len(samples) // 2],
        "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "max_ms": samples[-1],
        "mean_ms": statistics.fmean(samples),
        "running": len(sched.running),
    }


@click.command("scheduler")
@click.option("-n", "--steps", default=2000, show_default=True, help="Finish+submit steps per queue length.")
@click.option("--queued", "queued", multiple=True, type=int, default=(128, 1024), show_default=True,
              help="Queue lengths to hold (repeatable).")
@click.option("--depth", default=2, show_default=True, help="ApproxACTs depth.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def scheduler(steps: int, queued: tuple[int, ...], depth: int, seed: int, as_json: bool) -> None:
    """Decision latency (p50/p99/max) of the scheduling core: a 256-core node on two NUMA
    domains plus 8 GPUs, a mixed queue held at each length. Goal: p99 <= 1 ms at 128."""
    rows = [measure(q, steps, seed, depth) for q in queued]
    if as_json:
        click.echo(json.dumps({"scheduler": rows, "goal_p99_ms_at_128": 1.0}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="scheduler decision latency (handle)")
    for col in ("queued", "calls", "p50 ms", "p99 ms", "max ms", "mean ms", "running"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["queued"]), str(r["calls"]), f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                      f"{r['max_ms']:.3f}", f"{r['mean_ms']:.3f}", str(r["running"]))
    Console().print(table)
    click.echo("goal: p99 <= 1 ms at 128 queued")
