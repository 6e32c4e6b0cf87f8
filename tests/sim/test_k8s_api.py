"""The k8s baseline's API-server path: pod creates and every action's exec request share
one FIFO request queue (cluster.py ``_api_request``), so exec latency grows with the number
of concurrent trajectories and is ~0 for one."""

from __future__ import annotations

from dataclasses import replace

import pytest
from simutil import tiny

from tangram.core import commands as cmd
from tangram.sim import workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterModel, ClusterSpec, Truth
from tangram.sim.engine import simulate
from tangram.sim.metrics import summarize

WIDE = ClusterSpec(
    cpu_nodes=2,
    cores_per_node=256,
    numa_per_node=2,
    cpu_mem_gib=1024,
    gpu_nodes=(),
)  # room for 512 one-core pods: trajectories never queue for a pod, only for the API


def _chatty(**over):
    # 20 turns of 0.5 s generation + a 2 s tool: one exec request per ~2.5 s per pod
    return tiny(turns=20, think_s=0.5, **over)


def _wait(batch: int, policy: str = "k8s:1", spec: ClusterSpec = WIDE) -> dict:
    return summarize(simulate(_chatty(), parse_policy(policy), spec=spec, batch=batch, seed=3))


def test_defaults_are_the_published_ones():
    s = ClusterSpec()
    assert s.pod_exec_api_qps == 50.0  # docs/simulator.md §6.2: default --kube-api-qps=50
    assert s.pod_api_per_s == 70.0  # docs/simulator.md §6.2: pod scheduling tops out near 70 pods/s
    assert s.pod_exec_overhead_s == 0.068  # docs/simulator.md §6.2: exec_run ~68 ms


def test_one_trajectory_never_waits_for_the_api():
    r = summarize(simulate(workloads.load("coding"), parse_policy("k8s"), spec=WIDE, batch=1, seed=1))
    assert r["actions"] > 20
    assert r["exec_api_wait_s"] == 0.0
    assert r["exec_api_wait_p99_s"] == 0.0


def test_exec_wait_rises_with_concurrent_pods():
    waits = [_wait(b)["exec_api_wait_s"] for b in (4, 64, 256)]
    assert waits[0] < 0.01  # 4 pods: ~1.6 requests/s against 50/s
    assert waits[0] < waits[1] < waits[2]
    # 256 pods offer ~100 requests/s to a 50/s queue: it saturates, and the closed loop
    # settles where throughput is 50/s, i.e. a wait of seconds per exec
    assert waits[2] > 1.0


def test_saturated_queue_caps_exec_throughput_at_the_qps():
    spec = replace(WIDE, pod_exec_api_qps=50.0)
    r = simulate(_chatty(), parse_policy("k8s:1"), spec=spec, batch=256, seed=3)
    starts = sorted(run.start - spec.pod_exec_overhead_s for run in r.runs.values())
    n = len(starts)
    # no two exec turns closer than 1/50 s, so n execs span at least (n - 1) / 50 s
    assert starts[-1] - starts[0] >= (n - 1) / 50.0 - 1e-6


def test_no_client_limit_means_no_exec_queue():
    s = _wait(256, spec=replace(WIDE, pod_exec_api_qps=0.0))
    assert s["exec_api_wait_s"] == 0.0


def test_tangram_does_not_use_the_api_server():
    s = _wait(256, policy="tangram")
    assert s["exec_api_wait_s"] == 0.0


def test_pod_creates_and_execs_share_one_fifo_queue():
    spec = replace(WIDE, pod_api_per_s=10.0, pod_exec_api_qps=20.0, pod_ready_s=1.0, pod_exec_overhead_s=0.0)
    m = ClusterModel(spec, lambda aid: Truth(1.0, None))
    m.apply([cmd.Reserve("open-a", "cpu-00", "a", (0,)), cmd.Reserve("open-b", "cpu-00", "b", (1,))], 0.0)
    assert m.ready == {"a": pytest.approx(1.0), "b": pytest.approx(1.1)}  # 1/10 s per create
    m.apply([cmd.Spawn("x", "cpu-00", "a", (0,), 1)], 0.0)  # queued behind both creates
    assert m.runs["x"].api_wait == pytest.approx(0.2)
    assert m.runs["x"].start == pytest.approx(1.0)  # its turn came at 0.2, the pod is Ready at 1.0
    m.apply([cmd.Spawn("y", "cpu-00", "b", (1,), 1)], 2.0)  # the queue is idle again
    assert m.runs["y"].api_wait == 0.0
    m.apply([cmd.Reserve("open-c", "cpu-00", "c", (2,))], 2.0)  # a create waits behind y's exec
    assert m.ready["c"] == pytest.approx(2.0 + 1 / 20 + 1.0)
