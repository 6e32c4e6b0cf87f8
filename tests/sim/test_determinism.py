"""The same seed writes a byte-identical journal in two processes with different hash seeds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from tangram.journal import Journal
from tangram.sim import workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.engine import Engine
from tangram.sim.cluster import ClusterSpec
spec = ClusterSpec(cpu_nodes=2, cores_per_node=32, numa_per_node=2, cpu_mem_gib=256, gpu_nodes=(8, 4))
j = Journal.to_path(sys.argv[1], source="sim", seed=7)
w, p = workloads.load(sys.argv[2]), parse_policy(sys.argv[3])
r = Engine(w, p, spec=spec, batch=12, seed=7, journal=j).run()
j.close()
import json
from tangram.sim.metrics import summarize
s = summarize(r)
for k in ("wall_s", "events_per_s", "decide_mean_us", "decide_p99_us"):
    s.pop(k)
print(json.dumps(s, sort_keys=True))
"""


@pytest.mark.parametrize(
    ("workload", "policy"),
    [
        ("coding", "tangram"),
        ("mopd+search", "tangram"),
        ("mopd+search", "api-retry+static"),
        ("coding", "k8s"),
    ],
)
def test_journal_is_identical_across_processes(tmp_path, workload, policy):
    paths, outs = [], []
    for hashseed in ("1", "12345"):
        p = tmp_path / f"{hashseed}.jsonl"
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        res = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(p), workload, policy],
            env=env,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        paths.append(p)
        outs.append(res.stdout)
    a, b = (p.read_bytes() for p in paths)
    assert len(a.splitlines()) > 40
    assert a == b
    assert outs[0] == outs[1]
    assert '"mean_act_s"' in outs[0]


def test_different_seeds_differ(tmp_path):
    from tangram.journal import Journal, diff, read
    from tangram.sim import workloads
    from tangram.sim.baselines import parse_policy
    from tangram.sim.engine import Engine

    texts = []
    for seed in (1, 2):
        j = Journal(source="sim")
        Engine(workloads.load("coding"), parse_policy("tangram"), batch=4, seed=seed, journal=j).run()
        texts.append(read(j.lines)[1])
    assert diff(*texts) is not None
