"""`tangram status` NODES shows each node's warm sandbox pool (issue 14): a real in-process controller
sizes the pools (`sandbox_pool`, tangram_cli/controller/pools.py), fake agents on real ZeroMQ sockets
say in their Hello that they keep pools and report their idle pooled sandboxes in heartbeats, and
`tangram status` (a subprocess reading the controller's real status socket) shows idle over target per
node, in its table and in `-o json`; a cluster without pools gets no POOL column at all."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import tangram
from support.waiting import until

from tangram_cli import state as st
from tangram_cli.controller.daemon import Controller

from .conftest import CONFIG

pytestmark = pytest.mark.timeout(120)

POOL_FACTS = {"pool": [], "image": "tangram/hostroot:1", "sandbox_mem_mib": 1024, "mem_mib": 65536}
POOL_HEAD = "POOL(idle/target)"


@pytest.fixture
def status_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``await status_cli(controller, *args)``: the stdout of `tangram status -c pools ARGS` run against
    ``controller``'s status socket. A cluster state in a private TANGRAM_HOME names that port; its
    controller pid is a stand-in process (`status` checks only that it lives)."""
    home = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_HOME", str(home))
    pid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # tangram controller"])

    async def run(c: Controller, *args: str) -> str:
        with st.locked("pools"):
            st.write(st.ClusterState(name="pools", controller_pid=pid.pid, ports={"status": c.status_port}))
        done = await asyncio.to_thread(tangram, "status", "-c", "pools", *args, home=home, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    yield run
    pid.kill()
    pid.wait(5)


def node_table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """The NODES table of `tangram status` output: its header cells and each row's cells by node."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["NODE"])
    head = lines[at].split()
    body = {}
    for line in lines[at + 1:]:
        cells = line.split()
        if cells and set(cells[0]) == {"─"}:  # the rule under the header
            continue
        if not cells or cells[0] in ("SERVICE", "API", "ACTION", "JOB"):
            break
        body[cells[0]] = cells
    return head, body


async def test_a_node_with_a_pool_shows_idle_over_target(controllers, make_agent, status_cli) -> None:
    c = await controllers({**CONFIG, "sandbox_pool": {"min": 2, "max": 4}})
    pooled = await make_agent(c, "n1", cpus=(0, 1), facts_extra=POOL_FACTS)
    pooled.load = {"pool_idle": 1, "pool_mem_mib": 1024}  # one warm sandbox ready of the 2 it is told
    await make_agent(c, "n2", cpus=(0, 1))  # keeps no pools
    await until(lambda: ("", 0, 2) in pooled.pool_targets, what="n1's pool target")
    await until(lambda: c.agents.agents["n1"].load.get("pool_idle") == 1, what="n1's heartbeat load")

    head, body = node_table(await status_cli(c))
    assert POOL_HEAD in head
    col = head.index(POOL_HEAD)
    assert head[col - 1] == "SANDBOXES(busy/open)"  # beside the sandboxes it feeds
    assert body["n1"][col] == "1/2" and body["n2"][col] == "-"

    nodes = {r["node"]: r for r in json.loads(await status_cli(c, "-o", "json"))["records"]["nodes"]}
    assert (nodes["n1"]["pool_idle"], nodes["n1"]["pool_target"], nodes["n1"]["pool_mem_mib"]) == (1, 2, 1024)
    assert (nodes["n2"]["pool_idle"], nodes["n2"]["pool_target"]) == (0, 0)

    pooled.load = {"pool_idle": 2, "pool_mem_mib": 2048}  # the pool filled: the next status says so
    await until(lambda: c.agents.agents["n1"].load.get("pool_idle") == 2, what="n1's next heartbeat")
    head, body = node_table(await status_cli(c))
    assert body["n1"][head.index(POOL_HEAD)] == "2/2"


async def test_a_cluster_without_pools_shows_no_pool_column(controllers, make_agent, status_cli) -> None:
    c = await controllers()  # pools off: the agent that could keep them is told 0
    agent = await make_agent(c, "n1", cpus=(0, 1), facts_extra=POOL_FACTS)
    await make_agent(c, "n2", cpus=(0, 1))
    await asyncio.sleep(0.5)  # heartbeats arrived (empty loads)
    assert agent.pool_targets == []
    out = await status_cli(c)
    head, body = node_table(out)
    assert set(body) == {"n1", "n2"}
    assert "POOL" not in out and not any(h.startswith("POOL") for h in head)
    nodes = json.loads(await status_cli(c, "-o", "json"))["records"]["nodes"]
    assert [(r["node"], r["pool_target"], r["pool_idle"]) for r in nodes] == [("n1", 0, 0), ("n2", 0, 0)]
