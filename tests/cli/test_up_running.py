"""`tangram up` on a cluster that already runs (issue 12): it says so, and flags that ask for other
settings are an error naming each one, not silently ignored; `--replace` applies them.

The real local default (controller and agent processes, process executor, TANGRAM_HOME in a
temporary directory), driven through `tangram` subprocesses; plus `differences` on its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import tangram

from tangram_cli import state as st
from tangram_cli.commands.up import differences

UP = ("up", "--executor", "process", "--gpus", "1", "--gpu-mem", "1GiB")


def test_differences_name_only_the_flags_given_that_differ() -> None:
    state = st.ClusterState(name="local", executor="process", gpus="2 emulated x 16GiB", certs="/c")
    assert differences(state, {}) == []
    same = {"executor": "process", "gpus": 2, "gpu_mem": "16GiB", "curve": True}
    assert differences(state, same) == []
    assert differences(state, {"executor": "auto"}) == []  # auto takes whatever runs
    assert differences(state, {"executor": "docker", "gpus": 4, "gpu_mem": "80GiB", "curve": False}) == [
        "--executor docker (running: process)",
        "--gpus 4 (running: 2 emulated x 16GiB)",
        "--gpu-mem 80GiB (running: 2 emulated x 16GiB)",
        "--insecure (running: CURVE)",
    ]
    nvml = st.ClusterState(name="local", executor="docker", gpus="1 (NVML)", certs="")
    assert differences(nvml, {"gpus": 0, "curve": False}) == []
    assert differences(nvml, {"curve": True}) == ["--curve (running: --insecure, plain TCP)"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_again_says_running_and_refuses_other_flags(tmp_path: Path) -> None:
    home = tmp_path / "home"
    state_file = home / "clusters" / "local" / "state.json"
    first = tangram(*UP, home=home)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "starting the local cluster" in first.stderr
    pid = json.loads(state_file.read_text())["controller_pid"]
    try:
        again = tangram("up", home=home)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "starting the local cluster" not in again.stderr
        assert "already running since" in again.stderr
        assert "with executor process, gpus 1 emulated x 1GiB, CURVE" in again.stderr
        assert "is already running since" in again.stdout

        same = tangram(*UP, home=home)  # the flags it runs with: fine
        assert same.returncode == 0, same.stderr

        other = tangram("up", "--executor", "process", "--gpus", "2", "--insecure", home=home)
        assert other.returncode == 1, other.stdout + other.stderr
        assert "already running since" in other.stderr
        assert "--gpus 2 (running: 1 emulated x 1GiB)" in other.stderr
        assert "--insecure (running: CURVE)" in other.stderr
        assert "--executor" not in other.stderr.split("differ from it:", 1)[1].split("\n", 1)[0]
        assert (
            "To fix: `tangram down` then `tangram up --executor process --gpus 2 --insecure`" in other.stderr
        )
        assert "`tangram up --replace --executor process --gpus 2 --insecure`" in other.stderr
        assert "Traceback" not in other.stderr
        assert json.loads(state_file.read_text())["controller_pid"] == pid  # nothing changed

        replaced = tangram(
            "up", "--replace", "--executor", "process", "--gpus", "2", "--gpu-mem", "1GiB", home=home
        )
        assert replaced.returncode == 0, replaced.stdout + replaced.stderr
        assert "stopping cluster local first" in replaced.stderr
        assert "starting the local cluster" in replaced.stderr
        now = json.loads(state_file.read_text())
        assert now["controller_pid"] != pid
        assert now["gpus"] == "2 emulated x 1GiB"
    finally:
        down = tangram("down", "-o", "json", home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert json.loads(down.stdout)["controller_was_running"] is True
