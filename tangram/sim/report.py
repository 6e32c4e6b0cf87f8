"""Our figures next to the paper's, for `tangram sim --experiment X`.

``compare(doc)`` turns an experiment's JSON document (tangram.sim.experiments) into rows of
(result, ours, paper, ours / paper, check, note). A numeric paper figure is met when
ours / paper lies within ``TOLERANCE`` (±25%); a bound ("< 3%") is met when ours is inside it;
a qualitative claim is shown, not judged. Rows that miss carry a pointer to the section of
docs/simulator.md §4 that explains the difference (``REASONS``).

``RunProgress`` prints ``[i/N] label (ETA ...)`` lines for experiments made of many runs.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tangram.sim import experiments as ex
from tangram.sim.experiments import FIG6_BATCH

TOLERANCE = 0.25  # |ours / paper - 1| above this is flagged
OK, OFF, INFO = "ok", "OFF", "-"

# why ours differs, per (experiment group, key): a short reason and the docs section
REASONS = {
    "coding.env_act_x": "§4.2: exec API queue sets the magnitude",
    "coding.reward_act_x": "§4.2: 4 -> 32 cores is <= 2.2x (Amdahl)",
    "coding.total_act_x": "§4.2: knife edge at the exec client's QPS",
    "coding.step_x": "§4.2: k8s step tail from the exec queue",
    "deepsearch.step_x": "§4.3: both bound by the same API capacity",
    "deepsearch.baseline_failed_calls": "§4.3: baseline returns failed calls, Tangram none",
    "fig8-cpu": "§4.2: grows with batch, magnitude lower",
    "fig8-gpu.vs_static_x": "§4.4: per-teacher load less skewed than the paper's",
    "fig8-gpu.serverless": "§4.4: our serverless serves (limits not modelled)",
    "fig8-gpu.gpu_share": "§4.4: less saving at our load skew",
    "fig9": "§4.1: gain 1.3x only under contention",
    "table1.gpu": "§4.4: restores cheaper than the paper's",
}
_CPU_RATIO_NAMES = {
    "total_act_x": "total ACT",
    "env_act_x": "env-interaction ACT",
    "reward_act_x": "reward ACT",
    "step_x": "step time",
    "mean_act_x": "mean ACT",
}


@dataclass
class Row:
    """One line of the comparison: ``ours``/``paper`` are numbers or text."""

    result: str
    ours: Any
    paper: Any
    ratio: float | None = None
    check: str = INFO
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "ours": self.ours,
            "paper": self.paper,
            "ours_over_paper": self.ratio,
            "check": self.check,
            "note": self.note,
        }


def judge(ours: float | None, paper: Any, reason: str = "", tolerance: float = TOLERANCE) -> Row:
    """A row's ratio and check for a numeric paper figure (text: shown, not judged)."""
    row = Row("", ours, paper)
    if ours is None:
        row.check, row.note = OFF, reason or "no figure"
        return row
    if not isinstance(paper, (int, float)) or isinstance(paper, bool) or paper == 0:
        return row
    row.ratio = ours / paper
    if abs(row.ratio - 1.0) > tolerance:
        row.check, row.note = OFF, reason
    else:
        row.check = OK
    return row


def _row(result: str, ours: Any, paper: Any, reason: str = "") -> Row:
    row = judge(ours, paper, reason)
    row.result = result
    return row


def _upper_bound(result: str, ours: float | None, bound: float, reason: str = "") -> Row:
    """Met when ours < bound (the paper gives only a bound)."""
    row = Row(result, ours, f"< {bound:g}")
    if ours is None or ours >= bound:
        row.check, row.note = OFF, reason or "no figure"
    else:
        row.check = OK
    return row


def _fig6(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for w, ours in doc["ours"].items():
        paper = doc["paper"].get(w, {})
        vs = f"vs {ours['baseline']}, batch {ours['batch']}"
        other = "" if ours["batch"] == FIG6_BATCH.get(w) else f"batch {ours['batch']}, not the paper's; "
        for key, label in _CPU_RATIO_NAMES.items():
            if key in paper:
                reason = other + REASONS.get(f"{w}.{key}", "")
                rows.append(_row(f"{w} {label} x ({vs})", ours.get(key), paper[key], reason))
        failed = ours.get("baseline_failed_calls") or 0
        if failed:
            rows.append(
                Row(
                    f"{w} baseline failed actions",
                    failed,
                    "not reported",
                    check=OFF,
                    note=REASONS.get(f"{w}.baseline_failed_calls", "see docs/simulator.md §4"),
                )
            )
    return rows


def _fig8_cpu(doc: dict[str, Any]) -> list[Row]:
    by = doc["ours"]["mean_act_x_by_batch"]
    ends = {min(by, key=int): 3.1, max(by, key=int): 27.7}  # paper: "3.1 -> 27.7"
    return [
        _row(f"coding mean ACT x vs k8s, batch {b}", x, ends.get(b, "grows"), REASONS["fig8-cpu"])
        for b, x in by.items()
    ]


def _fig8_gpu(doc: dict[str, Any]) -> list[Row]:
    ours, rows = doc["ours"], []
    top = max(ours["by_batch"], key=int)
    for b, r in ours["by_batch"].items():
        paper = doc["paper"]["vs_static_x_at_2048"] if b == "2048" else "-"
        rows.append(
            _row(
                f"mopd mean ACT x vs static, batch {b}",
                r["vs_static_x"],
                paper,
                REASONS["fig8-gpu.vs_static_x"],
            )
        )
    sl = ours["by_batch"][top]["vs_serverless_x"]
    rows.append(
        Row(
            f"serverless at batch {top} (x slower)",
            sl,
            "cannot serve",
            check=OFF,
            note=REASONS["fig8-gpu.serverless"],
        )
    )
    share = ours.get("gpu_share_of_static_for_equal_act")
    paper_share = doc["paper"]["gpu_share_for_equal_act"]
    rows.append(
        _row("GPU share for static's ACT (of static's)", share, paper_share, REASONS["fig8-gpu.gpu_share"])
    )
    return rows


def _fig9(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for key, val in doc["ours"].items():
        if key.startswith("batch_"):
            for n, r in val.items():
                rows.append(
                    Row(f"mean ACT x vs fixed-16, {key.replace('_', ' ')} = {n}", r["mean_act_x"], "-")
                )
            continue
        paper = doc["paper"]["vs_fixed16_x_at_1280"] if key == "1280" else "-"
        rows.append(_row(f"mean ACT x vs fixed-16, batch {key}", val["mean_act_x"], paper, REASONS["fig9"]))
    return rows


def _table1(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for key, r in doc["ours"].items():
        share = r.get("overhead_share")
        if key.startswith("coding"):
            rows.append(_upper_bound(f"CPU overhead share, {key}", share, 0.03))
        else:
            rows.append(_row(f"GPU overhead share, {key}", share, 0.25, REASONS["table1.gpu"]))
    return rows


def _jobs(doc: dict[str, Any]) -> list[Row]:
    """Issue 14's targets for many RL jobs (not the paper's): the core-seconds ratio within
    10% of the weights', the small job's p99 wait beside a burst within 2x of its own."""
    ours = doc["ours"]
    light, heavy = sorted(ours["weights"], key=lambda j: ours["weights"][j])
    want = ours["weights"][heavy] / ours["weights"][light]
    row = judge(ours["saturated_core_s_ratio"], want, "the shares missed the weights", tolerance=0.10)
    row.result = f"core-s {heavy}:{light} while both wait (weights {want:g}:1, target within 10%)"
    small = ours["small_job"]
    x = ours["small_p99_wait_x_solo"]
    burst = Row(f"{small} job p99 wait beside the burst / alone", x, "<= 2")
    burst.check, burst.note = (OK, "") if x is not None and x <= 2 else (OFF, "queued behind the burst")
    fcfs = Row(f"{small} job p99 wait beside the burst / alone, no jobs (FCFS)",
               ours["small_p99_wait_x_solo_fcfs"], "-", note="the scheduler before jobs, for comparison")
    return [row, burst, fcfs]


_COMPARERS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "fig6": _fig6,
    "fig7": _fig6,
    "fig8-cpu": _fig8_cpu,
    "fig8-gpu": _fig8_gpu,
    "fig9": _fig9,
    "table1": _table1,
    "jobs": _jobs,
}


def compare(doc: dict[str, Any]) -> list[Row]:
    """The experiment's figures next to the paper's (empty for an unknown experiment)."""
    fn = _COMPARERS.get(doc.get("experiment", ""))
    return fn(doc) if fn else []


def fmt_value(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def planned_runs(name: str, cpu_nodes: int = 15) -> int:
    """How many simulations ``run_experiment(name)`` makes with its default arguments."""
    def default(fn: Callable[..., Any], arg: str) -> Any:
        return inspect.signature(fn).parameters[arg].default

    if name in ("fig6", "fig7"):
        return 2 * len(ex.BASELINE)
    if name == "fig8-cpu":
        return 2 * len(default(ex.fig8_cpu, "batches"))
    if name == "fig8-gpu":
        return 3 * len(default(ex.fig8_gpu, "batches")) + len(default(ex.fig8_gpu, "gpus"))
    if name == "fig9":
        batches, at = default(ex.fig9, "batches"), default(ex.fig9, "at_batch")
        nodes = default(ex.fig9, "cpu_nodes")
        return 2 * len(batches) + 2 * sum(1 for n in nodes if not (n == cpu_nodes and at in batches))
    if name == "table1":
        return 2 * len(default(ex.table1, "batches"))
    if name == "jobs":
        return 4  # saturation; the burst's small job alone, with fair shares, without jobs
    if name == "pool":
        return len(ex.pool_experiment.CONFIGS)
    return 0


def _duration(s: float) -> str:
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class RunProgress:
    """``[i/N] label (ETA ...)`` per run: ETA from the mean duration of the runs done so far."""

    total: int
    write: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    done: int = 0
    _t0: float | None = field(default=None, repr=False)

    def note(self, label: str) -> None:
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        i = self.done + 1
        self.total = max(self.total, i)
        if self.done:
            per_run = (now - self._t0) / self.done
            eta = f"ETA {_duration(per_run * (self.total - self.done))}"
        else:
            eta = "ETA after the first run"
        self.write(f"[{i}/{self.total}] {label} ({eta})")
        self.done = i
