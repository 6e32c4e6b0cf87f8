"""`tangram bench scheduler` prints figures for each queue length (values are not asserted)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from tangram_cli.main import cli


def test_bench_scheduler_json_has_latency_figures_per_queue_length() -> None:
    res = CliRunner().invoke(cli, ["bench", "scheduler", "-n", "30", "--queued", "16", "--queued", "64", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    rows = doc["scheduler"]
    assert [r["queued"] for r in rows] == [16, 64]
    for r in rows:
        assert r["calls"] >= 30
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert 0 < r["cpu_p50_ms"] <= r["cpu_p99_ms"]
        assert r["ratio_to_queued"] == 16
        assert r["p99_ratio"] == r["p99_ms"] / rows[0]["p99_ms"]
    assert rows[0]["p99_ratio"] == 1.0 == rows[0]["cpu_p99_ratio"]


def test_bench_scheduler_json_defaults_to_long_queues_and_the_table_to_short_ones(monkeypatch) -> None:
    import tangram_cli.bench.scheduler as bench

    asked: list[int] = []

    def fake(queued: int, steps: int, seed: int = 0, depth: int = 2) -> dict[str, float]:
        asked.append(queued)
        return {"queued": queued, "calls": 1, "p50_ms": 1.0, "p99_ms": queued / 64, "max_ms": 1.0,
                "mean_ms": 1.0, "cpu_p50_ms": 1.0, "cpu_p99_ms": 1.0, "running": 0}

    monkeypatch.setattr(bench, "measure", fake)
    res = CliRunner().invoke(cli, ["bench", "scheduler", "--json"])
    assert res.exit_code == 0, res.output
    assert asked == [128, 1024, 10_000, 100_000]
    ratios = [r["p99_ratio"] for r in json.loads(res.output)["scheduler"]]
    assert ratios == [1.0, 8.0, 10_000 / 128, 100_000 / 128]
    asked.clear()
    res = CliRunner().invoke(cli, ["bench", "scheduler"])
    assert res.exit_code == 0, res.output
    assert asked == [128, 1024] and "ratio" in res.output
