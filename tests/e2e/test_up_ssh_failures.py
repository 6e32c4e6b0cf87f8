"""`tangram up INVENTORY` when things fail (issue 12): the reason reaches the user, `--dry-run`
catches what it can on this machine, nothing is left half-running, and `status` shows the hosts
that failed. Real processes throughout: the `tangram` CLI, the controller subprocess, and real
sshd "nodes" on 127.0.0.x (tests/support/sshd.py) where a host must be reached.
"""

from __future__ import annotations

import errno
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
NOT_LOCAL = "203.0.113.7"  # TEST-NET-3: never an address of the test machine

pytestmark = [pytest.mark.timeout(240)]


def tangram(*args: str, home: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TANGRAM_HOME": str(home), "NO_COLOR": "1"}
    for name in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER"):
        env.pop(name, None)
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def refused_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def need_not_local() -> None:
    """Skip where NOT_LOCAL can be bound (ip_nonlocal_bind, or the address is assigned here)."""
    try:
        with socket.socket() as s:
            s.bind((NOT_LOCAL, 0))
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            return
    pytest.skip(f"{NOT_LOCAL} can be bound on this machine")


def write_inventory(tmp: Path, cluster: str, hosts: list[str], *, key: str, bind: str = "127.0.0.1") -> Path:
    lines = [
        "version: 1",
        f"cluster: {cluster}",
        "defaults:",
        f"  ssh: {{user: root, identity_file: {key}, host_key_policy: accept-new, connect_timeout: 5s}}",
        f"  python: {sys.executable}",
        "controller:",
        f"  bind: {bind}",
        # fixed ports off loopback (the inventory requires them); never bound where the address is not local
        "  ports: {agents: 0, submit: 0, status: 0}"
        if bind == "127.0.0.1"
        else "  ports: {agents: 47700, submit: 47701, status: 47702}",
        "groups:",
        "  loop:",
        "    role: gpu",
        "    hosts:",
        *(f"      - {h}" for h in hosts),
        "    vars: {executor: process, gpus: 2, emulated_gpus: true, gpu_mem: 16GiB}",
    ]
    path = tmp / f"{cluster}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def host(name: str, addr: str, port: int, cpus: str, work: Path, **ssh: str) -> str:
    extra = "".join(f", {k}: {v}" for k, v in ssh.items())
    node_vars = f'{{cpus: "{cpus}", workdir: {work}/{name}}}'
    return f"{{host: {addr}, name: {name}, ssh: {{port: {port}{extra}}}, vars: {node_vars}}}"


def controllers_of(home: Path, cluster: str) -> list[int]:
    """Pids of processes running this cluster's controller (their argv names its controller.json)."""
    marker = str(home / "clusters" / cluster / "controller.json").encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_dry_run_refuses_a_controller_address_that_is_not_local(ssh_key, tmp_path: Path) -> None:
    need_not_local()
    cluster = f"nl-{uuid.uuid4().hex[:8]}"
    inv = write_inventory(
        tmp_path,
        cluster,
        [host("node-a", "127.0.0.2", refused_port("127.0.0.2"), "0", tmp_path)],
        key=str(ssh_key.path),
        bind=NOT_LOCAL,
    )
    dry = tangram("up", str(inv), "--dry-run", home=tmp_path / "home")
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert f"controller.bind: {NOT_LOCAL} is not an address of this machine" in dry.stderr
    assert "127.0.0.1" in dry.stderr  # what to write instead
    assert "identity_file" not in dry.stderr  # the key exists: only the bind is reported
    assert "Traceback" not in dry.stderr
    assert "bootstrap plan" in dry.stdout  # the plan is still printed
    assert controllers_of(tmp_path / "home", cluster) == []


def test_dry_run_names_a_missing_or_unusable_identity_file(ssh_key, tmp_path: Path) -> None:
    cluster = f"idf-{uuid.uuid4().hex[:8]}"
    missing = tmp_path / "no-such-key"
    a_dir = tmp_path / "a-directory"
    a_dir.mkdir()
    hosts = [
        host("node-a", "127.0.0.2", 22, "0", tmp_path),
        host("node-b", "127.0.0.3", 22, "1", tmp_path, identity_file=str(a_dir)),
    ]
    inv = write_inventory(tmp_path, cluster, hosts, key=str(missing))
    dry = tangram("up", str(inv), "--dry-run", home=tmp_path / "home")
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert f"defaults.ssh.identity_file: {missing} does not exist (used by node-a)" in dry.stderr
    assert f"groups.loop.hosts[1].ssh.identity_file: {a_dir} is not a file (used by node-b)" in dry.stderr
    assert "controller.bind" not in dry.stderr  # 127.0.0.1 is local
    assert "Traceback" not in dry.stderr

    good = write_inventory(tmp_path, cluster, hosts[:1], key=str(ssh_key.path))
    ok = tangram("up", str(good), "--dry-run", home=tmp_path / "home")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_up_shows_the_bind_reason_and_leaves_no_controller(ssh_key, tmp_path: Path) -> None:
    need_not_local()
    cluster = f"nl-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    inv = write_inventory(
        tmp_path,
        cluster,
        [host("node-a", "127.0.0.2", refused_port("127.0.0.2"), "0", tmp_path)],
        key=str(ssh_key.path),
        bind=NOT_LOCAL,
    )
    up = tangram("up", str(inv), "--timeout", "20s", home=home)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "the controller exited with status 2 during start" in up.stderr
    assert f"cannot bind {NOT_LOCAL}: Cannot assign requested address" in up.stderr  # the log's reason
    assert f"the controller's address {NOT_LOCAL} is not an address of this machine" in up.stderr
    assert "set controller.bind in the inventory to one of this machine's addresses" in up.stderr
    assert "Traceback" not in up.stderr
    log = (home / "clusters" / cluster / "logs" / "controller.log").read_text()
    assert "Cannot assign requested address" in log
    assert "AttributeError" not in log
    assert "Traceback" not in log
    assert controllers_of(home, cluster) == []
    st = tangram("status", "-c", cluster, home=home)
    assert st.returncode == 4  # nothing recorded as running


@pytest.mark.ssh
def test_every_host_failing_stops_the_controller_and_status_lists_them(
    sshd_factory, ssh_key, tmp_path: Path
) -> None:
    a = sshd_factory("127.0.0.2")
    cluster = f"fail-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    hosts = [
        host("node-a", "127.0.0.2", a.port, "0", tmp_path).replace(
            "vars: {", "vars: {python: /nonexistent/python3, "
        ),
        host("node-b", "127.0.0.4", refused_port("127.0.0.4"), "1", tmp_path),
    ]
    inv = write_inventory(tmp_path, cluster, hosts, key=str(ssh_key.path))
    up = tangram("up", str(inv), "--timeout", "20s", home=home)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "0/2 agents registered (the controller was stopped)" in up.stdout
    assert "stopped the controller" in up.stderr
    assert "tangram down" not in up.stderr  # nothing is left to stop
    assert "Traceback" not in up.stderr
    deadline = time.monotonic() + 10
    while controllers_of(home, cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert controllers_of(home, cluster) == []
    state = json.loads((home / "clusters" / cluster / "state.json").read_text())
    assert state["controller_pid"] is None and state["hosts"] == []
    assert {f["node"]: f["step"] for f in state["failed"]} == {"node-a": "probe", "node-b": "connect"}

    table = tangram("status", "-c", cluster, home=home)
    assert table.returncode == 4, table.stdout + table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line.startswith("node-")}
    assert set(rows) == {"node-a", "node-b"}
    assert "failed" in rows["node-a"] and "`up` failed at probe" in rows["node-a"]
    assert "failed" in rows["node-b"] and "connection refused" in rows["node-b"]
    assert "failed on every host and stopped the controller" in table.stderr
    doc = json.loads(tangram("status", "-c", cluster, "-o", "json", home=home).stdout)
    assert doc["running"] is False
    assert {r["node"]: r["state"] for r in doc["records"]["nodes"]} == {
        "node-a": "failed",
        "node-b": "failed",
    }

    down = tangram("down", "-c", cluster, home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (home / "clusters" / cluster / "state.json").exists()


@pytest.mark.ssh
def test_partial_failure_keeps_the_cluster_and_status_shows_the_failed_host(
    sshd_factory, ssh_key, tmp_path: Path
) -> None:
    a = sshd_factory("127.0.0.2")
    cluster = f"part-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    hosts = [
        host("node-a", "127.0.0.2", a.port, "0", tmp_path),
        host("node-c", "127.0.0.4", refused_port("127.0.0.4"), "1", tmp_path),
    ]
    inv = write_inventory(tmp_path, cluster, hosts, key=str(ssh_key.path))
    try:
        up = tangram("up", str(inv), "--allow-partial", "--timeout", "90s", home=home)
        assert up.returncode == 3, up.stdout + up.stderr
        assert "1/2 agents registered" in up.stdout
        assert "stopped the controller" not in up.stderr
        assert len(controllers_of(home, cluster)) == 1

        doc = json.loads(tangram("status", "-c", cluster, "-o", "json", home=home).stdout)
        nodes = {r["node"]: r for r in doc["records"]["nodes"]}
        assert set(nodes) == {"node-a", "node-c"}
        assert nodes["node-c"]["state"] == "failed"
        assert "connection refused" in nodes["node-c"]["reason"]
        assert (doc["agents_healthy"], doc["agents_total"]) == (1, 2)
        table = tangram("status", "-c", cluster, home=home)
        assert table.returncode == 0, table.stderr
        assert "agents 1/2" in table.stdout
        row = next(line for line in table.stdout.splitlines() if line.lstrip().startswith("node-c"))
        assert "failed" in row and "`up` failed at connect" in row
    finally:
        down = tangram("down", "-c", cluster, home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert controllers_of(home, cluster) == []
