"""`tangram demo`: the built-in agentic-RL workload, under Tangram and under a static baseline.

Uses the cluster named by TANGRAM_ADDR, else the running local cluster, else starts the local
default (`tangram up`). See tangram_cli/demo/workload.py for the workload and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tangram_cli import state as st
from tangram_cli.bootstrap import local
from tangram_cli.demo import workload as dw
from tangram_cli.params import output_option, verbosity
from tangram_cli.render import status as rs


def _cluster_cores(records: dict[str, Any]) -> int:
    nodes = [r for r in rs.rows(records, "nodes") if rs.healthy(r)]
    cores = [int(r.get("cpus_total") or 0) for r in nodes]
    return max(1, sum(cores))


def _ensure_cluster(quiet: bool) -> tuple[str, str | None]:
    """(client address, status address or None)."""
    addr = os.environ.get("TANGRAM_ADDR")
    if addr:
        live = [s for s in st.running() if s.address == addr]
        return addr, live[0].status_address if live else None

    def say(msg: str) -> None:
        if not quiet:
            click.echo(f"  {msg}", err=True)

    state, started = local.up_local(on_event=say)
    if started and not quiet:
        click.echo(f"started the local cluster: controller {state.address}", err=True)
    return state.address, state.status_address


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else (f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s")


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.1f}{unit}"


def render_table(summary: dict[str, Any], cfg: Any) -> Any:
    pol = summary["policies"]
    ratio = summary["static_over_tangram"]
    t = Table(
        title=f"tangram demo: {cfg.trajectories} trajectories x {cfg.turns} turns on {cfg.cores} core(s)",
        header_style="bold",
        title_justify="left",
    )
    t.add_column("")
    t.add_column("tangram", justify="right")
    t.add_column(f"static (k={cfg.reserve})", justify="right")
    t.add_column("static/tangram", justify="right")
    a, b = pol.get("tangram", {}), pol.get("static", {})

    def x(key: str) -> str:
        r = ratio.get(key)
        return "-" if r is None else f"{r:.2f}x"

    t.add_row("mean ACT", _fmt_s(a.get("mean_act_s")), _fmt_s(b.get("mean_act_s")), x("mean_act_s"))
    t.add_row("p99 ACT", _fmt_s(a.get("p99_act_s")), _fmt_s(b.get("p99_act_s")), x("p99_act_s"))
    t.add_row(
        "mean test-run ACT",
        _fmt_s(a.get("mean_test_act_s")),
        _fmt_s(b.get("mean_test_act_s")),
        x("mean_test_act_s"),
    )
    t.add_row("mean test-run DoP", _fmt(a.get("mean_test_dop")), _fmt(b.get("mean_test_dop")), "")
    t.add_row("makespan", _fmt_s(a.get("makespan_s")), _fmt_s(b.get("makespan_s")), x("makespan_s"))
    t.add_row("reserved core-s", _fmt(a.get("reserved_core_s")), _fmt(b.get("reserved_core_s")), "")
    t.add_row("busy core-s", _fmt(a.get("busy_core_s")), _fmt(b.get("busy_core_s")), "")

    def util(p: dict[str, Any]) -> str:
        u = p.get("busy_over_reserved")
        return "-" if u is None else f"{u * 100:.0f}%"

    t.add_row("busy / reserved", util(a), util(b), "")
    t.add_row("failed", str(a.get("failed_trajectories", "-")), str(b.get("failed_trajectories", "-")), "")
    return t


@click.command("demo")
@click.option(
    "--workload",
    type=click.Choice(["coding"]),
    default="coding",
    show_default=True,
    help="Built-in workload (coding: commands, elastic test runs, reward model, search API).",
)
@click.option("-n", "--trajectories", default=8, show_default=True, type=click.IntRange(1, 512))
@click.option("--turns", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--test-units",
    default=20,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="CPU work of one test run (1 unit ~ 30 ms of one core).",
)
@click.option(
    "--reserve",
    default=None,
    type=click.IntRange(1, 4096),
    help="Static baseline: cores per trajectory (default: cores / trajectories, at least 1).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(["tangram", "static"]),
    help="Run only these policies (default: both).",
)
@output_option("table", "json", help="table; json: the config, both policies' metrics and the ratios.")
def command(
    workload: str,
    trajectories: int,
    turns: int,
    seed: int,
    test_units: int,
    reserve: int | None,
    policies: tuple[str, ...],
    output: str,
) -> None:
    """Run an agentic-RL workload once under Tangram and once with a static per-trajectory
    allocation of the same cores, and compare action completion times (ACT).

    Starts the local cluster when none runs (TANGRAM_ADDR names another).
    """
    quiet = output == "json" or verbosity()[1] > 0
    addr, status_addr = _ensure_cluster(quiet)
    cores = os.cpu_count() or 1
    if status_addr:
        cores = _cluster_cores(st.query_status(status_addr, sections=("nodes",), timeout_s=5.0))
    k = reserve or max(1, cores // trajectories)
    cfg = dw.DemoConfig(
        trajectories=trajectories,
        turns=turns,
        seed=seed,
        test_units=test_units,
        cores=cores,
        reserve=min(k, cores),
    )
    order = [p for p in ("tangram", "static") if not policies or p in policies]
    results = _run(addr, cfg, order, quiet)
    summary = dw.compare(results)
    if output == "json":
        doc = {"workload": workload, "address": addr, "config": dw.config_dict(cfg), **summary}
        click.echo(json.dumps(doc, sort_keys=True))
    else:
        _print_summary(summary, cfg)
    if any(res.failed for res in results.values()):
        for res in results.values():
            for e in res.errors[:3]:
                click.echo(f"error: {res.policy}: {e}", err=True)
        sys.exit(1)


def _print_summary(summary: dict[str, Any], cfg: Any) -> None:
    """The table of both policies, what they mean, and the speed-up in a sentence."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=100)
    console.print(render_table(summary, cfg))
    click.echo(
        "tangram: cores per action (elastic test runs); static: k cores held per trajectory "
        "from sandbox open to close (a pod per trajectory). ACT = queueing + run time."
    )
    line = dw.speed_sentence(summary["static_over_tangram"].get("mean_act_s"))
    if line:
        click.echo(line)


def _run(addr: str, cfg: Any, order: list[str], quiet: bool) -> dict[str, Any]:
    console = Console(stderr=True, highlight=False)
    total = cfg.trajectories * cfg.actions_per_trajectory()
    results: dict[str, Any] = {}
    live = console.is_terminal and not quiet
    with Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("actions"),
        TextColumn("{task.fields[done]}/{task.fields[trajs]} trajectories"),
        TimeElapsedColumn(),
        console=console,
        disable=not live,
        transient=False,
    ) as progress:
        for policy in order:
            label = "tangram (per action)" if policy == "tangram" else f"static (reserve={cfg.reserve})"
            task = progress.add_task(label, total=total, done=0, trajs=cfg.trajectories)
            counts = {"traj": 0}

            def on(
                p: str, event: str, task: Any = task, counts: dict[str, int] = counts, label: str = label
            ) -> None:
                if event == "action":
                    progress.advance(task)
                else:
                    counts["traj"] += 1
                    progress.update(task, done=counts["traj"])
                    if not live and not quiet:
                        console.print(f"{label}: trajectory {counts['traj']}/{cfg.trajectories} done")

            if not live and not quiet:
                console.print(f"running {label}: {cfg.trajectories} trajectories x {cfg.turns} turns")
            results[policy] = asyncio.run(dw.run_policy(addr, cfg, policy, on))
    return results
