"""`tangram bench scale` end to end at tiny sizes: JSON shape and counts, never timings."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tangram_cli.bench.agents import model_seconds
from tangram_cli.bench.scale import plans, scale


def test_model_seconds_is_the_simulators_amdahl_duration() -> None:
    from tangram.core.actions import Elasticity, duration

    for dop in (1, 2, 7, 32):
        assert model_seconds("tests 150.0 0.13", dop) == pytest.approx(
            duration(150.0, Elasticity.amdahl(0.13), dop)
        )
    assert model_seconds("shell 2.5 1", 4) == pytest.approx(2.5)


def test_plans_split_the_simulators_trace_between_client_processes() -> None:
    from tangram.sim.workloads import generate, load

    whole = generate(load("coding"), 6, 0)
    parts = [plans(6, 0, k, 2, None) for k in range(2)]
    assert sorted(p.tid for part in parts for p in part) == sorted(p.tid for p in whole)
    capped = plans(6, 0, 0, 1, 2)
    assert all(len(p.actions) == 3 and p.actions[-1].category == "reward" for p in capped)


def test_bench_scale_every_action_completes() -> None:
    args = [
        "--agents",
        "4",
        "--cores",
        "8",
        "--batch",
        "4",
        "--time-scale",
        "500",
        "--max-turns",
        "4",
        "--client-procs",
        "2",
        "--agent-procs",
        "2",
        "--timeout",
        "60",
        "--json",
    ]
    result = CliRunner().invoke(scale, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)["scale"]
    assert "error" not in doc, doc
    assert doc["total_cores"] == 32
    assert doc["planned_actions"] == 4 * 5
    assert doc["completed"] == doc["planned_actions"]
    assert doc["all_completed"] is True
    assert doc["failed"] == {}
    assert doc["unfinished_trajectories"] == 0
    assert doc["answered_once_ok"] is True
    ctl = doc["controller"]
    assert ctl["agents_up"] == 4
    assert ctl["events_in_run"] > 0
    assert ctl["decisions_per_s"] is not None
    assert doc["bench_agent"]["spawns"] == doc["bench_agent"]["results"] == doc["completed"]
    assert doc["bench_agent"]["welcomes"] == 4
    assert doc["bench_agent"]["rehellos"] == 0
    assert doc["dispatch_to_result_p50_ms"] is not None
