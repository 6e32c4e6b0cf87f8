"""CliRunner tests for `up`, `down`, `status`, `env`, `demo`: messages, hints, exit codes, no tracebacks.

Nothing here starts a real cluster (tests/e2e/test_up_local.py and test_up_ssh.py do); a fake
status server on 127.0.0.1 stands in for the controller's status socket where one is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tangram_cli import state as st
from tangram_cli.main import cli
from tests.cli.fake_status import FakeStatus


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_HOME", str(h))
    for var in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER", "TANGRAM_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    return h


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


RECORDS = {
    "cluster": {"name": "fake", "proto": "1.0", "uptime_s": 75.0, "queue": 1, "wait_p50_s": 0.12},
    "nodes": [
        {
            "node": f"cpu-0{i}",
            "state": "mix",
            "agent_state": "up",
            "role": "cpu",
            "cpus_total": 4,
            "cpus_used": 2,
            "mem_total_mib": 8192,
            "mem_reserved_mib": 1024,
            "sandboxes": 3,
            "sandboxes_busy": 1,
            "heartbeat_age_s": 0.1 * i,
        }
        for i in (1, 2, 3)
    ]
    + [
        {
            "node": "gpu-01",
            "state": "down",
            "agent_state": "lost",
            "role": "gpu",
            "gpus_total": 8,
            "gpus_busy": 0,
            "heartbeat_age_s": 31.0,
            "reason": "no heartbeat 3x",
        }
    ],
    "services": [
        {
            "service": "reward",
            "runtime": "emulated",
            "chunk_sizes": [1, 2],
            "load_s": 1.0,
            "inflight": 0,
            "queued": 0,
        }
    ],
    "apis": [{"api": "search", "mode": "concurrency", "limit": 16, "in_flight": 3, "used": 40, "queued": 0}],
    "queue": [
        {
            "action": "a-1",
            "pool": "cpu",
            "kind": "exec",
            "client": "w1",
            "state": "PD",
            "waited_s": 0.12,
            "demand": "cpus 1-4",
            "reason": "cpus: requested 1, free 0 of 12",
        }
    ],
}



@pytest.fixture
def fake_pid():
    """A live process whose command line says `tangram controller` (what stale-pid detection checks)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # tangram controller"])
    yield proc.pid
    proc.kill()
    proc.wait(5)


@pytest.fixture
def fake_cluster(home: Path, fake_pid: int):
    server = FakeStatus(RECORDS)
    with st.locked("fake"):
        st.write(
            st.ClusterState(
                name="fake",
                controller_pid=fake_pid,
                ports={"agents": 1, "submit": 2, "status": server.port},
                started_at=0.0,
            )
        )
    yield server
    server.close()


def test_status_without_cluster_exits_4_with_hint(home: Path) -> None:
    code, out, err = run("status")
    assert code == 4
    assert "no cluster named 'local'" in err
    assert "To fix:" in err
    assert "tangram up" in err
    assert "Traceback" not in err + out


def test_status_stale_state_exits_4(home: Path) -> None:
    with st.locked("local"):
        st.write(
            st.ClusterState(name="local", controller_pid=2**22 + 12345, ports={"status": 1, "submit": 2})
        )
    code, _, err = run("status")
    assert code == 4
    assert "stale state" in err
    assert "To fix:" in err


def test_status_controller_not_answering_exits_4(home: Path, fake_pid: int) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with st.locked("x"):
        st.write(st.ClusterState(name="x", controller_pid=fake_pid, ports={"status": dead, "submit": 2}))
    code, _, err = run("status", "-c", "x")
    assert code == 4
    assert "does not answer" in err
    assert "To fix:" in err


def test_status_table_collapses_identical_nodes(fake_cluster: FakeStatus) -> None:
    code, out, err = run("status", "-c", "fake")
    assert code == 0, err
    assert "cluster fake" in out
    assert "agents 3/4" in out
    assert "queue 1" in out
    assert "p50 wait 120ms" in out
    assert "cpu-[01-03]" in out
    assert "2/4" in out
    assert "gpu-01" in out
    assert "no heartbeat 3x" in out
    for title in ("SERVICE", "API", "ACTION"):
        assert title in out
    code, out, _ = run("status", "-c", "fake", "--nodes", "-R")
    assert code == 0
    assert "gpu-01" in out
    assert "cpu-[01-03]" not in out
    assert "SERVICE" not in out


def test_status_json_and_wide(fake_cluster: FakeStatus) -> None:
    code, out, _ = run("status", "-c", "fake", "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["agents_total"] == 4
    assert doc["agents_healthy"] == 3
    assert doc["queue"] == 1
    assert doc["records"]["apis"][0]["api"] == "search"
    code, out, _ = run("status", "-c", "fake", "-o", "wide")
    assert code == 0
    assert "cpu-[01-03]" in out


def test_status_watch_prints_timestamped_snapshots(fake_cluster: FakeStatus, monkeypatch) -> None:
    import types

    from tangram_cli.commands import status as status_cmd

    calls = {"n": 0}

    def fake_sleep(_s: float) -> None:
        calls["n"] += 1
        if calls["n"] >= 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cmd, "time", types.SimpleNamespace(sleep=fake_sleep))
    code, out, _ = run("status", "-c", "fake", "--watch", "1")
    assert code == 0
    assert out.count("--- ") == 2
    assert out.count("cluster fake") == 2


def test_env_prints_exports(fake_cluster: FakeStatus) -> None:
    code, out, _ = run("env", "-c", "fake")
    assert code == 0
    assert "export TANGRAM_ADDR=tcp://127.0.0.1:2" in out
    code, out, _ = run("env", "-c", "fake", "--shell", "fish")
    assert code == 0
    assert "set -gx TANGRAM_ADDR tcp://127.0.0.1:2;" in out


def test_env_without_cluster(home: Path) -> None:
    code, _, err = run("env")
    assert code == 4
    assert "To fix:" in err


def test_down_is_idempotent(home: Path) -> None:
    code, out, _err = run("down")
    assert code == 0
    assert "nothing is running for cluster 'local'" in out
    code, out, _ = run("down", "-c", "other")
    assert code == 0
    assert "'other'" in out


def test_down_cleans_stale_state(home: Path) -> None:
    with st.locked("local"):
        st.write(st.ClusterState(name="local", controller_pid=2**22 + 777, ports={"status": 1, "submit": 2}))
    code, out, _ = run("down")
    assert code == 0
    assert "stale state" in out
    assert "is down" in out
    assert st.load("local") is None


def test_up_bad_inventory_lists_every_error(home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\ncluster: c1\ngroups:\n  g:\n    role: cpu\n    hosts: ['h-1']\n"
        "    vars: {memm: 4GiB}\n"
        "apis:\n  s: {mode: quota, limit: 5}\n"
    )
    code, out, err = run("up", str(bad))
    assert code == 2
    assert "groups.g.vars.memm" in err
    assert "did you mean 'mem'" in err
    assert "apis.s" in err
    assert "period" in err
    assert "Traceback" not in err + out


def test_up_inventory_from_env(home: Path, tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ncluster: c1\ngroupz: {}\n")
    monkeypatch.setenv("TANGRAM_INVENTORY", str(bad))
    code, _, err = run("up")
    assert code == 2
    assert "groupz" in err


def test_up_missing_inventory_file(home: Path) -> None:
    code, _, err = run("up", "/nonexistent/inv.yaml")
    assert code == 2
    assert "Traceback" not in err


def test_up_dry_run_prints_plan(home: Path, tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "version: 1\ncluster: c2\ndefaults: {ssh: {user: ops}}\n"
        "groups:\n  cpu:\n    role: cpu\n    hosts: ['cpu-[01-02].internal']\n"
    )
    code, out, err = run("up", str(inv), "--dry-run")
    assert code == 0, err
    assert "bootstrap plan: 2 host(s)" in out
    assert "cpu-01" in out
    assert "cpu-02" in out
    assert "ops@cpu-01.internal:22" in out
    assert st.load("c2") is None  # nothing started, nothing written
    code, out, _ = run("up", "--dry-run")
    assert code == 0
    assert "local default" in out


def test_up_bad_gpu_mem(home: Path) -> None:
    code, _, err = run("up", "--gpu-mem", "lots")
    assert code == 2
    assert "--gpu-mem" in err
    assert "To fix:" in err


def test_up_two_inventories_is_usage_error(home: Path) -> None:
    code, _, _ = run("up", "a.yaml", "-i", "b.yaml")
    assert code == 2


def test_help_lists_commands() -> None:
    code, out, _ = run("--help")
    assert code == 0
    for name in ("up", "down", "status", "demo", "env"):
        assert name in out
    for name in ("up", "down", "status", "demo", "env"):
        code, out, _ = run(name, "--help")
        assert code == 0
        assert "Usage:" in out
