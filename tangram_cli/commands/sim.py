"""`tangram sim`: the discrete-event simulator around the real scheduling core.

tangram sim --workload coding --batch 2048 --policy tangram --policy k8s
tangram sim --experiment fig8-cpu --plot fig8cpu.png
tangram sim --experiment jobs          # many RL jobs: shares under saturation, a small job beside a burst
tangram sim --experiment pool          # a burst of sandbox opens with and without a warm sandbox pool
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tangram.journal import Journal
from tangram.sim import experiments, workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterSpec, load_cluster
from tangram.sim.engine import Engine
from tangram.sim.experiments import BASELINE
from tangram.sim.metrics import summarize
from tangram.sim.plots import _plt, plot_experiment, plot_runs
from tangram.sim.pool_experiment import COLUMNS as POOL_COLUMNS
from tangram.sim.report import TOLERANCE, RunProgress, compare, fmt_value, planned_runs
from tangram_cli.params import deprecated, output_option, verbosity

ROWS = [
    ("mean_act_s", "mean ACT (s)"),
    ("p50_act_s", "p50 ACT (s)"),
    ("p99_act_s", "p99 ACT (s)"),
    ("env_act_s", "env interaction ACT / traj (s)"),
    ("reward_act_s", "reward ACT / traj (s)"),
    ("total_act_s", "total ACT / traj (s)"),
    ("step_time_s", "step time (s)"),
    ("queue_share", "queueing share"),
    ("failed", "failed actions"),
    ("cpu_busy_core_s", "CPU busy core-s"),
    ("cpu_held_core_s", "CPU held core-s"),
    ("cpu_util", "CPU utilisation"),
    ("cpu_efficiency", "CPU busy / held"),
    ("gpu_busy_s", "GPU busy GPU-s"),
    ("gpu_held_s", "GPU held GPU-s"),
    ("gpu_util", "GPU utilisation"),
    ("restore_share", "GPU restore share"),
    ("gpu_act_s", "mean GPU ACT (s)"),
    ("prewakes", "GPU pre-wakes"),
    ("api_429", "API 429s to rollout code"),
    ("keyed_share", "keyed API served / keys' limits"),
    ("events", "core events"),
    ("events_per_s", "events / s (wall)"),
]
RATIO_KEYS = {
    "mean_act_s",
    "p50_act_s",
    "p99_act_s",
    "env_act_s",
    "reward_act_s",
    "total_act_s",
    "step_time_s",
    "gpu_act_s",
}


# the columns of an experiment's table, in order
_EXPERIMENT_COLUMNS = (
    "workload",
    "batch",
    "policy",
    "gpus",
    "cpu_nodes",
    "mean_act_s",
    "p99_act_s",
    "env_act_s",
    "reward_act_s",
    "step_time_s",
    "failed",
    "decide_mean_us",
)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def _table(doc: dict[str, dict[str, Any]], title: str) -> Any:
    pols = list(doc)
    table = Table(title=title)
    table.add_column("metric")
    for p in pols:
        table.add_column(p, justify="right")
    base = doc.get("tangram")
    others = [p for p in pols if p != "tangram"] if base else []
    for p in others:
        table.add_column(f"{p} / tangram", justify="right")
    for key, label in ROWS:
        cells = [_fmt(doc[p].get(key, "")) for p in pols]
        for p in others:
            r = doc[p][key] / base[key] if key in RATIO_KEYS and base and base[key] else None
            cells.append(f"{r:.2f}x" if r is not None else "")
        table.add_row(label, *cells)
    return table


class _Bar:
    """A rich progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, quiet: bool) -> None:
        self.console = Console(stderr=True)
        self.progress = (
            None
            if quiet
            else Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
        )
        self.task: Any = None
        self._last = 0

    def __enter__(self) -> _Bar:  # noqa: PYI034 (typing.Self needs 3.11)
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def start(self, label: str, total: int | None = None) -> None:
        if self.progress is None:
            return
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(label, total=total)
        self._last = 0

    def update(self, done: int, total: int) -> None:
        if self.progress is not None and (done - self._last >= max(1, total // 100) or done == total):
            self._last = done
            self.progress.update(self.task, completed=done, total=total)


def _old_workload_flag(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """``-w``, sim's old short flag for --workload (hidden; -w is --watch elsewhere)."""
    if value is not None:
        deprecated("sim -w", "--workload (-w means --watch in tangram)")
        ctx.meta["sim_workload"] = value


@click.command("sim")
@click.option(
    "--workload",
    default="coding",
    show_default=True,
    help="coding, deepsearch, mopd, mopd+search, or a workload .yaml file.",
)
@click.option("-w", "old_workload", hidden=True, expose_value=False, callback=_old_workload_flag)
@click.option(
    "--batch", "-b", type=click.IntRange(min=1), default=None, help="Trajectories per step [default: 256]."
)
@click.option(
    "--policy",
    "-p",
    "policies",
    multiple=True,
    help="tangram[:DEPTH], k8s[:CORES], static, serverless, fixed-dop:K, api-retry, no-prewake, staged, min, max; join with '+'. "
    "Repeatable [default: tangram and the workload's paper baseline].",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=1, show_default=True, help="RL steps to simulate."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--cluster",
    "cluster_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML file overriding cluster fields (see docs/simulator.md).",
)
@click.option(
    "--cpu-nodes",
    type=click.IntRange(min=1),
    default=None,
    help="CPU nodes in the pool (256 cores each by default; paper: 15). Applied after --cluster.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="GPUs in the pool, packed into 8-GPU nodes (paper: 40). Applied after --cluster.",
)
@click.option(
    "--experiment",
    "-e",
    type=click.Choice(["fig6", "fig7", "fig8-cpu", "fig8-gpu", "fig9", "table1", "jobs", "pool"]),
    default=None,
    help="Regenerate one of the paper's results instead (jobs: fair shares of many RL jobs; pool: "
    "sandbox opens with and without a warm sandbox pool).",
)
@output_option("table", "json", json_alias=True, help="table; json: one JSON document instead of tables.")
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG plot (needs matplotlib)."
)
@click.option(
    "--journal",
    "journal_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write each policy's journal to DIR/<workload>-<policy>.jsonl.",
)
def command(
    workload: str,
    batch: int | None,
    policies: tuple[str, ...],
    steps: int,
    seed: int,
    cluster_file: str | None,
    cpu_nodes: int | None,
    gpus: int | None,
    experiment: str | None,
    output: str,
    plot: str | None,
    journal_dir: str | None,
) -> None:
    """Simulate workloads under several policies in virtual time, with the real core."""
    as_json = output == "json"
    workload = click.get_current_context().meta.get("sim_workload", workload)
    spec = load_cluster(cluster_file) if cluster_file else None
    if cpu_nodes is not None or gpus is not None:
        spec = spec or ClusterSpec()
        if cpu_nodes is not None:
            spec = replace(spec, cpu_nodes=cpu_nodes)
        if gpus is not None:
            spec = spec.with_gpus(gpus)
    if plot:
        _plt()  # fail before a long run if matplotlib is missing
    if experiment:
        _experiment(experiment, seed, spec, batch, as_json, plot)
        return
    _runs(workload, batch or 256, policies, steps, seed, spec, as_json, plot, journal_dir)


def _open_journal(journal_dir: str, workload: str, name: str, batch: int, seed: int) -> Any:
    Path(journal_dir).mkdir(parents=True, exist_ok=True)
    safe = name.replace(":", "_").replace("+", "_")
    return Journal.to_path(
        Path(journal_dir) / f"{workload.replace('+', '_')}-{safe}.jsonl",
        source="sim",
        workload=workload,
        policy=name,
        batch=batch,
        seed=seed,
    )


def _runs(
    workload: str,
    batch: int,
    policies: tuple[str, ...],
    steps: int,
    seed: int,
    spec: Any,
    as_json: bool,
    plot: str | None,
    journal_dir: str | None,
) -> None:
    wl = workloads.load(workload)
    names = list(dict.fromkeys(policies or ("tangram", BASELINE.get(wl.name, "k8s"))))
    parsed = [parse_policy(p) for p in names]  # all errors before any run
    doc: dict[str, dict[str, Any]] = {}
    with _Bar(quiet=verbosity()[1] > 0) as bar:
        for i, (name, pol) in enumerate(zip(names, parsed, strict=True), 1):
            bar.start(f"[{i}/{len(names)}] {wl.name} x{batch} {name}", batch * steps)
            journal = _open_journal(journal_dir, wl.name, name, batch, seed) if journal_dir else None
            try:
                r = Engine(
                    wl,
                    pol,
                    spec=spec,
                    batch=batch,
                    seed=seed,
                    steps=steps,
                    journal=journal,
                    progress=bar.update,
                ).run()
            finally:
                if journal is not None:
                    journal.close()
            doc[name] = summarize(r)
    if plot:
        plot_runs(doc, plot, f"{wl.name}, batch {batch}, seed {seed} (simulated)")
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    Console().print(_table(doc, f"{wl.name}: batch {batch}, {steps} step(s), seed {seed} (simulated)"))
    if any("jobs" in d for d in doc.values()):
        Console().print(_jobs_table(doc, f"{wl.name}: per RL job"))


def _experiment(name: str, seed: int, spec: Any, batch: int | None, as_json: bool, plot: str | None) -> None:
    quiet = verbosity()[1] > 0
    nodes = spec.cpu_nodes if spec is not None else 15
    progress = RunProgress(planned_runs(name, nodes), lambda line: quiet or click.echo(line, err=True))
    doc = experiments.run_experiment(name, seed, spec, progress.note, batch)  # looked up per call (tests)
    if plot:
        plot_experiment(doc, plot)
    if as_json:
        doc["vs_paper"] = [r.as_dict() for r in compare(doc)]
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))
    console.print(_runs_table(doc, f"{name} (simulated, seed {seed})"))
    if name == "jobs":
        runs = {f"{r['workload']}: {r['policy']}": r for r in doc["rows"]}
        console.print(_jobs_table(runs, "jobs: per RL job"))
    if name == "pool":  # no paper figure to compare with
        console.print(_pool_table(doc))
        return
    console.print(_paper_table(doc))


def _pool_table(doc: dict[str, Any]) -> Any:
    """Open + first exec against later execs, per step, per pool configuration (pool_experiment.py)."""
    t = Table(title="pool: submit -> start of a trajectory's first exec (its open) and of its later execs")
    for key, label in POOL_COLUMNS:
        t.add_column(label, justify="left" if key == "policy" else "right")
    for r in doc["rows"]:
        t.add_row(*[_fmt(r.get(k)) if r.get(k) is not None else "-" for k, _ in POOL_COLUMNS])
    return t


def _runs_table(doc: dict[str, Any], title: str) -> Any:
    t = Table(title=title)
    for col in _EXPERIMENT_COLUMNS:
        t.add_column(col, justify="left" if col in ("workload", "policy") else "right", overflow="fold")
    for r in doc["rows"] + doc.get("gpu_sweep", []) + doc.get("cpu_sweep", []):
        t.add_row(*[_fmt(r.get(c, "")) for c in _EXPERIMENT_COLUMNS])
    return t


_JOB_COLUMNS = (("actions", "actions"), ("p50_wait_s", "p50 wait (s)"), ("p99_wait_s", "p99 wait (s)"),
                ("core_s", "core-s"), ("saturated_core_s", "core-s while all wait"), ("gpu_s", "GPU-s"))


def _jobs_table(runs: dict[str, dict[str, Any]], title: str) -> Any:
    """One row per (run, job): queue waits and resource-seconds (metrics.job_summary)."""
    t = Table(title=title)
    t.add_column("run")
    t.add_column("job")
    for _, label in _JOB_COLUMNS:
        t.add_column(label, justify="right")
    for run, d in runs.items():
        for job, row in d.get("jobs", {}).items():
            t.add_row(run, job, *[_fmt(row[k]) for k, _ in _JOB_COLUMNS])
    return t


def _paper_table(doc: dict[str, Any]) -> Any:
    """Ours next to the paper's, with the ratio and a flag beyond the tolerance."""
    t = Table(
        title=f"{doc['experiment']}: ours vs issue 14's targets (OFF: outside the target)"
        if doc["experiment"] == "jobs"
        else f"{doc['experiment']}: ours vs the paper (OFF: ours / paper outside ±{TOLERANCE:.0%}; "
        "reasons in docs/simulator.md §4)"
    )
    t.add_column("result", overflow="fold")
    for col in ("ours", "paper", "ours / paper", "check"):
        t.add_column(col, justify="right", overflow="fold")
    t.add_column("why (docs/simulator.md)", overflow="fold")
    for r in compare(doc):
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        check = f"[bold red]{r.check}[/]" if r.check == "OFF" else r.check
        t.add_row(r.result, fmt_value(r.ours), fmt_value(r.paper), ratio, check, r.note)
    return t
