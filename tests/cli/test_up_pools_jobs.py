"""`tangram up --sandbox-pool N[,mem=SHARE]` and `--job NAME=WEIGHT[,RES=CAP...]` on the local default
(issue 14): the flags reach the controller's config (``mem=`` its ``sandbox_pool.mem_fraction``), `tangram
status` shows the jobs, the pool fills on Docker, bad values are a ConfigError (exit 2) naming the flag and
the fix, and a second `up` with other pools or jobs is refused, naming what runs.

The pure pieces (flag parsing, the config they make, the differences) run in-process; the flags' errors
through the real CLI (`CliRunner`, nothing starts); then real local clusters (controller and agent
processes, TANGRAM_HOME in a temporary directory): the process executor with jobs, and the Docker executor
with a pool (the process executor keeps no pools: there the flag is refused).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.cli import CLI, clean_env, run_up, tangram

import tangram as tg
from tangram.core.pool import PoolPolicy
from tangram.errors import ConfigError
from tangram_cli import state as st
from tangram_cli.bootstrap import local, local_flags
from tangram_cli.bootstrap.local_flags import (
    LocalExtras,
    PoolFlag,
    parse_job_flag,
    parse_job_flags,
    parse_pool_flag,
)
from tangram_cli.commands.up import differences
from tangram_cli.controller.config import ControllerConfig, parse_config
from tangram_cli.controller.jobs_config import JobConf
from tangram_cli.errors import BootstrapError

UP = ("up", "--executor", "process", "--gpus", "1", "--gpu-mem", "1GiB")


# ---------------------------------------------------------------- the flags on their own


def test_job_flags_parse_to_the_configs_jobs() -> None:
    jobs = parse_job_flags(["train=3", "eval=0.5,cores=8,gpus=1,api=4,api:search=2"])
    assert jobs == (
        JobConf("train", 3.0),
        JobConf("eval", 0.5, (("api", 4), ("api:search", 2), ("cpu", 8), ("gpu", 1))),
    )
    words = [local_flags.job_word(j) for j in jobs]
    assert words == ["train=3", "eval=0.5,api=4,api:search=2,cores=8,gpus=1"]
    assert parse_job_flags([local_flags.job_word(j) for j in jobs]) == jobs  # written as it is read


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("train", "no weight for job 'train'"),
        ("train=", "no weight"),
        ("train=abc", "weight 'abc' is not a number"),
        ("train=0", "must be a finite number > 0"),
        ("train=-2", "must be a finite number > 0"),
        ("train=nan", "must be a finite number > 0"),
        ("train=1,disk=3", "unknown resource 'disk'"),
        ("train=1,cores=-1", "cap 'cores=-1' is not RESOURCE=COUNT"),
        ("train=1,cores", "cap 'cores' is not RESOURCE=COUNT"),
        ("train=1,cores=2,cores=3", "cores is capped twice"),
        ("train=1,cores=2,cpus=3", "caps cpu a second time"),
        ("bad name=1", "bad job name 'bad name'"),
    ],
)
def test_a_bad_job_flag_names_the_flag_and_the_problem(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job_flag(text)
    assert err.value.message.startswith(f"--job {text}: ")
    assert words in err.value.message
    assert err.value.hint  # and the fix
    assert err.value.exit_code == 2


def test_a_job_given_twice_is_an_error_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"--job a given twice \(a=1 and a=2,cores=1\)"):
        parse_job_flags(["a=1", "b=1", "a=2,cores=1"])


def mem_of_this_node() -> int:
    """A node's memory for ``mem=SIZE`` (stands for /proc/meminfo, so the numbers below are exact)."""
    return 8192


@pytest.mark.parametrize(
    ("text", "pool"),
    [
        ("0", PoolFlag(0)),
        ("8", PoolFlag(8, 0.25)),
        ("8,mem=0.5", PoolFlag(8, 0.5)),
        ("8, mem=50%", PoolFlag(8, 0.5)),
        ("2,mem=100%", PoolFlag(2, 1.0)),
        ("8,mem=2GiB", PoolFlag(8, 0.25)),  # a size: its share of the node's memory
        ("8,mem=6GiB", PoolFlag(8, 0.75)),
        ("65536,mem=1", PoolFlag(65536, 1.0)),
    ],
)
def test_pool_flag_parses_to_the_pools_max_and_share_of_memory(text: str, pool: PoolFlag) -> None:
    got = parse_pool_flag(text, mem_of_this_node)
    assert got == pool
    assert got.word() == text  # messages repeat the flag as it was written
    config = LocalExtras(got).apply(ControllerConfig(cluster="local"))
    if pool.max:
        assert config.sandbox_pool == PoolPolicy(max=pool.max, mem_fraction=pool.mem_fraction)
        assert parse_config(config.to_dict()) == config  # what `up` writes to controller.json reads back
    else:
        assert not config.sandbox_pool.enabled


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("-1", "expected an integer in [0, 65536]"),
        ("65537", "expected an integer in [0, 65536]"),
        ("many", "expected an integer in [0, 65536]"),
        ("8,mem=0", "the share must be more than 0"),
        ("8,mem=0%", "the share must be more than 0"),
        ("8,mem=150%", "at most all of the node's memory"),
        ("8,mem=-5%", "the share must be more than 0"),
        ("8,mem=2", "a number without a unit is a fraction of the node's memory, in (0, 1]"),
        ("8,mem=nan", "'nan' is not a finite number"),
        ("8,mem=x%", "'x' is not a finite number"),
        ("8,mem=lots", "cannot read size"),
        ("8,mem=6G", "ambiguous unit 'G'"),
        ("8,mem=9GiB", "more than this machine offers sandboxes (8192 MiB)"),
        ("8,mem=", "cannot read size"),
        ("8,min=2", "unknown part 'min=2' (only mem=SHARE)"),
        ("8,mem", "unknown part 'mem' (only mem=SHARE)"),
        ("8,mem=1%,mem=2%", "mem given twice"),
        ("0,mem=50%", "mem= sizes pools, and N = 0 turns them off"),
    ],
)
def test_a_bad_pool_flag_names_the_flag_and_the_problem(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_pool_flag(text, mem_of_this_node)
    assert err.value.message.startswith(f"--sandbox-pool {text}: ")
    assert words in err.value.message
    assert err.value.hint  # and the fix
    assert err.value.exit_code == 2


def test_a_pool_share_as_a_size_reads_this_machines_memory() -> None:
    """Without a stand-in, ``mem=SIZE`` is a share of what this machine's agent offers sandboxes."""
    offer = local_flags.local_mem_mib()
    assert offer > 0
    assert parse_pool_flag(f"4,mem={offer}MiB").mem_fraction == 1.0
    with pytest.raises(ConfigError, match=f"more than this machine offers sandboxes \\({offer} MiB\\)"):
        parse_pool_flag(f"4,mem={offer + 1}MiB")


def test_differences_with_a_recorded_share_of_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path))
    st.ensure_dirs("local")
    running = LocalExtras(PoolFlag(2, 0.5))
    st.controller_config_path("local").write_text(json.dumps(running.apply(ControllerConfig("local")).to_dict()))
    assert local_flags.recorded("local") == running
    state = st.ClusterState(name="local", executor="docker", gpus="", certs="/c")
    assert differences(state, {"sandbox_pool": parse_pool_flag("2,mem=50%")}) == []
    assert differences(state, {"sandbox_pool": parse_pool_flag("2,mem=4GiB", mem_of_this_node)}) == []
    assert differences(state, {"sandbox_pool": parse_pool_flag("2")}) == [
        "--sandbox-pool 2 (running: 2,mem=50%)"
    ]
    assert differences(state, {"sandbox_pool": parse_pool_flag("2,mem=0.3")}, "recorded") == [
        "--sandbox-pool 2,mem=0.3 (recorded: 2,mem=50%)"
    ]


def test_extras_go_into_the_controller_config_and_back() -> None:
    base = ControllerConfig(cluster="local")
    assert LocalExtras().apply(base) is base
    extras = LocalExtras(PoolFlag(4), parse_job_flags(["train=3", "eval=1,cores=2"]))
    config = extras.apply(base)
    assert config.sandbox_pool == PoolPolicy(max=4) and config.sandbox_pool.enabled
    assert config.jobs == extras.jobs
    assert parse_config(config.to_dict()) == config  # what `up` writes to controller.json reads back
    assert extras.to_dict() == {
        "sandbox_pool": 4,
        "sandbox_pool_mem_fraction": 0.25,
        "jobs": {
            "train": {"weight": 3.0, "caps": {}, "keys": []},
            "eval": {"weight": 1.0, "caps": {"cores": 2}, "keys": []},
        },
    }
    assert extras.describe() == [
        "warm sandbox pools: up to 4 idle sandbox(es) per node and shape, sized from recent opens, "
        "holding at most 25% of the node's memory (Docker executor)",
        "jobs: train (weight 3), eval (weight 1, caps cores=2)",
    ]


def test_differences_with_the_recorded_pools_and_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path))
    st.ensure_dirs("local")
    running = LocalExtras(PoolFlag(2), parse_job_flags(["a=1", "b=3"]))
    config = running.apply(ControllerConfig(cluster="local"))
    st.controller_config_path("local").write_text(json.dumps(config.to_dict()))
    assert local_flags.recorded("local") == running
    state = st.ClusterState(name="local", executor="docker", gpus="", certs="/c")
    assert differences(state, {}) == []
    same = {"sandbox_pool": parse_pool_flag("2"), "jobs": parse_job_flags(["b=3", "a=1"])}  # any order
    assert differences(state, same) == []
    assert differences(state, {"sandbox_pool": parse_pool_flag("2,mem=0.25")}) == []  # the default share
    other = {"sandbox_pool": parse_pool_flag("0"), "jobs": parse_job_flags(["a=2"])}
    assert differences(state, other) == [
        "--sandbox-pool 0 (running: 2)",
        "--job a=2 (running: --job a=1 --job b=3)",
    ]
    st.controller_config_path("local").write_text("{not json")
    assert local_flags.recorded("local") is None


# ---------------------------------------------------------------- the CLI refuses bad values


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--job", "train"), "error: --job train: no weight for job 'train'"),
        (("--job", "train=0"), "error: --job train=0: weight 0 must be a finite number > 0"),
        (("--job", "a=1", "--job", "a=3"), "error: --job a given twice (a=1 and a=3)"),
        (("--sandbox-pool", "-1"), "error: --sandbox-pool -1: expected an integer in [0, 65536]"),
        (("--sandbox-pool", "4,mem=200%"), "error: --sandbox-pool 4,mem=200%: mem: the share must be"),
        (("--sandbox-pool", "4,mem=8"), "error: --sandbox-pool 4,mem=8: mem: a number without a unit"),
        (("--sandbox-pool", "4,mem=1PiB"), "error: --sandbox-pool 4,mem=1PiB: mem: "),
        (
            ("--sandbox-pool", "2", "--executor", "process"),
            "error: --sandbox-pool 2 with --executor process: the process executor keeps no warm "
            "sandbox pools",
        ),
    ],
)
def test_up_refuses_bad_pool_and_job_flags_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], words: str
) -> None:
    r = run_up(tmp_path, monkeypatch, *args)
    assert r.exit_code == 2, r.output
    assert words in r.stderr
    assert "To fix: " in r.stderr
    assert "Traceback" not in r.output
    assert not (tmp_path / "clusters").exists()  # nothing started, nothing recorded


def test_pool_and_job_flags_with_an_inventory_are_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = str(tmp_path / "inv.yaml")
    r = run_up(tmp_path, monkeypatch, "-i", inv, "--sandbox-pool", "4,mem=50%", "--job", "a=1")
    assert r.exit_code == 2, r.output
    assert "--sandbox-pool (set `sandbox_pool: {max: N, mem_fraction: F}` in the inventory)" in r.stderr
    assert "--job (set `jobs: {NAME: {weight: W, caps: {...}}}` in the inventory)" in r.stderr
    assert "only for the local default" in r.stderr


def test_a_pool_on_an_executor_without_pools_stops_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` that falls back to the process executor (no dockerd) meets the same refusal, as a
    BootstrapError (exit 1) from the library; here the process executor is asked for directly."""
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path))
    said: list[str] = []
    with pytest.raises(BootstrapError) as err:
        extras = LocalExtras(PoolFlag(2))
        local.bring_up_local(executor="process", gpus=0, extras=extras, on_event=said.append)
    assert "--sandbox-pool 2: the executor chosen here is process" in err.value.message
    assert "only the Docker executor keeps warm sandbox pools" in err.value.message
    assert "drop --sandbox-pool" in (err.value.hint or "")
    assert said == ["executor: process"]
    assert st.load("local") is None  # no controller, no state


def test_dry_run_shows_the_pools_and_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = run_up(tmp_path, monkeypatch, "--dry-run", "--sandbox-pool", "3,mem=40%", "--job", "a=2,gpus=1")
    assert r.exit_code == 0, r.output
    assert "warm sandbox pools: up to 3 idle sandbox(es) per node and shape" in r.stdout
    assert "holding at most 40% of the node's memory" in r.stdout
    assert "jobs: a (weight 2, caps gpus=1)" in r.stdout


# ---------------------------------------------------------------- real local clusters


def status_json(home: Path) -> dict[str, Any]:
    r = tangram("status", "-o", "json", home=home)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["records"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_jobs_on_a_local_cluster_show_in_status_and_a_rerun_with_others_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = tangram(*UP, "--job", "train=3", "--job", "eval=1,cores=1", "-o", "json", home=home)
    assert first.returncode == 0, first.stdout + first.stderr
    try:
        doc = json.loads(first.stdout)
        assert doc["sandbox_pool"] == 0
        assert doc["jobs"]["eval"] == {"weight": 1.0, "caps": {"cores": 1}, "keys": []}
        recorded = json.loads(st_path(home, "controller.json").read_text())
        assert set(recorded["jobs"]) == {"train", "eval"} and "sandbox_pool" not in recorded
        jobs = {r["job"]: r for r in status_json(home)["jobs"]}
        assert (jobs["train"]["weight"], jobs["train"]["caps"]) == (3.0, {})
        assert (jobs["eval"]["weight"], jobs["eval"]["caps"]) == (1.0, {"cpu": 1})
        table = tangram("status", home=home)
        assert "JOB" in table.stdout and "train" in table.stdout and "cpu=1" in table.stdout

        pid = json.loads(st_path(home, "state.json").read_text())["controller_pid"]
        kept = tangram("up", home=home)  # no flags: keep it, and say what it runs with
        assert kept.returncode == 0, kept.stdout + kept.stderr
        assert "CURVE, jobs train=3 eval=1,cores=1; keeping it" in kept.stderr
        assert "jobs: train (weight 3), eval (weight 1, caps cores=1)" in kept.stdout
        same = tangram("up", "--job", "eval=1,cores=1", "--job", "train=3", home=home)
        assert same.returncode == 0, same.stdout + same.stderr

        other = tangram("up", "--job", "train=2", "--sandbox-pool", "2", home=home)
        assert other.returncode == 1, other.stdout + other.stderr
        assert "these flags differ from it: --sandbox-pool 2 (running: off); --job train=2 (running: " in (
            other.stderr
        )
        assert "--job train=3 --job eval=1,cores=1)" in other.stderr
        assert "To fix: `tangram down` then `tangram up --sandbox-pool 2 --job train=2`" in other.stderr
        assert "Traceback" not in other.stderr
        assert json.loads(st_path(home, "state.json").read_text())["controller_pid"] == pid  # unchanged

        replaced = tangram(*UP, "--replace", "--job", "train=2", home=home)
        assert replaced.returncode == 0, replaced.stdout + replaced.stderr
        jobs = {r["job"]: r for r in status_json(home)["jobs"]}
        assert jobs["train"]["weight"] == 2.0 and "eval" not in jobs
    finally:
        down = tangram("down", home=home)
    assert down.returncode == 0, down.stdout + down.stderr


def st_path(home: Path, name: str) -> Path:
    return home / "clusters" / "local" / name


def docker_env(docker_client: Any) -> dict[str, str]:
    adapter = getattr(docker_client.api, "_custom_adapter", None)  # the fixture's daemon, private or not
    socket_path = getattr(adapter, "socket_path", None)
    return {"DOCKER_HOST": f"unix://{socket_path}" if socket_path else docker_client.api.base_url}


def tangram_docker(home: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**clean_env(home), **env}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=240, check=False)


async def open_two(state: dict[str, Any]) -> list[str]:
    """Open two small sandboxes at once, run a command in each, close them: the pool's sizer sees a burst."""
    async with tg.AsyncClient(state["submit_addr"], certs=state["certs"], name="pool-flag") as client:
        boxes = await asyncio.gather(*(client.open_sandbox(mem="256MiB") for _ in range(2)))
        out = [(await b.exec("echo warm", timeout=60)).stdout.strip() for b in boxes]
        for b in boxes:
            await b.close()
    return out


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sandbox_pool_flag_fills_a_pool_on_the_docker_executor(tmp_path: Path, docker_client: Any) -> None:
    home, env = tmp_path / "home", docker_env(docker_client)
    up = tangram_docker(home, env, "up", "--executor", "docker", "--gpus", "0", "--sandbox-pool", "2,mem=50%")
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads(st_path(home, "state.json").read_text())
    try:
        assert "warm sandbox pools: up to 2 idle sandbox(es) per node and shape" in up.stdout
        assert "holding at most 50% of the node's memory" in up.stdout
        pool = json.loads(st_path(home, "controller.json").read_text())["sandbox_pool"]
        assert (pool["max"], pool["mem_fraction"]) == (2, 0.5)
        assert asyncio.run(open_two(state)) == ["warm", "warm"]
        deadline = time.monotonic() + 120  # the refill is made in the background, one container at a time
        while (node := status_json(home)["nodes"][0])["pool_idle"] < 2:
            assert time.monotonic() < deadline, f"the pool did not fill: {node}"
            time.sleep(0.5)
        assert node["pool_mem_mib"] == 2 * 256  # two idle pooled sandboxes of the shape opened
        again = tangram_docker(home, env, "up", "--sandbox-pool", "3")
        assert again.returncode == 1, again.stdout + again.stderr
        assert "--sandbox-pool 3 (running: 2,mem=50%)" in again.stderr

        os.kill(state["controller_pid"], signal.SIGKILL)  # a dead controller: restarted with its own pools
        deadline = time.monotonic() + 20
        while st.pid_alive(state["controller_pid"], ("controller",)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other = tangram_docker(home, env, "up", "--sandbox-pool", "2")
        assert other.returncode == 1, other.stdout + other.stderr
        assert "these flags differ from them: --sandbox-pool 2 (recorded: 2,mem=50%)" in other.stderr
        same = tangram_docker(home, env, "up", "--sandbox-pool", "2,mem=0.5")
        assert same.returncode == 0, same.stdout + same.stderr
        assert "is up again" in same.stdout
    finally:
        down = tangram_docker(home, env, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    label = f"tangram.cluster-id={state['cluster_id']}"
    deadline = time.monotonic() + 60  # `down` removes the idle pooled containers too (a removal may still be
    while left := docker_client.containers.list(all=True, filters={"label": label}):  # in progress)
        assert time.monotonic() < deadline, f"left after down: {[c.name for c in left]}"
        time.sleep(0.5)
