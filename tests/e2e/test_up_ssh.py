"""`tangram up INVENTORY` / `status` / `down` over real SSH: two sshd "nodes" on 127.0.0.2 and .3.

The inventory (tests/data/loopback.yaml, filled in per test) names the two as nodes with one core
each ("0" and "1") and emulated GPUs, process executor. Everything runs for real: asyncssh to
OpenSSH, SFTP upload of the bundle, venv install, detached agents, the controller subprocess,
a client running actions on both nodes, and `down` stopping it all.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

CLI = [sys.executable, "-c", "from tangram_cli.main import cli; cli()"]
TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "loopback.yaml"

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(240)]


def tangram(*args: str, home: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TANGRAM_HOME": str(home), "NO_COLOR": "1"}
    env.pop("TANGRAM_ADDR", None)
    env.pop("TANGRAM_INVENTORY", None)
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def refused_port(host: str) -> int:
    """A port on ``host`` where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_inventory(tmp: Path, key: Path, ports: tuple[int, int], cluster: str, extra: str = "") -> Path:
    text = TEMPLATE.read_text().format(
        cluster=cluster,
        key=key,
        python=sys.executable,
        port_a=ports[0],
        port_b=ports[1],
        work=tmp / "nodes",
        extra_hosts=extra,
    )
    path = tmp / "loopback.yaml"
    path.write_text(text)
    return path


def agent_pids(work: Path) -> list[int]:
    alive = []
    for pidfile in work.glob("*/*/agent.pid"):
        try:
            pid = int(pidfile.read_text().strip())
            os.kill(pid, 0)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (ValueError, OSError):
            continue
        if b"agent" in cmd:
            alive.append(pid)
    return alive


def labelled_containers(cluster: str) -> int:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
    except Exception:  # noqa: BLE001 - no docker: nothing can be labelled
        return 0
    try:
        return len(client.containers.list(all=True, filters={"label": [f"tangram.cluster={cluster}"]}))
    finally:
        client.close()


async def run_on_both(addr: str, certs: str) -> list[tuple[str, tuple[int, ...]]]:
    import tangram

    async with tangram.AsyncClient(addr, name="e2e-ssh", certs=certs) as tg:

        async def one(i: int) -> tuple[str, tuple[int, ...]]:
            async with tg.sandbox() as env:
                r = await env.exec(f"sleep 0.5; echo {i}", cpus=1, timeout=60)
                assert r.exit_code == 0, r.stderr
                assert r.stdout.strip() == str(i)
                return r.node, r.cores

        return list(await asyncio.gather(*(one(i) for i in range(4))))


def test_up_status_down_two_nodes(sshd_factory, ssh_key, tmp_path: Path) -> None:
    a, b = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cluster = f"loop-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    inv = write_inventory(tmp_path, ssh_key.path, (a.port, b.port), cluster)

    dry = tangram("up", str(inv), "--dry-run", home=home)
    assert dry.returncode == 0, dry.stderr
    assert "node-a" in dry.stdout
    assert "node-b" in dry.stdout
    assert "install" in dry.stdout

    up = tangram("up", str(inv), "--timeout", "60s", home=home)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "2/2 agents registered" in up.stdout
    assert "Traceback" not in up.stderr
    state = json.loads((home / "clusters" / cluster / "state.json").read_text())
    addr = state["address"]
    certs = state["certs"]  # `up INVENTORY` always runs CURVE
    assert f"export TANGRAM_CERTS={certs}" in up.stdout
    node_dir = tmp_path / "nodes"
    shipped = sorted(p.name for p in node_dir.rglob("*.key*"))
    assert shipped == ["agent.key_secret", "agent.key_secret", "controller.key", "controller.key"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in node_dir.rglob("*.key*"))
    assert not list(node_dir.rglob("client.key_secret"))  # nodes get only their own secret

    try:
        used = asyncio.run(run_on_both(addr, certs))
        assert {n for n, _ in used} == {"node-a", "node-b"}
        assert {c for n, c in used if n == "node-a"} == {(0,)}
        assert {c for n, c in used if n == "node-b"} == {(1,)}

        st = tangram("status", "-c", cluster, "-o", "json", home=home)
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        nodes = {r["node"]: r for r in doc["records"]["nodes"]}
        assert set(nodes) == {"node-a", "node-b"}
        assert all(r["cpus_total"] == 1 for r in nodes.values())
        assert doc["agents_healthy"] == 2

        env = tangram("env", "-c", cluster, home=home)
        assert f"export TANGRAM_CERTS={certs}" in env.stdout

        async def without_keys() -> None:
            import tangram as tg

            await tg.AsyncClient(addr, name="nokeys", certs=None, connect_timeout=1.0).connect()

        with pytest.raises(Exception, match="requires CURVE keys"):  # NULL client: refused by CURVE, at once
            asyncio.run(without_keys())

        table = tangram("status", "-c", cluster, home=home)
        assert table.returncode == 0
        assert "node-a" in table.stdout
        assert "node-b" in table.stdout

        again = tangram("up", str(inv), "--timeout", "60s", home=home)  # changes nothing
        assert again.returncode == 0, again.stderr
        assert again.stdout.count("ok (running)") == 2
        assert (
            json.loads((home / "clusters" / cluster / "state.json").read_text())["controller_pid"]
            == (state["controller_pid"])
        )
    finally:
        down = tangram("down", str(inv), home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while agent_pids(tmp_path / "nodes") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert agent_pids(tmp_path / "nodes") == []
    assert labelled_containers(cluster) == 0
    assert not (home / "clusters" / cluster / "state.json").exists()
    second = tangram("down", str(inv), home=home)
    assert second.returncode == 0
    assert "nothing is running" in second.stdout


def test_refused_host_is_partial_with_reason(sshd_factory, ssh_key, tmp_path: Path) -> None:
    a, b = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cluster = f"loop-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    dead = refused_port("127.0.0.4")
    extra = (
        f"      - {{host: 127.0.0.4, name: node-c, ssh: {{port: {dead}}}, "
        f'vars: {{cpus: "0", workdir: {tmp_path}/nodes/node-c}}}}'
    )
    inv = write_inventory(tmp_path, ssh_key.path, (a.port, b.port), cluster, extra)
    try:
        up = tangram("up", str(inv), "--allow-partial", "--timeout", "60s", home=home)
        assert up.returncode == 3, up.stdout + up.stderr
        assert "node-c" in up.stdout
        assert "connection refused" in up.stdout
        assert "2/3 agents registered" in up.stdout
        assert "Traceback" not in up.stderr
        strict = tangram("up", str(inv), "--timeout", "30s", home=home)  # without --allow-partial
        assert strict.returncode == 1
        assert "connection refused" in strict.stdout
    finally:
        down = tangram("down", "-c", cluster, home=home)
    assert down.returncode == 0, down.stdout + down.stderr  # node-c never ran an agent
    assert agent_pids(tmp_path / "nodes") == []


def test_down_stops_agents_by_pidfile_when_controller_is_gone(sshd_factory, ssh_key, tmp_path: Path) -> None:
    import signal

    a, b = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cluster = f"loop-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    inv = write_inventory(tmp_path, ssh_key.path, (a.port, b.port), cluster)
    up = tangram("up", str(inv), "--timeout", "60s", home=home)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((home / "clusters" / cluster / "state.json").read_text())
    assert len(agent_pids(tmp_path / "nodes")) == 2
    os.kill(state["controller_pid"], signal.SIGKILL)  # the controller dies: nobody tells the agents
    time.sleep(0.5)
    down = tangram("down", "-c", cluster, home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stale state" in down.stdout
    assert "node-a: agent stopped by pidfile" in down.stdout
    assert "node-b: agent stopped by pidfile" in down.stdout
    assert agent_pids(tmp_path / "nodes") == []
