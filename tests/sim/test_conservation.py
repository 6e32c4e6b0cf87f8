"""No resource is ever over-committed, under any policy (a Ledger checks every command)."""

from __future__ import annotations

import pytest
from simutil import SMALL, Checked

from tangram.core import commands as cmd
from tangram.sim import workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.engine import Engine

POLICIES = [
    "tangram",
    "tangram:3",
    "k8s",
    "static",
    "serverless",
    "fixed-dop:4",
    "api-retry",
    "min",
    "max",
    "api-retry+static",
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("workload", "batch"), [("coding", 24), ("mopd+search", 48)])
def test_no_overcommit(policy, workload, batch):
    e = Engine(workloads.load(workload), parse_policy(policy), spec=SMALL, batch=batch, seed=3)
    e.core = Checked(e.core)
    r = e.run()
    assert len(r.records) > batch
    assert all(x.end >= x.submit for x in r.records)
    ledger = e.core.ledger
    assert not ledger.cores
    assert not ledger.chunks
    assert not ledger.leases
    # every direct API provider stayed within its limit
    for p in e.providers.values():
        assert p.in_flight == 0
        assert p.mode != "quota" or p.used <= p.limit


def test_gpu_memory_and_one_action_per_gpu_under_pressure():
    spec = SMALL.with_gpus(4)
    e = Engine(workloads.load("mopd"), parse_policy("tangram"), spec=spec, batch=64, seed=5)
    e.core = Checked(e.core)
    e.run()
    loads = sum(1 for _, _, out in e.core.log for c in out if isinstance(c, cmd.Load))
    assert loads > 9  # 9 teachers on 4 GPUs: restores and evictions happen
