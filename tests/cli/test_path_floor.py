"""`scripts/path_floor.py` (docs/performance.md, twelfth round): both variants run every no-op through
real processes and sockets, and the figures come back whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "path_floor.py"


def test_path_floor_runs_both_variants() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "-n", "60", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    rows = {row["variant"]: row for row in json.loads(out)}
    assert set(rows) == {"spawners", "direct"}
    for row in rows.values():
        assert row["n"] == 60 and row["round"] == 1
        assert row["actions_per_s"] > 0
        mean = (row["raw_before_actions_per_s"] + row["raw_after_actions_per_s"]) / 2
        assert abs(row["ratio_to_raw_spawn"] - row["actions_per_s"] / mean) < 1e-9
        parts = [row[f"{k}_cpu_ms_per_action"] for k in ("controller", "agent", "spawners", "clients")]
        assert all(v >= 0 for v in parts)
        assert abs(row["floor_cpu_ms_per_action"] - sum(parts)) < 1e-9
    # without spawners the agent starts the actions itself: nobody else to count
    assert rows["direct"]["spawners_cpu_ms_per_action"] == 0


def test_path_floor_prints_a_line_per_variant() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "-n", "30", "--variant", "direct"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    (line,) = out.strip().splitlines()
    assert line.startswith("round 1   direct:") and "x raw (before" in line, out
