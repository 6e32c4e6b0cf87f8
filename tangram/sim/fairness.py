"""The fair-share experiment of the simulator (issue 14, part 3); the per-job figures it reads
are ``metrics.job_summary``'s (``summarize(r)["jobs"]``).

``experiment()`` (``tangram sim --experiment jobs``) measures the two targets:

1. ``coding-jobs``: two coding jobs at weights 1:3 on one 64-core node, both with far more
   work than their share: the ratio of their core-seconds under saturation (target: 3,
   within 10%).
2. ``coding-burst``: a small coding job (weight 1) runs alone; a large one (weight 3, ten
   times its trajectories) starts 60 s later and saturates the node. The small job's p99
   queue wait in three runs: alone (solo), with the large job under fair shares, and with the
   large job and no jobs (one FCFS queue, the scheduler before jobs). Target: with fair
   shares at most 2x its solo value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tangram.sim import workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterSpec
from tangram.sim.engine import simulate
from tangram.sim.metrics import summarize

SATURATION = "coding-jobs"
BURST = "coding-burst"
BATCH = 256
Progress = Callable[[str], None]


def _run(
    w: workloads.Workload, label: str, batch: int, seed: int, spec: ClusterSpec | None, note: Progress
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    note(f"jobs {w.name} batch {batch} {label}")
    r = simulate(w, parse_policy("tangram"), spec=spec, batch=batch, seed=seed)
    row = summarize(r)
    row["policy"] = label
    return row, row["jobs"]


def experiment(
    seed: int, spec: ClusterSpec | None, note: Progress, batch: int | None = None
) -> dict[str, Any]:
    """Both targets (module docstring) as one JSON-ready document. The workloads set their
    own node (their ``cluster:``), over ``spec`` (``--cluster``) where both set a field."""
    b = batch or BATCH
    sat = workloads.load(SATURATION)
    sat_row, sat_jobs = _run(sat, "tangram, weights 1:3", b, seed, spec, note)
    (light, heavy) = sorted(sat_jobs, key=lambda j: next(x.weight for x in sat.jobs if x.name == j))
    ratio = sat_jobs[heavy]["saturated_core_s"] / max(sat_jobs[light]["saturated_core_s"], 1e-9)
    burst = workloads.load(BURST)
    small = burst.mix[0][0]
    n_small = round(b * burst.mix[0][1] / sum(s for _, s in burst.mix))
    solo_w = replace(burst, name=f"{BURST}-solo", mix=(burst.mix[0],))
    solo_row, solo = _run(solo_w, "tangram, small job alone", n_small, seed, spec, note)
    fair_row, fair = _run(burst, "tangram, weights 1:3", b, seed, spec, note)
    fcfs_row, fcfs = _run(workloads.without_jobs(burst), "tangram, no jobs (FCFS)", b, seed, spec, note)
    p99 = {k: d[small.job]["p99_wait_s"] for k, d in (("solo", solo), ("fair", fair), ("fcfs", fcfs))}
    return {
        "experiment": "jobs",
        "rows": [sat_row, solo_row, fair_row, fcfs_row],
        "paper": {"saturated_core_s_ratio": 3.0, "small_p99_wait_x_solo": "<= 2"},
        "ours": {
            "weights": {j: x.weight for j in sat_jobs for x in sat.jobs if x.name == j},
            "saturated_s": sat_jobs[heavy]["saturated_s"],
            "saturated_core_s": {j: d["saturated_core_s"] for j, d in sat_jobs.items()},
            "saturated_core_s_ratio": ratio,
            "small_job": small.job,
            "small_trajectories": n_small,
            "small_p99_wait_s": p99,
            "small_p99_wait_x_solo": p99["fair"] / p99["solo"] if p99["solo"] > 0 else None,
            "small_p99_wait_x_solo_fcfs": p99["fcfs"] / p99["solo"] if p99["solo"] > 0 else None,
        },
    }
