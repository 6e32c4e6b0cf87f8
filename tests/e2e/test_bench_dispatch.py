"""`tangram bench dispatch` runs end to end and prints figures (never asserted beyond sanity)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tangram_cli.bench_dispatch import dispatch


def test_bench_dispatch_json_process_executor() -> None:
    result = CliRunner().invoke(dispatch, ["-n", "5", "--clients", "2", "--executor", "process", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["dispatch"]
    assert "error" not in row, row
    assert row["executor"] == "process" and row["overhead_p50_ms"] > 0 and row["throughput_actions_per_s"] > 0
