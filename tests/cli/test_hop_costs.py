"""`scripts/hop_costs.py` (docs/performance.md, eleventh round) runs and prints every measurement."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hop_costs.py"


def test_hop_costs_prints_each_hop() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "-n", "50"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    figures = {
        "pipe one core": r"pipe round trip, one core: +([\d.]+) us",
        "eventfd": r"eventfd write waking a thread: +([\d.]+) us",
        "zmq tcp": r"zmq round trip, tcp 127\.0\.0\.1 *: +([\d.]+) us wall, +([\d.]+) us",
        "zmq ipc": r"zmq round trip, ipc *: +([\d.]+) us wall, +([\d.]+) us",
    }
    if len(os.sched_getaffinity(0)) > 1:
        figures["pipe two cores"] = r"pipe round trip, two cores: +([\d.]+) us"
    for name, pattern in figures.items():
        m = re.search(pattern, out)
        assert m, f"{name} missing from:\n{out}"
        assert float(m.group(1)) > 0, f"{name}: {m.group(0)}"
