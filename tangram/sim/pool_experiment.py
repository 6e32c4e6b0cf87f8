"""`tangram sim --experiment pool`: a burst of sandbox opens with and without a warm sandbox pool
(docs/scheduler.md, "Warm sandbox pools"; the pool model is pool.py).

The coding workload cut to its tool turns (3 per trajectory, no test run: the cores never run out, so
no wait below is a wait for cores), for two RL steps, three ways: no pool; a pool sized from the
opens it has seen (it grows from the first opens on); a pool preset to one node's share of the batch.
Per step it reports the wait from submit to start of each trajectory's first exec (placement, its
sandbox's container, the exec path) next to that of its later execs (the exec path alone), and the
ratio of their p50s.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from tangram.sim import workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterSpec
from tangram.sim.engine import SimResult, simulate
from tangram.sim.metrics import _pct, summarize

CONFIGS = (  # (name, pool_min, pool_max); min None: one node's share of the batch
    ("no pool", 0, 0),
    ("pool sized from opens", 0, 512),
    ("pool preset to the batch", None, 512),
)
# the table `tangram sim --experiment pool` prints: (key, header)
COLUMNS = (
    ("policy", "config"), ("pool_claims", "opens from pool"), ("pool_colds", "cold opens"),
    ("step1_first_p50_s", "step 1: first exec wait p50 (s)"), ("step1_first_p99_s", "p99 (s)"),
    ("step1_later_p50_s", "later exec p50 (s)"), ("step1_ratio", "ratio"),
    ("step2_first_p50_s", "step 2: first exec wait p50 (s)"), ("step2_first_p99_s", "p99 (s)"),
    ("step2_later_p50_s", "later exec p50 (s)"), ("step2_ratio", "ratio"),
)


def first_exec_waits(r: SimResult) -> dict[str, Any]:
    """Per step: p50/p99 of submit -> start of each trajectory's first action and p50 of its later
    execs, and the ratio of the two p50s."""
    step_of = {t.plan.tid: t.step for t in r.trajs}
    out: dict[str, Any] = {}
    for step in sorted(set(step_of.values())):
        first, later = [], []
        for x in r.records:
            tid, _, idx = x.aid.rpartition("/")
            if x.kind == "exec" and step_of.get(tid) == step and x.start >= 0:
                (first if idx.split(".")[0] == "0" else later).append(x.start - x.submit)
        p50, l50 = _pct(first, 0.5), _pct(later, 0.5)
        out[f"step{step + 1}_first_p50_s"] = p50
        out[f"step{step + 1}_first_p99_s"] = _pct(first, 0.99)
        out[f"step{step + 1}_later_p50_s"] = l50
        out[f"step{step + 1}_ratio"] = p50 / l50 if l50 > 0 else None
    return out


def experiment(seed: int, spec: ClusterSpec | None, note: Any, batch: int | None = None,
               steps: int = 2) -> dict[str, Any]:
    base = replace(spec or ClusterSpec(), pool_mem_fraction=0.5)  # a node's share of 2048 x 8 GiB fits
    b = batch or 2048
    wl = replace(workloads.load("coding"), turns=workloads.Dist("const", 3.0), reward=None)
    rows = []
    for name, lo, hi in CONFIGS:
        lo = -(-b // base.cpu_nodes) if lo is None else lo
        note(f"pool: {name} (min {lo}, max {hi}), batch {b}, {steps} steps")
        r = simulate(wl, parse_policy("tangram"), spec=replace(base, pool_min=lo, pool_max=hi), batch=b,
                     seed=seed, steps=steps)
        row = {**summarize(r), "policy": name, "pool_min": lo, "pool_max": hi, **first_exec_waits(r)}
        row.update({k: r.counters.get(k, 0) for k in ("pool_claims", "pool_colds")})
        if not hi:  # no pool: every open made its container
            row["pool_colds"] = sum(1 for t in r.trajs if t.plan.sandboxed)
        rows.append(row)
    return {"experiment": "pool", "rows": rows, "paper": {}, "ours": {}}
