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
