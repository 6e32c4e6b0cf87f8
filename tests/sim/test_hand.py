"""A scenario small enough to compute by hand (times in seconds).

One node of 4 cores; two trajectories, each: think 1, tool (2 s, 1 core), think 1,
reward (T_ori 8, 1..4 cores, perfectly parallel). Sandboxes take 0.5 s to create (1000/s).

tangram: tools submitted at 1.0 wait for their containers (ready 1.5 and 1.501) and end
at 3.5 / 3.501 (ACT 2.5 / 2.5); rewards at 4.5 (A gets all 4 cores: 8/4 = 2 s, ends 6.5)
and 4.501 (waits for A's cores, runs 6.5..8.5): ACTs 2.0 and 3.999. Step ends at 8.5.

k8s:1: pods requested at 0 (Ready 0.85 and 1/70 + 0.85), one core each. Both tools are
submitted at 1.0; each is an exec API request through the one API queue at 50/s: A's turn
at 1.0 (runs 1..3, ACT 2), B's at 1.02 (runs 1.02..3.02, ACT 2.02). Rewards at 4.0 and 4.02
find the queue idle and run on the pod's single core for 8 s (ACT 8). Step ends at 12.02.
"""

from __future__ import annotations

import pytest
from simutil import tiny

from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterSpec
from tangram.sim.engine import simulate
from tangram.sim.metrics import summarize

ONE = ClusterSpec(
    cpu_nodes=1,
    cores_per_node=4,
    numa_per_node=1,
    cpu_mem_gib=64,
    gpu_nodes=(),
    sandbox_create_s=0.5,
    sandbox_create_per_s=1000.0,
    pod_ready_s=0.85,
    pod_api_per_s=70.0,
    pod_exec_api_qps=50.0,
    exec_overhead_s=0.0,
    pod_exec_overhead_s=0.0,
)


def _acts(policy: str) -> tuple[dict[str, float], dict]:
    r = simulate(tiny(), parse_policy(policy), spec=ONE, batch=2, seed=0)
    return {x.aid: round(x.end - x.submit, 6) for x in r.records}, summarize(r)


def test_tangram_acts_by_hand():
    acts, s = _acts("tangram")
    assert acts == {"tiny-0/0": 2.5, "tiny-1/0": 2.501, "tiny-0/1": 2.0, "tiny-1/1": 3.999}
    assert s["rollout_s"] == pytest.approx(8.5)
    assert s["mean_act_s"] == pytest.approx((2.5 + 2.501 + 2.0 + 3.999) / 4)
    assert s["reward_act_s"] == pytest.approx((2.0 + 3.999) / 2)


def test_k8s_acts_by_hand():
    acts, s = _acts("k8s:1")
    assert acts == {"tiny-0/0": 2.0, "tiny-1/0": 2.02, "tiny-0/1": 8.0, "tiny-1/1": 8.0}
    assert s["rollout_s"] == pytest.approx(12.02)
    assert s["exec_api_wait_s"] == pytest.approx(0.02 / 4)  # only B's tool waited, 1/50 s
    # each pod holds 1 core from its reservation (t=0) to its trajectory's end (12 / 12.02)
    assert s["cpu_held_core_s"] == pytest.approx(24.02)
    assert s["cpu_busy_core_s"] == pytest.approx(20.0)


def test_fixed_dop_by_hand():
    # fixed-dop:2: each reward gets exactly 2 cores (8/2 = 4 s), both fit at once
    acts, _ = _acts("fixed-dop:2")
    assert acts["tiny-0/1"] == 4.0
    assert acts["tiny-1/1"] == 4.0


def test_exec_overheads_and_steps():
    from dataclasses import replace

    spec = replace(ONE, exec_overhead_s=0.01, pod_exec_overhead_s=0.1)
    r = simulate(tiny(train_s=5.0), parse_policy("k8s:1"), spec=spec, batch=2, seed=0, steps=2)
    acts = {x.aid: round(x.end - x.submit, 6) for x in r.records}
    assert acts["tiny-0/0"] == 2.1
    assert acts["tiny-1/0"] == 2.12  # + its 1/50 s turn in the API queue
    assert acts["tiny-0/1"] == 8.1
    (a0, b0), (a1, b1) = r.steps
    assert a0 == 0.0
    assert b0 == pytest.approx(12.22)
    assert a1 == pytest.approx(b0 + 5.0)
    assert b1 - a1 == pytest.approx(12.22)
    assert len(r.records) == 8
    t = simulate(tiny(), parse_policy("tangram"), spec=spec, batch=1, seed=0)
    assert {x.aid: round(x.end - x.submit, 6) for x in t.records} == {"tiny-0/0": 2.51, "tiny-0/1": 2.01}
