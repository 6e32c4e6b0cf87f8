"""Warm sandbox pools in the simulator (tangram/sim/pool.py, pool_experiment.py): a create is a claim when
its node's pool has one ready, refills use only the create pipeline's idle time, memory bounds the pools,
and the `pool` experiment shows a burst of opens served warm with the same core (virtual time only)."""

from __future__ import annotations

from dataclasses import replace

from tangram.core import commands as cmd
from tangram.sim import pool_experiment
from tangram.sim.cluster import ClusterModel, ClusterSpec, Truth
from tangram.sim.pool import SimPools

SPEC = ClusterSpec(cpu_nodes=2, cores_per_node=8, cpu_mem_gib=64, gpu_nodes=(), pool_min=2, pool_max=8,
                   pool_mem_fraction=0.5, sandbox_create_s=0.5, sandbox_create_per_s=4.0,
                   sandbox_claim_s=0.002)


def create(i: int, node: str = "cpu-00", mem: int = 1024) -> cmd.CreateSandbox:
    return cmd.CreateSandbox(node, f"sb{i}", mem, "")


def test_a_create_is_a_claim_while_the_pool_has_one_then_cold():
    pools = SimPools(SPEC)
    assert pools.create(create(0), 0.0, 0.0) == 0.002  # the pool starts with `pool_min` (2)
    assert pools.create(create(1), 0.0, 0.0) == 0.002
    assert pools.create(create(2), 0.0, 0.0) is None  # empty, and no idle pipeline time yet
    assert (pools.claims, pools.colds) == (2, 1)


def test_refills_use_only_the_pipelines_idle_time():
    pools = SimPools(SPEC)
    for i in range(3):
        pools.create(create(i), 0.0, 0.0)
    # the sizer now wants 3 (three opens in one window); the pipeline was busy until 1.0 (cold creates)
    assert pools.create(create(3), 1.1, 1.0) is None  # 0.1 s idle at 4/s: no whole refill yet
    assert pools.create(create(4), 2.0, 1.0) == 2.002  # 1.0 s idle since 1.0: refilled, claimed


def test_memory_no_sandbox_holds_bounds_the_first_pool():
    tight = replace(SPEC, pool_min=8, pool_mem_fraction=0.25)  # 16 GiB for pools: two of 8 GiB
    pools = SimPools(tight)
    assert [pools.create(create(i, mem=8192), 0.0, 0.0) for i in range(3)] == [0.002, 0.002, None]


def test_without_pools_the_model_is_unchanged():
    plain = ClusterModel(ClusterSpec(cpu_nodes=1, gpu_nodes=()), lambda aid: Truth(1.0, None))
    assert plain.pools is None and plain.pool_counters() == {}
    plain.apply([create(0)], 0.0)
    assert plain.ready["sb0"] == ClusterSpec().sandbox_create_s


def test_the_experiment_serves_a_burst_warm_with_the_same_core():
    spec = ClusterSpec(cpu_nodes=2, cores_per_node=64, cpu_mem_gib=512, gpu_nodes=())
    doc = pool_experiment.experiment(seed=1, spec=spec, note=lambda _line: None, batch=64)
    rows = {r["policy"]: r for r in doc["rows"]}
    cold, sized, preset = rows["no pool"], rows["pool sized from opens"], rows["pool preset to the batch"]
    assert cold["pool_claims"] == 0
    assert preset["pool_claims"] == 2 * 64 and preset["pool_colds"] == 0
    assert sized["pool_claims"] > 64  # the second step is served from what the first step sized
    for step in (1, 2):
        assert preset[f"step{step}_first_p50_s"] < cold[f"step{step}_first_p50_s"]
        assert preset[f"step{step}_ratio"] <= 2.0
    assert sized["step2_ratio"] <= 2.0 < cold["step2_ratio"]


def test_the_experiment_is_deterministic():
    spec = ClusterSpec(cpu_nodes=1, cores_per_node=32, cpu_mem_gib=256, gpu_nodes=())
    keys = [k for k, _ in pool_experiment.COLUMNS] + ["actions", "mean_act_s"]  # no wall-clock figures
    runs = [[{k: r.get(k) for k in keys} for r in pool_experiment.experiment(
        seed=5, spec=spec, note=lambda _line: None, batch=16)["rows"]] for _ in range(2)]
    assert runs[0] == runs[1]
