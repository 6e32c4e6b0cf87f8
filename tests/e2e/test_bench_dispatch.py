"""`tangram bench dispatch` runs end to end and prints figures (shape only; timings are never asserted)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from tangram_cli.bench.dispatch import dispatch
from tangram_cli.bench.raw_spawn import raw_posix_spawn


@pytest.mark.parametrize("layout", ["separate", "inprocess"])
def test_bench_dispatch_json_process_executor(layout: str) -> None:
    args = ["-n", "5", "--clients", "2", "--executor", "process", "--layout", layout, "--json"]
    result = CliRunner().invoke(dispatch, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["dispatch"]
    assert "error" not in row, row
    assert row["executor"] == "process"
    assert row["overhead_p50_ms"] > 0
    assert row["throughput_actions_per_s"] > 0
    assert row["layout"] == layout
    assert row["throughput_concurrency"] == 2
    assert row["raw_spawn_actions_per_s"] > 0
    # the baseline runs before the daemons start and again once they are gone; the ratio is to their mean
    before, after = row["raw_spawn_before_actions_per_s"], row["raw_spawn_after_actions_per_s"]
    assert before > 0 and after > 0
    assert row["raw_spawn_actions_per_s"] == pytest.approx((before + after) / 2)
    ratio = row["throughput_actions_per_s"] / row["raw_spawn_actions_per_s"]
    assert row["ratio_to_raw_spawn"] == pytest.approx(ratio)
    assert "taskset" in row["raw_spawn_cmd"] or row["raw_spawn_cmd"] == "true"
    assert ("controller_cpu_ms_per_action" in row) == (layout == "separate")
    # the core hold: the agent's run plus the controller's part, and the throughput it caps
    assert row["hold_p50_ms"] >= row["hold_run_p50_ms"] > 0
    assert row["hold_bound_actions_per_s"] > 0
    # the whole machine's busy share over the run, and the CPU of the agent's spawners and of the
    # actions they reaped, read while the clients' sandboxes (and so their spawners) still stand
    share = row["machine_busy_share"]  # None when the run took less than a clock tick (/proc/stat)
    assert share is None or 0 <= share <= 1
    assert row["spawners_cpu_ms_per_action"] >= 0
    assert row["actions_cpu_ms_per_action"] >= 0
    # Tangram's own CPU per action (all its processes) and its ratio to the no-op's: separate only
    if layout == "separate" and row["actions_cpu_ms_per_action"] > 0:
        parts = ("controller", "agent", "spawners", "bench_process")
        total = sum(row[f"{n}_cpu_ms_per_action"] for n in parts)
        assert row["tangram_cpu_ms_per_action"] == pytest.approx(total)
        assert row["tangram_cpu_per_action_cpu"] == pytest.approx(total / row["actions_cpu_ms_per_action"])
    else:
        assert "tangram_cpu_per_action_cpu" not in row


@pytest.mark.parametrize("layout", ["separate", "inprocess"])
def test_bench_dispatch_curve(layout: str) -> None:
    """`--curve`: the same run with CURVE on every socket (keys in the run's directory)."""
    args = ["-n", "5", "--clients", "2", "--executor", "process", "--layout", layout, "--curve", "--json"]
    result = CliRunner().invoke(dispatch, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["dispatch"]
    assert "error" not in row, row
    assert row["security"] == "curve"
    assert row["throughput_actions_per_s"] > 0


def test_children_cpu_counts_what_a_child_reaped() -> None:
    """`children_cpu_s`: a live child's own CPU and that of the grandchildren it reaped."""
    import subprocess
    import sys

    from tangram_cli.bench.procs import children_cpu_s, cpu_delta

    burn = "import time; t = time.process_time() + 0.3\nwhile time.process_time() < t: pass"
    script = (
        f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {burn!r}]); "
        "print('ok', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ok\n"
        kids = children_cpu_s(os.getpid())
        own, reaped = kids[child.pid]
        assert reaped >= 0.25  # the grandchild's 0.3 s of CPU, reaped by the child
        assert own > 0
        # compared by pid: a child that is gone at the second reading counts nothing (never less than 0)
        assert cpu_delta({**kids, 999_999_999: (5.0, 5.0)}, kids) == (0.0, 0.0)
        assert cpu_delta({}, kids)[1] >= 0.25  # one born in between: all of it
    finally:
        child.kill()
        child.communicate()


def test_raw_posix_spawn_reaps_every_child() -> None:
    out = raw_posix_spawn(6, 3, "0")
    assert out["actions_per_s"] > 0
    assert out["p50_ms"] > 0


def test_machine_busy_share_counts_a_busy_core() -> None:
    """`machine_cpu_s`: 0.3 s of CPU burnt here shows as busy machine time, never more than the total;
    the share of a run shorter than a clock tick is None, not 0."""
    import time

    from tangram_cli.bench.dispatch import _share
    from tangram_cli.bench.procs import machine_cpu_s

    busy0, total0 = machine_cpu_s()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy1, total1 = machine_cpu_s()
    assert busy1 - busy0 >= 0.2
    assert total1 - total0 >= busy1 - busy0
    assert _share(0.0, 0.0) is None and _share(1.0, 4.0) == 0.25
