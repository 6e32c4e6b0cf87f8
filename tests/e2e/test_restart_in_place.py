"""Restart in place (issue 10): `tangram up` after the controller was killed brings it back on the
recorded bind address and ports, keeps the agent that survived (it reconnects by itself), starts
one that died, and a client made before the crash works again. A recorded port held by another
process is a typed error (PortTaken) naming the port, never a silent move to new ports.

Real processes: `tangram up` starts the controller and the agent detached, `kill -9` crashes them,
the client talks over loopback. TANGRAM_HOME is a temporary directory; the process executor keeps
the test off any shared dockerd. Waits are bounded; assertions are on counts and identities.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import tangram
from tangram.errors import TangramError
from tests.e2e import test_up_local

alive = test_up_local.alive

UP = ("up", "--executor", "process", "--gpus", "1", "--gpu-mem", "1GiB")


def tangram_cli(*args: str, home: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return test_up_local.tangram(*args, home=home, timeout=timeout)


def exited(pid: int) -> bool:
    """Gone, or a zombie whose every thread has exited (so its sockets are closed too: a zombie
    thread-group leader can still have threads releasing its file descriptors)."""
    if not alive(pid):
        try:
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except OSError:
            return True
    return False


def kill9(*pids: int) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not all(exited(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(exited(p) for p in pids)


def agent_processes(home: Path) -> list[int]:
    """Pids of agents started from this cluster's agent.json (there must never be two)."""
    marker = str(home / "clusters" / "local" / "agent" / "agent.json").encode()
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"agent" in cmd and marker in cmd and alive(int(d.name)):
                found.append(int(d.name))
    return found


def read_state(home: Path) -> dict:
    return json.loads((home / "clusters" / "local" / "state.json").read_text())


def healthy_agents(home: Path) -> int:
    st = tangram_cli("status", "-o", "json", home=home, timeout=60)
    assert st.returncode == 0, st.stdout + st.stderr
    return int(json.loads(st.stdout)["agents_healthy"])


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A TANGRAM_HOME whose local cluster is brought down (and its processes gone) afterwards."""
    h = tmp_path / "home"
    yield h
    down = tangram_cli("down", "--force", home=h, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 15
    while agent_processes(h) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent_processes(h) == []


# ---------------------------------------------------------------- port checks (no cluster)


def test_port_taken_names_the_port_and_its_holder() -> None:
    from tangram_cli import state as st
    from tangram_cli.bootstrap import restart

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        state = st.ClusterState(name="x", bind="127.0.0.1", ports={"agents": 0, "submit": port, "status": 0})
        with pytest.raises(restart.PortTaken) as info:
            restart.check_ports_free(state)
        err = info.value
        assert (err.port, err.role) == (port, "submit")
        assert f"submit port {port}" in err.message
        assert f"pid {os.getpid()}" in str(err.owner)
        assert "tangram down" in str(err.hint)
        assert err.exit_code == 1
    restart.check_ports_free(state)  # released: nothing raised


# ---------------------------------------------------------------- real clusters


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_up_after_controller_kill_restarts_on_the_same_ports(home: Path) -> None:
    up = tangram_cli(*UP, home=home)
    assert up.returncode == 0, up.stdout + up.stderr
    before = read_state(home)
    agent_pid = before["hosts"][0]["pid"]
    # the local default runs CURVE: this process's TANGRAM_HOME is not `home`, so name its keys
    client = tangram.Client(
        before["address"], heartbeat_s=0.5, connect_timeout=30, certs=before["certs"] or None
    )
    try:
        with client.sandbox() as env:
            assert env.exec("echo before", cpus=1, timeout=60).stdout.strip() == "before"
        env = client.sandbox()  # stays open across the crash
        in_flight = client.submit(env.exec, "sleep 3; echo late", cpus=1, timeout=30)
        time.sleep(0.5)

        kill9(before["controller_pid"])
        again = tangram_cli("up", home=home)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "controller restarted on the same ports" in again.stdout
        assert "agent local: still running" in again.stdout
        after = read_state(home)
        assert after["ports"] == before["ports"]
        assert after["address"] == before["address"]
        assert after["controller_pid"] != before["controller_pid"]
        assert after["hosts"][0]["pid"] == agent_pid
        assert alive(agent_pid)
        assert agent_processes(home) == [agent_pid]  # no second agent for the node
        assert healthy_agents(home) == 1
        journal = (home / "clusters" / "local" / "journal").read_text().splitlines()
        assert sum('"journal":"tangram"' in line for line in journal) == 2  # appended: a header per run
        assert (home / "clusters" / "local" / "state.jsonl").exists()

        # The request in flight ends (a result or a typed error), within bounds; a new one succeeds.
        with contextlib.suppress(TangramError):
            in_flight.result(timeout=90)
        with contextlib.suppress(TangramError):
            env.close()
        with client.sandbox() as env2:
            assert env2.exec("echo after", cpus=1, timeout=60).stdout.strip() == "after"

        noop = tangram_cli("up", home=home)  # a healthy cluster: `up` changes nothing
        assert noop.returncode == 0, noop.stdout + noop.stderr
        assert "already running" in noop.stdout
        assert read_state(home)["controller_pid"] == after["controller_pid"]
        assert agent_processes(home) == [agent_pid]
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recorded_port_taken_is_a_typed_error_then_restart_brings_dead_agent_back(home: Path) -> None:
    up = tangram_cli(*UP, home=home)
    assert up.returncode == 0, up.stdout + up.stderr
    before = read_state(home)
    port = before["ports"]["submit"]
    kill9(before["controller_pid"], before["hosts"][0]["pid"])

    # The recorded pid now belongs to an unrelated program: it is neither the controller nor signalled.
    other = subprocess.Popen(["sleep", "120"])
    try:
        raw = read_state(home)
        raw["controller_pid"] = other.pid
        (home / "clusters" / "local" / "state.json").write_text(json.dumps(raw))
        with socket.socket() as held:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("127.0.0.1", port))
            held.listen(1)
            refused = tangram_cli("up", home=home)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"submit port {port} on 127.0.0.1 is taken by" in refused.stderr
        assert "To fix:" in refused.stderr
        assert "tangram down" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert read_state(home)["ports"] == before["ports"]  # not moved to new ports
        assert agent_processes(home) == []

        again = tangram_cli("up", home=home)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "controller restarted on the same ports" in again.stdout
        assert "agent local: restarted" in again.stdout
        assert alive(other.pid)
    finally:
        other.kill()
        other.wait(10)
    after = read_state(home)
    assert after["ports"] == before["ports"]
    assert agent_processes(home) == [after["hosts"][0]["pid"]]
    assert healthy_agents(home) == 1


@pytest.mark.ssh
@pytest.mark.timeout(300)
def test_inventory_up_after_controller_kill_keeps_agents(sshd_factory, ssh_key, tmp_path: Path) -> None:
    """The same over SSH: the controller runs on this machine; the nodes' agents are kept."""
    from .test_up_ssh import agent_pids, write_inventory
    from .test_up_ssh import tangram as tangram_ssh

    a, b = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cluster = f"loop-{uuid.uuid4().hex[:8]}"
    h = tmp_path / "home"
    inv = write_inventory(tmp_path, ssh_key.path, (a.port, b.port), cluster)
    state_file = h / "clusters" / cluster / "state.json"
    try:
        up = tangram_ssh("up", str(inv), "--timeout", "60s", home=h)
        assert up.returncode == 0, up.stdout + up.stderr
        before = json.loads(state_file.read_text())
        agents = sorted(agent_pids(tmp_path / "nodes"))
        assert len(agents) == 2

        kill9(before["controller_pid"])
        again = tangram_ssh("up", str(inv), "--timeout", "60s", home=h)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "controller restarted on the same ports" in again.stderr
        assert again.stdout.count("ok (running)") == 2
        assert "2/2 agents registered" in again.stdout
        after = json.loads(state_file.read_text())
        assert after["ports"] == before["ports"]
        assert after["controller_pid"] != before["controller_pid"]
        assert sorted(agent_pids(tmp_path / "nodes")) == agents
    finally:
        down = tangram_ssh("down", str(inv), home=h)
    assert down.returncode == 0, down.stdout + down.stderr
