"""`tangram up` after the local controller died (issue 14): the restart in place brings the controller
back with the settings it was started with (its state record and ``controller.json``), so flags that ask
for others (`--executor`, `--gpus`, `--gpu-mem`, `--insecure`, `--sandbox-pool`, `--job`) are refused
(exit 1) naming each difference and the fix, never silently ignored; the same flags, or none, restart it.

First the refusal alone: a recorded cluster whose controller pid is gone, through the real CLI
(`CliRunner`; nothing starts, nothing is rewritten). Then a real local cluster (controller and agent
processes, process executor, TANGRAM_HOME in a temporary directory) whose controller is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.cli import run_up, tangram

from tangram_cli import state as st
from tangram_cli.bootstrap.local_flags import LocalExtras, PoolFlag, parse_job_flags
from tangram_cli.controller.config import ControllerConfig

UP = ("up", "--executor", "process", "--gpus", "1", "--gpu-mem", "1GiB")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def recorded_cluster(home: Path) -> st.ClusterState:
    """A local cluster as `up` records it (state.json, controller.json) whose controller died: Docker,
    2 emulated GPUs, CURVE, pools up to 2 within half the node's memory, job train=3."""
    st.ensure_dirs("local")
    extras = LocalExtras(PoolFlag(2, 0.5), parse_job_flags(["train=3"]))
    config = extras.apply(ControllerConfig(cluster="local"))
    st.controller_config_path("local").write_text(json.dumps(config.to_dict()))
    state = st.ClusterState(
        name="local",
        controller_pid=dead_pid(),
        bind="127.0.0.1",
        advertise="127.0.0.1",
        ports={"agents": 47001, "submit": 47002, "status": 47003},
        started_at=time.time() - 60,
        inventory="<local default>",
        executor="docker",
        gpus="2 emulated x 16GiB",
        certs=str(home / "certs"),
    )
    st.write(state)
    return state


@pytest.mark.parametrize(
    ("args", "diffs", "again"),
    [
        (
            ("--gpus", "4", "--sandbox-pool", "3", "--job", "train=2"),
            "--gpus 4 (recorded: 2 emulated x 16GiB); --sandbox-pool 3 (recorded: 2,mem=50%); "
            "--job train=2 (recorded: --job train=3)",
            "--gpus 4 --sandbox-pool 3 --job train=2",
        ),
        (("--sandbox-pool", "2"), "--sandbox-pool 2 (recorded: 2,mem=50%)", "--sandbox-pool 2"),
        (("--executor", "process"), "--executor process (recorded: docker)", "--executor process"),
        (("--insecure",), "--insecure (recorded: CURVE)", "--insecure"),
        (("--job", "eval=1"), "--job eval=1 (recorded: --job train=3)", "--job eval=1"),
    ],
)
def test_a_dead_controller_with_other_flags_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], diffs: str, again: str
) -> None:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path))
    state = recorded_cluster(tmp_path)
    before = st.state_path("local").read_text()
    r = run_up(tmp_path, monkeypatch, *args)
    assert r.exit_code == 1, r.output
    assert f"error: the controller of cluster local (pid {state.controller_pid}) " in r.stderr
    assert (
        "`tangram up` restarts it in place with the settings it was started with (executor docker, gpus "
        "2 emulated x 16GiB, CURVE, sandbox pools up to 2 (mem 50%), jobs train=3), and these flags "
        f"differ from them: {diffs}\n"
    ) in r.stderr
    assert f"To fix: `tangram down` then `tangram up {again}`, or `tangram up --replace {again}`" in r.stderr
    assert "or drop the flags to restart it as it was" in r.stderr
    assert "Traceback" not in r.output
    assert st.state_path("local").read_text() == before  # nothing restarted, nothing rewritten


# ---------------------------------------------------------------- a real local cluster


def kill_controller(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while st.pid_alive(pid, ("controller",)):
        assert time.monotonic() < deadline, f"controller pid {pid} still runs"
        time.sleep(0.05)


def read_state(home: Path) -> dict[str, Any]:
    return json.loads((home / "clusters" / "local" / "state.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_controller_restarts_with_the_same_flags_and_refuses_others(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = tangram(*UP, "--job", "train=3", home=home)
    assert first.returncode == 0, first.stdout + first.stderr
    try:
        old = read_state(home)
        kill_controller(old["controller_pid"])

        other = tangram("up", "--gpus", "2", "--job", "train=2", home=home)
        assert other.returncode == 1, other.stdout + other.stderr
        assert f"the controller of cluster local (pid {old['controller_pid']}) is gone" in other.stderr
        assert (
            "these flags differ from them: --gpus 2 (recorded: 1 emulated x 1GiB); --job train=2 "
            "(recorded: --job train=3)"
        ) in other.stderr
        assert "To fix: `tangram down` then `tangram up --gpus 2 --job train=2`" in other.stderr
        assert "Traceback" not in other.stderr
        assert read_state(home) == old  # refused: not restarted
        assert not st.pid_alive(old["controller_pid"], ("controller",))

        same = tangram(*UP, "--job", "train=3", home=home)  # the flags it was started with: restarted
        assert same.returncode == 0, same.stdout + same.stderr
        assert "is up again" in same.stdout
        new = read_state(home)
        assert new["controller_pid"] != old["controller_pid"] and new["ports"] == old["ports"]
        status = tangram("status", "-o", "json", home=home)
        assert status.returncode == 0, status.stdout + status.stderr
        jobs = {j["job"]: j for j in json.loads(status.stdout)["records"]["jobs"]}
        assert jobs["train"]["weight"] == 3.0

        kill_controller(new["controller_pid"])  # the fix the refusal names: --replace applies the flags
        fresh = tangram(*UP, "--replace", "--job", "train=2", home=home)
        assert fresh.returncode == 0, fresh.stdout + fresh.stderr
        assert "stopping cluster local first" in fresh.stderr
        assert read_state(home)["cluster_id"] != old["cluster_id"]  # a fresh cluster, not a restart
        status = tangram("status", "-o", "json", home=home)
        jobs = {j["job"]: j for j in json.loads(status.stdout)["records"]["jobs"]}
        assert jobs["train"]["weight"] == 2.0
    finally:
        down = tangram("down", home=home)
    assert down.returncode == 0, down.stdout + down.stderr
