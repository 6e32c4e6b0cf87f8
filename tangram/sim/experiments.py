"""The paper's experiments (docs/simulator.md §3) as runs of the simulator. Each returns a JSON-ready dict:
``{"experiment", "rows": [...], "paper": {...}, "ours": {...}}`` where ``rows`` has one
entry per (configuration, policy) with the metrics of ``metrics.summarize``.

``TANGRAM_SIM_PREWAKE=0`` in the environment runs every ``tangram`` policy of the experiments
without GPU pre-wake (``+no-prewake``): the figures from before pre-wake existed."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tangram.errors import ConfigError
from tangram.sim import fairness, pool_experiment, workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterSpec
from tangram.sim.engine import simulate
from tangram.sim.metrics import summarize

EXPERIMENTS = ("fig6", "fig7", "fig8-cpu", "fig8-gpu", "fig9", "table1", "jobs", "pool")
# The paper's baseline per workload (docs/simulator.md §6.1).
BASELINE = {
    "coding": "k8s",
    "deepsearch": "api-retry+static",
    "mopd": "static",
    "mopd+search": "api-retry+static",
}
FIG6_BATCH = {
    "coding": 2048,
    "deepsearch": 512,
    "mopd": 2048,
    "mopd+search": 1024,
}  # assumption: loaded cluster

Progress = Callable[[str], None]
CPU_PATH_S = 0.0037  # per CPU action: cgroup write + nsenter + write back (docs/simulator.md §6.2)


def run_one(
    workload: str,
    policy: str,
    batch: int,
    seed: int,
    spec: ClusterSpec | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    r = simulate(
        workloads.load(workload),
        parse_policy(_prewake(policy)),
        spec=spec,
        batch=batch,
        seed=seed,
        progress=on_progress,
    )
    return summarize(r)


def _prewake(policy: str) -> str:
    """``policy`` as the experiments run it (``TANGRAM_SIM_PREWAKE=0``: Tangram without pre-wake)."""
    parts = policy.split("+")
    if os.environ.get("TANGRAM_SIM_PREWAKE", "1") == "0" and parts[0].split(":")[0] == "tangram":
        return policy if "no-prewake" in parts else policy + "+no-prewake"
    return policy


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def fig6(seed: int, spec: ClusterSpec | None, note: Progress, batch: int | None = None) -> dict[str, Any]:
    rows, ours = [], {}
    for w, base in BASELINE.items():
        b = batch or FIG6_BATCH[w]
        pair = {}
        for p in ("tangram", base):
            note(f"fig6 {w} batch {b} {p}")
            pair[p] = run_one(w, p, b, seed, spec)
            rows.append(pair[p])
        t, k = pair["tangram"], pair[base]
        ours[w] = {
            "baseline": base,
            "batch": b,
            "total_act_x": _ratio(k["total_act_s"], t["total_act_s"]),
            "env_act_x": _ratio(k["env_act_s"], t["env_act_s"]),
            "reward_act_x": _ratio(k["reward_act_s"], t["reward_act_s"]),
            "mean_act_x": _ratio(k["mean_act_s"], t["mean_act_s"]),
            "step_x": _ratio(k["step_time_s"], t["step_time_s"]),
            "baseline_failed_calls": k["failed"],
        }
    paper = {
        "coding": {"total_act_x": 4.3, "env_act_x": 9.0, "reward_act_x": 2.8, "step_x": 1.4},
        "deepsearch": {"step_x": 1.5},
        "mopd": {"step_x": "smaller (long-tail bound)"},
    }
    return {"experiment": "fig6", "rows": rows, "paper": paper, "ours": ours}


def fig7(seed: int, spec: ClusterSpec | None, note: Progress, batch: int | None = None) -> dict[str, Any]:
    doc = fig6(seed, spec, note, batch)
    doc["experiment"] = "fig7"
    doc["breakdown"] = [
        {
            "workload": r["workload"],
            "policy": r["policy"],
            "env_act_s": r["env_act_s"],
            "reward_act_s": r["reward_act_s"],
            "step_time_s": r["step_time_s"],
        }
        for r in doc["rows"]
    ]
    return doc


def fig8_cpu(
    seed: int,
    spec: ClusterSpec | None,
    note: Progress,
    batches: tuple[int, ...] = (256, 512, 1024, 2048, 4096),
) -> dict[str, Any]:
    rows, ours = [], {}
    for b in batches:
        pair = {}
        for p in ("tangram", "k8s"):
            note(f"fig8-cpu coding batch {b} {p}")
            pair[p] = run_one("coding", p, b, seed, spec)
            rows.append(pair[p])
        ours[str(b)] = _ratio(pair["k8s"]["mean_act_s"], pair["tangram"]["mean_act_s"])
    return {
        "experiment": "fig8-cpu",
        "rows": rows,
        "paper": {"mean_act_x": "3.1 -> 27.7 as the batch grows"},
        "ours": {"mean_act_x_by_batch": ours},
    }


def fig8_gpu(
    seed: int,
    spec: ClusterSpec | None,
    note: Progress,
    batches: tuple[int, ...] = (256, 512, 1024, 2048),
    gpus: tuple[int, ...] = tuple(range(4, 41, 2)),
) -> dict[str, Any]:
    """Tangram vs static and serverless per batch, then Tangram at the largest batch on a
    sweep of GPU counts (every 2 GPUs from 4 to 40) for the fewest GPUs that match static's
    mean ACT. ``gpus_for_equal_act``: the smallest swept count from which every larger one
    matches (robust to a lucky dip); ``gpus_for_equal_act_interp``: linear interpolation of
    the mean ACT between it and the swept count below. Shares are given of the whole pool
    and of static's GPUs (the paper's 29% is of the baseline's GPUs)."""
    base = spec or ClusterSpec()
    rows, ours = [], {}
    for b in batches:
        res = {}
        for p in ("tangram", "static", "serverless"):
            note(f"fig8-gpu mopd batch {b} {p}")
            res[p] = run_one("mopd", p, b, seed, base)
            rows.append(res[p])
        ours[str(b)] = {
            "vs_static_x": _ratio(res["static"]["mean_act_s"], res["tangram"]["mean_act_s"]),
            "vs_serverless_x": _ratio(res["serverless"]["mean_act_s"], res["tangram"]["mean_act_s"]),
        }
    top = batches[-1]
    static_row = next(r for r in rows if r["batch"] == top and r["policy"] == "static")
    target = static_row["mean_act_s"]
    static_gpus = round(static_row["gpu_held_s"] / static_row["rollout_s"]) if static_row["rollout_s"] else 0
    sweep = []
    for g in sorted(gpus):
        note(f"fig8-gpu mopd batch {top} tangram on {g} GPUs")
        r = run_one("mopd", "tangram", top, seed, base.with_gpus(g))
        r["gpus"] = g
        sweep.append(r)
    equal, interp = _equal_act(sweep, target)
    return {
        "experiment": "fig8-gpu",
        "rows": rows,
        "gpu_sweep": sweep,
        "paper": {"vs_static_x_at_2048": 18.1, "gpu_share_for_equal_act": 0.29},
        "ours": {
            "by_batch": ours,
            "static_mean_act_s": target,
            "static_gpus": static_gpus,
            "gpus_for_equal_act": equal,
            "gpu_share_for_equal_act": (equal / base.total_gpus) if equal else None,
            "gpu_share_of_static_for_equal_act": (equal / static_gpus) if equal and static_gpus else None,
            "gpus_for_equal_act_interp": interp,
            "gpu_share_for_equal_act_interp": (interp / base.total_gpus) if interp else None,
            "gpu_share_of_static_for_equal_act_interp": (
                (interp / static_gpus) if interp and static_gpus else None
            ),
            "gpu_sweep_gpus": [r["gpus"] for r in sweep],
            "gpu_sweep_mean_act_s": [r["mean_act_s"] for r in sweep],
        },
    }


def _equal_act(sweep: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """The fewest swept GPUs from which every larger count matches ``target`` mean ACT, and the
    count interpolated linearly between it and the swept count below."""
    equal, interp = None, None
    for i in reversed(range(len(sweep))):
        if sweep[i]["mean_act_s"] > target:
            break
        equal = sweep[i]["gpus"]
        interp = float(equal)
        if i > 0:
            lo, hi = sweep[i - 1], sweep[i]
            span = lo["mean_act_s"] - hi["mean_act_s"]
            frac = (lo["mean_act_s"] - target) / span if span > 0 else 1.0
            interp = lo["gpus"] + frac * (hi["gpus"] - lo["gpus"])
    return equal, interp


def fig9(
    seed: int,
    spec: ClusterSpec | None,
    note: Progress,
    batches: tuple[int, ...] = (256, 512, 1024, 1280, 2048),
    cpu_nodes: tuple[int, ...] = (15, 8, 4, 2),
    at_batch: int = 1280,
) -> dict[str, Any]:
    """Elastic DoP (tangram) vs fixed DoP 16 on coding: across batch sizes on the cluster,
    and at batch ``at_batch`` across CPU pool sizes (the contention the paper credits)."""
    base = spec or ClusterSpec()
    rows, ours, pairs = [], {}, {}
    for b in batches:
        pair = pairs[b] = {}
        for p in ("tangram", "fixed-dop:16"):
            note(f"fig9 coding batch {b} {p}")
            pair[p] = run_one("coding", p, b, seed, base)
            rows.append(pair[p])
        ours[str(b)] = _fig9_ratios(pair)
    sweep, by_nodes = [], {}
    for n in cpu_nodes:
        pair = {}
        for p in ("tangram", "fixed-dop:16"):
            if n == base.cpu_nodes and at_batch in pairs:  # already run on the base pool
                r = dict(pairs[at_batch][p])
            else:
                note(f"fig9 coding batch {at_batch} {p} on {n} CPU nodes")
                r = run_one("coding", p, at_batch, seed, replace(base, cpu_nodes=n))
            r["cpu_nodes"] = n
            pair[p] = r
            sweep.append(r)
        by_nodes[str(n)] = _fig9_ratios(pair)
    return {
        "experiment": "fig9",
        "rows": rows,
        "cpu_sweep": sweep,
        "paper": {"vs_fixed16_x_at_1280": 3.0},
        "ours": {**ours, f"batch_{at_batch}_by_cpu_nodes": by_nodes},
    }


def _fig9_ratios(pair: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    t, f = pair["tangram"], pair["fixed-dop:16"]
    return {
        "reward_act_x": _ratio(f["reward_act_s"], t["reward_act_s"]),
        "mean_act_x": _ratio(f["mean_act_s"], t["mean_act_s"]),
        "total_act_x": _ratio(f["total_act_s"], t["total_act_s"]),
        "step_x": _ratio(f["step_time_s"], t["step_time_s"]),
    }


def table1(
    seed: int, spec: ClusterSpec | None, note: Progress, batches: tuple[int, ...] = (256, 1024, 2048)
) -> dict[str, Any]:
    """Scheduler decision time (measured here, CPython) and the modelled per-action control
    overhead: 3.7 ms per CPU action on the direct path (docs/simulator.md §6.2) and GPU restores."""
    rows, ours = [], {}
    for w in ("coding", "mopd"):
        for b in batches:
            note(f"table1 {w} batch {b} tangram")
            r = run_one(w, "tangram", b, seed, spec)
            run_s = r["gpu_busy_s"]
            n = r["actions"]
            decide = r["decide_mean_us"] * 1e-6 * r["events"]
            if w == "coding":
                mean_run = r["cpu_mean_run_s"]
                share = (CPU_PATH_S + decide / n) / mean_run if mean_run else None
            else:
                share = r["restore_share"] + decide / run_s if run_s else None
            r["overhead_share"] = share
            rows.append(r)
            ours[f"{w}@{b}"] = {
                "decide_mean_us": r["decide_mean_us"],
                "decide_p99_us": r["decide_p99_us"],
                "overhead_share": share,
            }
    return {
        "experiment": "table1",
        "rows": rows,
        "paper": {"cpu_overhead": "< 3%", "gpu_overhead": "~25% (mostly restore), flat in concurrency"},
        "ours": ours,
    }


def run_experiment(
    name: str, seed: int, spec: ClusterSpec | None, note: Progress, batch: int | None = None
) -> dict[str, Any]:
    if name == "fig6":
        return fig6(seed, spec, note, batch)
    if name == "fig7":
        return fig7(seed, spec, note, batch)
    if name == "fig8-cpu":
        return fig8_cpu(seed, spec, note)
    if name == "fig8-gpu":
        return fig8_gpu(seed, spec, note)
    if name == "fig9":
        return fig9(seed, spec, note)
    if name == "table1":
        return table1(seed, spec, note)
    if name == "jobs":  # not the paper's: many RL jobs with fair shares (issue 14, part 3)
        return fairness.experiment(seed, spec, note, batch)
    if name == "pool":  # not the paper's: warm sandbox pools (issue 14, part 1)
        return pool_experiment.experiment(seed, spec, note, batch)
    raise ConfigError(f"unknown experiment {name!r}", hint=f"use one of {', '.join(EXPERIMENTS)}")
