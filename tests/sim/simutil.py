"""Helpers for the simulator tests: small clusters, hand-made workloads, a checking core."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core"))

from sched_util import Ledger

from tangram.sim.cluster import ClusterSpec
from tangram.sim.workloads import Workload, from_dict

SMALL = ClusterSpec(
    cpu_nodes=2,
    cores_per_node=32,
    numa_per_node=2,
    cpu_mem_gib=256,
    gpu_nodes=(8, 4),
    static_gpus=(("judge", 2), ("teacher", 1)),
)  # 9 teachers + the judge on 11 of 12 GPUs


def tiny(**over: Any) -> Workload:
    doc: dict[str, Any] = {
        "name": "tiny",
        "turns": 1,
        "think_s": 1.0,
        "noise_sigma": 0.0,
        "sandbox_mem_gib": 1,
        "pod_cores": 1,
        "tools": [{"name": "tool", "kind": "exec", "t_ori_s": 2.0, "cores": [1, 1]}],
        "reward": {
            "name": "tests",
            "kind": "exec",
            "t_ori_s": 8.0,
            "cores": [1, 4],
            "serial_fraction": 0.0,
            "profiled": True,
        },
    }
    doc.update(over)
    return from_dict(doc)


class Checked:
    """Wraps a core; every command list goes through a ``Ledger`` (no over-commitment)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.inner = getattr(core, "inner", core)
        self.ledger = Ledger(self.inner)
        self.counters = self.inner.counters
        self.log: list[tuple[float, Any, list[Any]]] = []

    @property
    def config(self) -> Any:
        return self.core.config

    def handle(self, event: Any, now: float, decide: bool = True) -> list[Any]:
        out = self.core.handle(event, now, decide)
        self.ledger.apply(out)
        self.log.append((now, event, out))
        return out

    def next_deadline(self) -> float | None:
        return self.core.next_deadline()
