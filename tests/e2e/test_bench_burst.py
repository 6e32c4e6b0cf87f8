"""`tangram bench burst` end to end at tiny sizes: JSON shape and counts, never timings."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from tangram_cli.bench.burst import burst


@pytest.mark.parametrize("instant", [False, True], ids=["process-agent", "instant-agent"])
def test_bench_burst_every_exec_answered_once(instant: bool) -> None:
    args = ["--clients", "2", "--actions", "200", "--sandboxes", "2", "--timeout", "60", "--json"]
    result = CliRunner().invoke(burst, args + (["--instant"] if instant else []))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)["burst"]
    assert "error" not in doc, doc
    assert doc["completed"] == 200
    assert doc["failed"] == {}
    assert doc["nonzero_exit"] == 0
    assert doc["client_errors"] == []
    # every request (2 x (2 opens + 2 warm-ups + 100 execs)) got exactly one final reply
    assert doc["answered_once_ok"] is True
    wire = doc["wire"]
    assert wire["requests"] == wire["answered_once"] >= 2 * (2 + 2 + 100)
    assert wire["unanswered"] == 0
    assert wire["answered_twice_or_more"] == 0
    ctl = doc["controller"]
    assert ctl["agents_up"] == 1
    assert ctl["agents_not_up"] == []
    assert ctl["status"]["samples"] >= 1
    assert ctl["rss_peak_mib"] > 0
    assert {"joined", "replayed"} <= set(ctl["counters"])
    assert doc["resent_fraction"] is not None
    assert doc["actions_per_s"] > 0
    assert doc["clients_cpu_s"] > 0  # the clients' own CPU over the burst
    assert doc["controller_cpu_ms_per_action"] > 0
    assert doc["clients_cpu_ms_per_action"] == pytest.approx(doc["clients_cpu_s"] * 1e3 / 200, abs=1e-3)
    assert doc["agent_cores"] == (256 if instant else len(os.sched_getaffinity(0)))
    if instant:
        assert doc["bench_agent"]["spawns"] == doc["bench_agent"]["results"] >= 200
