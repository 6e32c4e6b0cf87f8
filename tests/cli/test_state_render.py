"""Cluster state files, client discovery, status rendering helpers and demo metrics (pure, no processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram import discovery
from tangram_cli import state as st
from tangram_cli.bootstrap import bundle, local
from tangram_cli.demo import workload as dw
from tangram_cli.render import status as rs


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path / "h"))
    monkeypatch.delenv("TANGRAM_CLUSTER", raising=False)
    return tmp_path / "h"


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # tangram controller"])
    yield proc.pid
    proc.kill()
    proc.wait(5)


def test_state_round_trip_atomic_and_private(home: Path, live_pid: int) -> None:
    s = st.ClusterState(
        name="c1",
        controller_pid=live_pid,
        ports={"agents": 5, "submit": 6, "status": 7},
        hosts=[st.HostState(name="n1", host="10.0.0.1", connection="ssh", workdir="~/.tangram/c1")],
        bundle="ab" * 32,
        started_at=1.5,
    )
    with st.locked("c1"):
        path = st.write(s)
    assert path == home / "clusters" / "c1" / "state.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert not list(path.parent.glob(".state.json.*"))  # no temporary file left
    back = st.load("c1")
    assert back is not None
    assert back.hosts[0].host == "10.0.0.1"
    assert back.ports["status"] == 7
    assert back.address == "tcp://127.0.0.1:6"
    assert back.status_address == "tcp://127.0.0.1:7"
    raw = json.loads(path.read_text())
    assert raw["address"] == raw["submit_addr"] == "tcp://127.0.0.1:6"
    assert st.find("c1").name == "c1"
    assert st.find().name == "c1"  # the only running cluster
    assert [c.name for c in st.running()] == ["c1"]


def test_stale_pid_and_recycled_pid(home: Path) -> None:
    assert not st.pid_alive(None)
    assert not st.pid_alive(0)
    assert not st.pid_alive(True)
    assert st.pid_alive(os.getpid())
    assert not st.pid_alive(os.getpid(), ("no-such-word-in-cmdline",))  # recycled pid: another program
    with st.locked("old"):
        st.write(st.ClusterState(name="old", controller_pid=2**22 + 99, ports={"submit": 1}))
    from tangram.errors import ClusterNotFound

    with pytest.raises(ClusterNotFound, match="stale"):
        st.find("old")
    with pytest.raises(ClusterNotFound, match="no cluster named 'nope'"):
        st.find("nope")
    assert discovery.find_address("old") is None


def test_discovery_is_stdlib_and_finds_the_address(home: Path, live_pid: int) -> None:
    with st.locked("local"):
        st.write(st.ClusterState(name="local", controller_pid=live_pid, ports={"submit": 4242, "status": 1}))
    assert discovery.find_address() == "tcp://127.0.0.1:4242"
    assert st.find_address("local") == "tcp://127.0.0.1:4242"
    assert discovery.find_address("../etc") is None
    src = Path(discovery.__file__).read_text()
    imports = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert all(ln.split()[1].split(".")[0] in ("__future__", "json", "os") for ln in imports), imports


def test_remove_and_purge(home: Path) -> None:
    with st.locked("z"):
        st.write(st.ClusterState(name="z"))
    (st.logs_dir("z") / "controller.log").write_text("x")
    st.remove("z")
    assert st.load("z") is None
    assert (st.logs_dir("z") / "controller.log").exists()
    st.remove("z", purge=True)
    assert not st.cluster_dir("z").exists()


def test_parse_ready_variants() -> None:
    assert local.parse_ready('{"agents": 1, "submit": 2, "status": 3, "pid": 9}\n') == {
        "agents": 1,
        "submit": 2,
        "status": 3,
    }
    assert local.parse_ready(
        'log\n{"agents_addr": "tcp://127.0.0.1:5", "submit_port": 6, "status_port": 7}'
    ) == {"agents": 5, "submit": 6, "status": 7}
    assert local.parse_ready("not json") == {}


def test_controller_config_from_local_inventory() -> None:
    from tangram_cli.controller.config import parse_config
    from tangram_cli.inventory import local_default
    from tangram_cli.inventory.configs import controller_config

    cfg = controller_config(local_default(), local_demo=True).to_dict()
    names = {s["name"] for s in cfg["services"]}
    assert "reward" in names
    reward = next(s for s in cfg["services"] if s["name"] == "reward")
    assert reward["model"] == "agent.gpu.demo_services:reward"
    assert reward["runtime"] == "emulated"
    assert any(a["name"] == "search" and a["mode"] == "concurrency" for a in cfg["apis"])
    parsed = parse_config(cfg)  # the controller accepts it
    assert parsed.cluster == "local"
    assert parsed.service("reward") is not None


def test_agent_config_is_accepted_by_the_agent(tmp_path: Path) -> None:
    from agent.config import AgentConfig
    from tangram_cli.inventory import local_default
    from tangram_cli.inventory.configs import agent_config

    node = local_default().nodes[0]
    raw = agent_config(
        node,
        cluster="local",
        controller="tcp://127.0.0.1:5",
        workdir=str(tmp_path),
        executor="process",
        emulated_gpus=8,
        gpu_mem_mib=81920,
        cpus=[0, 1],
        idle_cpus=[0],
    )
    cfg = AgentConfig.from_dict(json.loads(raw.to_json()))
    assert cfg.emulated_gpus == 8
    assert cfg.cpus == [0, 1]
    assert cfg.cluster == "local"


def test_bundle_is_content_addressed() -> None:
    a, b = bundle.build(), bundle.build()
    assert a.digest == b.digest
    assert a.files == b.files
    import io
    import zipfile

    names = zipfile.ZipFile(io.BytesIO(a.files["src.zip"])).namelist()
    assert "agent/__main__.py" in names
    assert "tangram/protocol.py" in names
    assert not any(n.startswith("tangram_cli/") or "__pycache__" in n for n in names)


def test_render_rows_are_defensive() -> None:
    assert rs.rows(None, "nodes") == []
    assert rs.rows({"nodes": "junk"}, "nodes") == []
    assert rs.rows({"nodes": {"a": {"state": "idle"}}}, "nodes") == [{"name": "a", "state": "idle"}]
    assert rs.rows({"nodes": {"rows": [{"node": "b"}, 3]}}, "nodes") == [{"node": "b"}]
    assert rs.node_state({"cpus_used": 0, "cpus_total": 4}) == "idle"
    assert rs.node_state({"cpus_used": 4, "cpus_total": 4}) == "alloc"
    assert rs.node_state({"alive": False}) == "down*"
    assert not rs.healthy({"state": "idle", "agent_state": "lost"})
    summary = rs.summary({"nodes": [{"node": "x"}], "queue": [{"waited_s": 0.5}, {"waited_s": 1.5}]})
    assert summary["queue"] == 2
    assert summary["agents_total"] == 1
    assert summary["wait_p50_s"] == 1.5
    assert "agents 1/1" in rs.header_line(summary)


def test_collapse_keeps_distinct_nodes_apart() -> None:
    nodes = [
        {"node": f"cpu-{i:02d}", "state": "idle", "cpus_total": 4, "cpus_used": 0, "heartbeat_age_s": i / 10}
        for i in range(1, 5)
    ]
    nodes[2] = {**nodes[2], "state": "mix", "cpus_used": 1}
    out = rs.collapse_nodes(nodes, rs.NODE_COLS)
    assert [r[0] for r in out] == ["cpu-[01-02,04]", "cpu-03"]
    assert out[0][rs.NODE_COLS.index(next(c for c in rs.NODE_COLS if c[0] == "HEARTBEAT")) + 1] == "400ms"


def test_percentile_and_compare() -> None:
    xs = sorted(float(i) for i in range(1, 101))
    assert dw.percentile(xs, 99) == 99.0
    assert dw.percentile(xs, 50) == 50.0
    assert dw.percentile([], 50) is None
    t = dw.PolicyResult(
        "tangram", [dw.Act(0, 0, "cmd", 1.0)], makespan_s=10, reserved_core_s=5, busy_core_s=5
    )
    s = dw.PolicyResult(
        "static", [dw.Act(0, 0, "cmd", 3.0)], makespan_s=20, reserved_core_s=20, busy_core_s=5
    )
    cmp_ = dw.compare({"tangram": t, "static": s})
    assert cmp_["static_over_tangram"]["mean_act_s"] == 3.0
    assert cmp_["static_over_tangram"]["makespan_s"] == 2.0
    assert cmp_["policies"]["static"]["busy_over_reserved"] == 0.25


def test_testrun_script_splits_fixed_work(tmp_path: Path) -> None:
    script = tmp_path / "testrun.py"
    script.write_bytes(dw.testrun_source())
    argv = [sys.executable, str(script), "3", "7", "1000"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0
    assert r.stdout.startswith("7 passed in")
    assert "(3 workers)" in r.stdout
