"""Cluster identity: `tangram down` removes only the containers of its own cluster id (issue 12).

Two clusters share a name (as two users, or two TANGRAM_HOMEs, on one Docker daemon would: both `local`),
and each has containers on the real dockerd, made with the Docker SDK and carrying the labels an agent
puts on its sandboxes. `down` of one must leave the other's alone; `down` with no state, or with a legacy
state (written before ids), removes nothing. The pure pieces (ids in the controller's and the agent's
configuration, the SSH `docker rm` command) are checked without Docker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agent.config import AgentConfig
from agent.executors.docker import LABEL_CLUSTER, LABEL_CLUSTER_ID
from tangram.errors import ConfigError
from tangram_cli import state as st
from tangram_cli.bootstrap import local, plan
from tangram_cli.controller.config import parse_config
from tangram_cli.inventory.configs import agent_config
from tangram_cli.main import cli

DEAD_PID = 2**22 + 4242  # no such process: the state is stale, so `down` skips the controller


def run_down(home: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    monkeypatch.setenv("TANGRAM_HOME", str(home))
    r = CliRunner().invoke(cli, ["down", *args], catch_exceptions=False)
    return r.exit_code, r.stdout


def write_state(home: Path, monkeypatch: pytest.MonkeyPatch, name: str, cluster_id: str) -> None:
    monkeypatch.setenv("TANGRAM_HOME", str(home))
    with st.locked(name):
        st.write(st.ClusterState(name=name, controller_pid=DEAD_PID, cluster_id=cluster_id))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER", "TANGRAM_DEBUG"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def dockerd(docker_client: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fixture's daemon, also for `down` (which uses ``docker.from_env()``)."""
    adapter = getattr(docker_client.api, "_custom_adapter", None)
    socket_path = getattr(adapter, "socket_path", None)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{socket_path}" if socket_path else docker_client.api.base_url)
    return docker_client


@pytest.fixture
def containers(dockerd: Any, busybox_image: str, test_labels: dict[str, str]) -> Iterator[Any]:
    """``make(name, cluster_id)``: a created (not started) container labelled like a sandbox of that
    cluster ("" = a legacy container, labelled by name only). Removed at the end."""
    made: list[Any] = []

    def make(name: str, cluster_id: str) -> str:
        labels = {**test_labels, LABEL_CLUSTER: name, "tangram.sandbox": f"sb-{len(made)}"}
        if cluster_id:
            labels[LABEL_CLUSTER_ID] = cluster_id
        c = dockerd.containers.create(busybox_image, ["sleep", "60"], labels=labels, network_mode="none")
        made.append(c)
        return c.id

    yield make
    for c in made:
        try:
            c.remove(force=True)
        except Exception:  # noqa: BLE001 - removed by the test, as it should be
            pass


def existing(client: Any, ids: list[str]) -> set[str]:
    found = {c.id for c in client.containers.list(all=True)}
    return {i for i in ids if i in found}


@pytest.mark.docker
def test_down_removes_only_its_own_cluster_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None, dockerd: Any, containers: Any
) -> None:
    name = f"same-{uuid.uuid4().hex[:8]}"  # both clusters have this name
    id_a, id_b = st.new_cluster_id(), st.new_cluster_id()
    assert id_a != id_b
    a1, a2 = containers(name, id_a), containers(name, id_a)
    b1 = containers(name, id_b)
    legacy = containers(name, "")  # labelled by name only
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    write_state(home_a, monkeypatch, name, id_a)
    write_state(home_b, monkeypatch, name, id_b)

    code, out = run_down(home_a, monkeypatch, "-c", name)
    assert code == 0, out
    assert f"removed 2 container(s) of cluster {name} (id {id_a})" in out
    assert existing(dockerd, [a1, a2, b1, legacy]) == {b1, legacy}
    assert st.load(name) is None  # A's state is gone ...
    monkeypatch.setenv("TANGRAM_HOME", str(home_b))
    assert st.load(name) is not None  # ... B's is not

    code, out = run_down(home_b, monkeypatch, "-c", name)
    assert code == 0, out
    assert existing(dockerd, [b1, legacy]) == {legacy}  # the legacy container is nobody's to sweep


@pytest.mark.docker
def test_down_without_state_or_with_legacy_state_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None, dockerd: Any, containers: Any
) -> None:
    name = f"same-{uuid.uuid4().hex[:8]}"
    mine, legacy = containers(name, st.new_cluster_id()), containers(name, "")

    code, out = run_down(tmp_path / "empty", monkeypatch, "-c", name)  # an empty TANGRAM_HOME
    assert code == 0, out
    assert f"nothing is running for cluster {name!r}" in out
    assert "no containers were removed" in out
    assert existing(dockerd, [mine, legacy]) == {mine, legacy}

    legacy_home = tmp_path / "legacy"
    write_state(legacy_home, monkeypatch, name, "")  # a state from before cluster ids
    code, out = run_down(legacy_home, monkeypatch, "-c", name)
    assert code == 0, out
    assert "has no cluster id" in out
    assert f"docker ps -a --filter label=tangram.cluster={name}" in out
    assert f"cluster {name} is down" in out
    assert existing(dockerd, [mine, legacy]) == {mine, legacy}


def test_down_without_docker_or_state_says_nothing_was_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    code, out = run_down(tmp_path / "empty", monkeypatch)
    assert code == 0
    assert "nothing is running for cluster 'local'" in out
    assert "no containers were removed" in out
    assert local.remove_cluster_containers("local", "") == 0  # no id: never a sweep by name


def test_cluster_id_in_state_controller_and_agent_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path))
    cid = st.new_cluster_id()
    assert len(cid) == 12 and int(cid, 16) >= 0
    with st.locked("c1"):
        st.write(st.ClusterState(name="c1", cluster_id=cid))
    assert st.load("c1").cluster_id == cid
    (tmp_path / "clusters" / "old").mkdir(parents=True)
    (tmp_path / "clusters" / "old" / "state.json").write_text('{"name": "old", "controller_pid": 1}')
    assert st.load("old").cluster_id == ""  # legacy

    config = parse_config({"cluster": "c1"})
    assert config.cluster_id == ""
    assert parse_config(replace(config, cluster_id=cid).to_dict()).cluster_id == cid
    assert "cluster_id" not in replace(parse_config({"cluster_id": "x1"}), cluster_id="").to_dict()
    with pytest.raises(ConfigError, match="cluster_id"):
        parse_config({"cluster_id": "Not/Valid"})

    node = local.local_inventory().nodes[0]
    cfg = agent_config(
        node,
        cluster="c1",
        controller="tcp://127.0.0.1:1",
        workdir="/w",
        executor="process",
        emulated_gpus=0,
        gpu_mem_mib=None,
        cluster_id=cid,
    )
    raw = json.loads(cfg.to_json())
    assert raw["cluster_id"] == cid
    assert AgentConfig.from_dict(raw).cluster_id == cid
    with pytest.raises(ConfigError, match="cluster_id"):
        AgentConfig.from_dict({**raw, "cluster_id": "-bad"})


def test_ssh_down_command_removes_by_id_only() -> None:
    cmd = plan.remove_containers_command("0123456789ab")
    assert "--filter label=tangram.cluster-id=0123456789ab" in cmd
    assert "label=tangram.cluster=" not in cmd
    with pytest.raises(ValueError, match="never removed by name"):
        plan.remove_containers_command("")
