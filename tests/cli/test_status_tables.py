"""`tangram status` tables (issue 12): what each cell shows, from records built by the controller's
`statusd.build_records` around the real scheduling core, served by a status socket on 127.0.0.1 and
read by `tangram status` through click's CliRunner."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.resources import CPU, Demand, api_resource
from tangram.core.scheduler import Scheduler
from tangram_cli import state as st
from tangram_cli.controller.statusd import build_records
from tangram_cli.main import cli
from tangram_cli.render import status as rs
from tests.cli.fake_status import FakeStatus

KEY = "3fa2b1" + "c0" * 13  # the core's client key: 32 hex digits
NOBODY = "9e8d7c" + "11" * 13  # a client status has no row for (gone)


def _exec(aid: str, cores: int, client: str = KEY, sandbox: str = "sb-7") -> ev.ActionSubmitted:
    demand = ((CPU, Demand.range(cores, cores)),)
    return ev.ActionSubmitted(ActionSpec(aid, Kind.EXEC, demand, sandbox=sandbox, client=client))


def _lease(aid: str, api: str) -> ev.ActionSubmitted:
    res = api_resource(api)
    return ev.ActionSubmitted(
        ActionSpec(aid, Kind.LEASE, ((res, Demand.fixed(1)),), key=res, api=api, client=KEY)
    )


def _record(
    aid: str, client: str, started: float | None, cores: tuple[int, ...] = (), kind: str = "exec"
) -> Any:
    """What the controller's registry holds of an action (controller/state.py ActionRecord)."""
    return types.SimpleNamespace(
        action_id=aid,
        kind=kind,
        client=client,
        sandbox="sb-7" if kind == "exec" else "",
        started=started,
        final_sent=False,
        cores=cores,
        gpus=(),
        units=1,
        kill_reason="",
        node="n1",
    )


def cluster_records(running: int = 14) -> dict[str, Any]:
    """A 16-core node with 2 GPUs of 16 GiB, a quota API and a concurrency API; ``running`` one-core
    execs run, then a 4-core exec waits (busy: it will run) and one of a gone client waits too."""
    core = Scheduler()
    core.handle(
        ev.NodeJoined(
            "n1", cpus=tuple(range(16)), numa=(tuple(range(16)),), mem_mib=32768, gpus=2, gpu_mem_mib=16384
        ),
        0.0,
    )
    core.handle(ev.ApiDefined("llm", "quota", 3000, 60.0), 0.0)
    core.handle(ev.ApiDefined("search", "concurrency", 16), 0.0)
    core.handle(ev.SandboxOpened("sb-7", client=KEY), 0.0)
    actions = {}
    for i in range(running):
        out = core.handle(_exec(f"r{i}", 1), 0.1)
        cores = next(c.cores for c in out if type(c).__name__ == "Spawn")
        actions[f"r{i}"] = _record(f"r{i}", KEY, 0.1, cores)
    for aid, client in (("w1", KEY), ("w2", NOBODY)):
        core.handle(_exec(aid, 4, client), 0.5)
        actions[aid] = _record(aid, client, None)
    core.handle(_lease("l1", "llm"), 0.6)
    actions["l1"] = _record("l1", KEY, 0.6, kind="lease")
    return build_records(
        core,
        sections=["cluster", "nodes", "services", "apis", "queue", "actions", "clients"],
        limit=20,
        cluster="fake",
        epoch=1,
        started=0.0,
        addresses={},
        agent_rows=[{"node": "n1", "agent_state": "up", "heartbeat_age_s": 0.2, "reason": ""}],
        client_rows=[{"client": KEY[:6], "name": "worker-3", "owner": "alice"}],
        sandboxes=[],
        actions=actions,
        counters={},
        wait_p50=None,
        loop_lag_s=0.0,
        events=0,
        services_conf=[],
        now=2.0,
    )


# ---------------------------------------------------------------- the records


def test_records_name_the_sandbox_the_client_the_wait_and_the_totals() -> None:
    r = cluster_records()
    q = {row["action"]: row for row in r["queue"]}
    assert q["w1"]["sandbox"] == "sb-7" and q["w1"]["pool"] == "cpu"
    assert (q["w1"]["owner"], q["w1"]["name"], q["w1"]["client"]) == ("alice", "worker-3", "3fa2b1")
    assert q["w1"]["reason_code"] == "busy"  # the core's "unschedulable": in use, it will run
    assert not q["w1"]["reason"].startswith("unschedulable")
    assert "requested 4, free 2 of 16" in q["w1"]["reason"]
    assert q["w2"]["client"] == "9e8d7c" and q["w2"]["owner"] == ""
    (node,) = r["nodes"]
    assert node["gpu_mem_mib"] == 16384 and node["gpu_mem_total_mib"] == 32768
    apis = {a["api"]: a for a in r["apis"]}
    assert apis["llm"]["period_s"] == 60.0 and apis["llm"]["used"] == 1
    assert "period_s" not in apis["search"]
    assert r["cluster"]["running"] == 15  # 14 execs and the lease
    assert {a["name"] for a in r["actions"]} == {"worker-3"}


# ---------------------------------------------------------------- the tables, through `tangram status`



@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path / "home"))
    for var in ("TANGRAM_ADDR", "TANGRAM_CLUSTER", "TANGRAM_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # tangram controller"])
    servers: list[FakeStatus] = []

    def start(records: dict[str, Any]) -> None:
        server = FakeStatus(json.loads(json.dumps(records)))  # as it travels: plain JSON values
        servers.append(server)
        with st.locked("fake"):
            st.write(st.ClusterState(name="fake", controller_pid=pid.pid, ports={"status": server.port}))

    yield start
    for s in servers:
        s.close()
    pid.kill()
    pid.wait(5)


def status(*args: str) -> str:
    r = CliRunner().invoke(cli, ["status", "-c", "fake", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


def row_of(out: str, first_cell: str) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == [first_cell])


def test_queue_shows_sandbox_and_client_name_not_pool_or_identity(serve: Any) -> None:
    serve(cluster_records())
    out = status()
    w1 = row_of(out, "w1")
    assert "sb-7" in w1 and " cpu " not in w1
    assert "alice/worker-3 (3fa2b1)" in w1
    w2 = row_of(out, "w2")
    assert "9e8d7c" in w2 and KEY not in out and NOBODY not in out and NOBODY[:12] not in out


def test_running_actions_show_by_default_bounded_with_a_count(serve: Any) -> None:
    serve(cluster_records(running=14))
    out = status()
    shown = [
        line for line in out.splitlines() if line.split()[:1] and line.split()[0].startswith(("r", "l1"))
    ]
    running = [line for line in shown if " R " in line]
    assert len(running) == rs.RUNNING_SHOWN
    assert "cores " in running[0] and "n1" in running[0]
    assert f"{15 - rs.RUNNING_SHOWN} more running" in out
    assert "running 15" in out.splitlines()[0]
    every = status("-a")
    assert len([line for line in every.splitlines() if " R " in line]) == 15
    assert "more running" not in every
    lease = row_of(every, "l1")
    assert "lease" in lease and "1 unit" in lease


def test_busy_is_waiting_and_only_never_fits_is_unschedulable(serve: Any) -> None:
    records = cluster_records()
    never = {
        **records["queue"][0],
        "action": "w9",
        "reason_code": "never_fits",
        "reason": "cpu: requested 64",
    }
    records["queue"].append(never)
    old = {**records["queue"][0], "action": "w8", "reason": "unschedulable; cpu: requested 4, free 2 of 16"}
    del old["reason_code"]  # an older controller's row
    records["queue"].append(old)
    serve(records)
    out = status()
    assert "waiting (cpu: requested 4, free 2 of 16" in row_of(out, "w1")
    assert "unschedulable" not in row_of(out, "w1")
    assert "unschedulable (cpu: requested 64)" in row_of(out, "w9")
    assert "waiting (cpu: requested 4" in row_of(out, "w8")


def test_gpu_memory_is_used_over_total(serve: Any) -> None:
    records = cluster_records()
    records["nodes"][0]["gpu_mem_used_mib"] = [1024, 512]
    serve(records)
    out = status("--nodes")
    assert "GPU MEM(u/t)" in out
    assert "1.5GiB/32GiB" in row_of(out, "n1")


def test_api_rows_render_the_period_and_concurrency(serve: Any) -> None:
    serve(cluster_records())
    out = status("--apis")
    assert "1/3000 per 60s" in row_of(out, "llm")
    assert "per -" not in out
    assert "0/16 concurrent" in row_of(out, "search")


def test_period_text() -> None:
    assert [rs.period_text(s) for s in (60, 1, 0.5, 90, 300, 3600, 7200, 86400)] == [
        "60s",
        "1s",
        "500ms",
        "90s",
        "5m",
        "1h",
        "2h",
        "24h",
    ]
