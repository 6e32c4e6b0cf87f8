"""`tangram bench floor` (docs/performance.md, twelfth round): both variants run every no-op through real
processes and sockets, and the figures come back whole; `bench dispatch --floor` puts it in its own run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tangram_cli.bench.dispatch import dispatch
from tangram_cli.bench.floor import floor


def test_floor_runs_both_variants() -> None:
    result = CliRunner().invoke(floor, ["-n", "60", "--clients", "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["met"] == {}
    rows = {row["variant"]: row for row in out["floor"]}
    assert set(rows) == {"spawners", "direct"}
    for row in rows.values():
        assert row["n"] == 60 and row["round"] == 1
        assert row["actions_per_s"] > 0 and row["latency_p50_ms"] > 0
        mean = (row["raw_before_actions_per_s"] + row["raw_after_actions_per_s"]) / 2
        assert row["ratio_to_raw_spawn"] == pytest.approx(row["actions_per_s"] / mean)
        parts = [row[f"{k}_cpu_ms_per_action"] for k in ("controller", "agent", "spawners", "clients")]
        assert all(v >= 0 for v in parts)
        assert row["floor_cpu_ms_per_action"] == pytest.approx(sum(parts))
    # without spawners the agent starts the actions itself: nobody else to count
    assert rows["direct"]["spawners_cpu_ms_per_action"] == 0


def test_floor_prints_a_line_per_variant_and_round() -> None:
    result = CliRunner().invoke(floor, ["-n", "30", "--variant", "direct", "--rounds", "2", "--clients", "2"])
    assert result.exit_code == 0, result.output
    *lines, last = result.output.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["round 1   direct", "round 2   direct"], result.output
    assert last.startswith("goals: none")
    assert all("x raw (before" in line for line in lines)


def test_floor_refuses_cores_it_may_not_use() -> None:
    result = CliRunner().invoke(floor, ["-n", "10", "--cpus", "4096"])
    assert result.exit_code == 2 and "--cpus" in result.output and "4096" in result.output, result.output
    result = CliRunner().invoke(floor, ["-n", "10", "--cpus", "zero"])
    assert result.exit_code == 2 and "not a list of cores" in result.output, result.output


def test_dispatch_with_floor_prints_the_ratio_to_it() -> None:
    args = ["-n", "20", "--clients", "2", "--executor", "process", "--floor", "--json"]
    result = CliRunner().invoke(dispatch, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["dispatch"]
    assert "error" not in row and "floor_error" not in row, row
    assert row["floor_actions_per_s"] > 0 and row["floor_latency_p50_ms"] > 0
    assert row["floor_cpu_ms_per_action"] >= 0
    ratio = row["throughput_actions_per_s"] / row["floor_actions_per_s"]
    assert row["ratio_to_floor"] == pytest.approx(ratio)
