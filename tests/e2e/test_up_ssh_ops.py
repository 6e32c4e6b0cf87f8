"""Operating SSH nodes (issue 13, part 1), over real sshd "nodes" on 127.0.0.x and the real
`tangram` CLI: purge from the inventory alone, bootstrap and registration counted apart,
progress and retries, host-key changes, what a failed `up` leaves running, local-only flags,
and a no-op `up` that only logs in and checks. Asserts counts, exit codes and text, never
timings (docs/operations.md has the measurements, from tools/ssh_fleet.py).
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.test_up_ssh import agent_pids
from e2e.test_up_ssh_failures import controllers_of, host, refused_port, tangram, write_inventory

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(300)]

SECRETS = ("agent.key_secret", "controller.key")


def left_on_nodes(nodes: Path) -> list[str]:
    """Every file still under the node workdirs (relative paths)."""
    return (
        sorted(str(p.relative_to(nodes)) for p in nodes.rglob("*") if p.is_file()) if nodes.exists() else []
    )


def wait_no_agents(nodes: Path, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while agent_pids(nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return agent_pids(nodes)


def fingerprint(public_key: str) -> str:
    import asyncssh

    return asyncssh.import_public_key(public_key).get_fingerprint("sha256")


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.5 that accepts TCP connections (the kernel's backlog) and never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.5", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


def two_nodes(sshd_factory, ssh_key, tmp_path: Path, prefix: str, extra: list[str] = ()):
    a, b = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cluster = f"{prefix}-{uuid.uuid4().hex[:8]}"
    nodes = tmp_path / "nodes"
    hosts = [
        host("node-a", "127.0.0.2", a.port, "0", nodes),
        host("node-b", "127.0.0.3", b.port, "1", nodes),
        *extra,
    ]
    return a, b, cluster, nodes, write_inventory(tmp_path, cluster, hosts, key=str(ssh_key.path))


def by_node(doc: dict) -> dict[str, dict]:
    return {h["node"]: h for h in doc["hosts"]}


# ---------------------------------------------------------------- 1. purge


def test_purge_after_plain_down_reaches_the_nodes_and_never_strands_secrets(
    sshd_factory, ssh_key, tmp_path: Path
) -> None:
    a, b, cluster, nodes, inv = two_nodes(sshd_factory, ssh_key, tmp_path, "purge")
    home = tmp_path / "home"
    cdir = home / "clusters" / cluster
    try:
        up = tangram("up", str(inv), "--timeout", "90s", home=home)
        assert up.returncode == 0, up.stdout + up.stderr
        down = tangram("down", str(inv), home=home)
        assert down.returncode == 0, down.stdout + down.stderr
        assert wait_no_agents(nodes) == []
        kept = left_on_nodes(nodes)
        assert sum(p.endswith(SECRETS) for p in kept) == 4  # each node keeps its key and the controller's

        # the footprint outlives state.json: `down -c NAME --purge`, no inventory, but one node is down
        b.stop()
        partial = tangram("down", "-c", cluster, "--purge", home=home)
        assert partial.returncode == 3, partial.stdout + partial.stderr
        assert "node-a: removed" in partial.stdout
        assert f"kept {cdir}: node-b could not be purged" in partial.stdout
        assert f"`tangram down -c {cluster} --purge`" in partial.stdout
        assert (cdir / "certs").is_dir()  # local state kept while node-b holds the cluster's files
        assert [h["name"] for h in json.loads((cdir / "nodes.json").read_text())["hosts"]] == ["node-b"]
        assert not any(p.startswith("node-a") for p in left_on_nodes(nodes))

        b.start()
        again = tangram("down", "-c", cluster, "--purge", home=home)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "node-b: removed" in again.stdout
        assert left_on_nodes(nodes) == []
        assert not cdir.exists()
    finally:
        tangram("down", "-c", cluster, home=home)


def test_purge_from_the_inventory_alone_when_local_state_is_gone(
    sshd_factory, ssh_key, tmp_path: Path
) -> None:
    import shutil

    _a, _b, cluster, nodes, inv = two_nodes(sshd_factory, ssh_key, tmp_path, "inv")
    home = tmp_path / "home"
    up = tangram("up", str(inv), "--timeout", "90s", home=home)
    assert up.returncode == 0, up.stdout + up.stderr
    assert tangram("down", str(inv), home=home).returncode == 0
    shutil.rmtree(home / "clusters" / cluster)  # every local record lost (known_hosts stays)
    assert sum(p.endswith(SECRETS) for p in left_on_nodes(nodes)) == 4

    purge = tangram("down", str(inv), "--purge", home=home)
    assert purge.returncode == 0, purge.stdout + purge.stderr
    assert "purging what `up` left on 2 node(s)" in purge.stdout
    assert left_on_nodes(nodes) == []
    assert agent_pids(nodes) == []


def test_purge_refuses_to_strand_keys_of_nodes_it_cannot_find(tmp_path: Path) -> None:
    home = tmp_path / "home"
    agents = home / "clusters" / "legacy" / "certs" / "agents"  # as an `up` before footprints left it
    agents.mkdir(parents=True)
    (agents / "agent-gpu-01.key").write_text("public\n")
    down = tangram("down", "-c", "legacy", "--purge", home=home)
    assert down.returncode == 1, down.stdout + down.stderr
    assert "cannot purge cluster 'legacy': nodes gpu-01 may hold its keys" in down.stderr
    assert "`tangram down INVENTORY --purge`" in down.stderr
    assert agents.is_dir()


# ---------------------------------------------------------------- 2 and 4. host key changed


def test_changed_host_key_counts_the_registered_agent_and_says_how_to_accept(
    sshd_factory, ssh_key, tmp_path: Path
) -> None:
    _a, b, cluster, nodes, inv = two_nodes(sshd_factory, ssh_key, tmp_path, "hk")
    home = tmp_path / "home"
    try:
        up = tangram("up", str(inv), "--timeout", "90s", home=home)
        assert up.returncode == 0, up.stdout + up.stderr
        old = fingerprint(b.host_key)
        new = fingerprint(b.regenerate_host_key())

        again = tangram("up", str(inv), "-o", "json", home=home)
        assert again.returncode == 1, again.stdout + again.stderr
        doc = json.loads(again.stdout)
        hb = by_node(doc)["node-b"]
        assert (hb["bootstrapped"], hb["registered"], hb["step"]) == (False, True, "connect")
        assert doc["counts"] == {"bootstrapped": 1, "registered": 2}
        pattern = f"[127.0.0.3]:{b.port}"
        assert (
            f"host key for {pattern} changed: recorded {old} (ssh-ed25519), offered {new} (ssh-ed25519)"
            in (hb["reason"])
        )
        assert "its agent was already running and is registered" in hb["reason"]
        command = f"ssh-keygen -R {shlex.quote(pattern)} -f {home / 'known_hosts'}"
        assert command in hb["hint"]
        assert "  node-b: if the change is expected" in again.stderr
        assert "stopped" not in again.stderr  # nothing that ran before is touched
        assert len(controllers_of(home, cluster)) == 1 and len(agent_pids(nodes)) == 2

        table = tangram("up", str(inv), home=home)
        assert "2/2 agents registered" in table.stdout and "1/2 hosts bootstrapped" in table.stdout
        assert "node-b: not bootstrapped, but the agent already running there is registered" in table.stdout
        assert "FAILED (agent registered)" in table.stdout

        down = tangram("down", str(inv), home=home)  # node-b cannot be logged in to: said once
        assert down.returncode == 3, down.stdout + down.stderr
        assert f"  node-b: host key for {pattern} changed" in down.stdout
        assert "node-b: node-b:" not in down.stdout + down.stderr
        assert command in down.stdout

        accept = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
        assert accept.returncode == 0, accept.stderr
        fixed = tangram("up", str(inv), "--timeout", "90s", home=home)
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        assert "2/2 agents registered" in fixed.stdout and "2/2 hosts bootstrapped" in fixed.stdout
    finally:
        down = tangram("down", str(inv), "--purge", home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert left_on_nodes(nodes) == []


# ---------------------------------------------------------------- 3. progress and retries


def test_progress_per_step_and_retries_of_a_silent_host(
    sshd_factory, ssh_key, tmp_path: Path, silent_port: int
) -> None:
    silent = host("node-s", "127.0.0.5", silent_port, "1", tmp_path / "nodes", connect_timeout="1s")
    _a, _b, cluster, nodes, inv = two_nodes(sshd_factory, ssh_key, tmp_path, "prog", [silent])
    home = tmp_path / "home"
    try:
        up = tangram("up", str(inv), "--allow-partial", "--timeout", "90s", "-v", home=home)
        assert up.returncode == 3, up.stdout + up.stderr
        lines = up.stderr.splitlines()
        for node in ("node-a", "node-b"):
            for step in ("connect", "check", "probe", "upload", "install", "start", "wait"):
                done = [x for x in lines if re.search(rf"\] {node}: {step} \d+\.\d\ds", x)]
                assert len(done) == 1, (node, step, up.stderr)
        retries = [x for x in lines if "node-s: connect: attempt" in x]
        assert [re.search(r"attempt (\d/\d)", x).group(1) for x in retries] == ["1/3", "2/3"]
        assert all("timed out after 1s connecting to root@[127.0.0.5]" in x for x in retries)
        assert len([x for x in lines if re.search(r"\] node-s: connect FAILED after \d+\.\d\ds", x)]) == 1
        row = next(x for x in up.stdout.splitlines() if x.startswith("node-s"))
        assert "FAILED" in row and "(3 attempts)" in row

        doc = json.loads(tangram("up", str(inv), "--allow-partial", "-o", "json", home=home).stdout)
        assert by_node(doc)["node-s"]["attempts"] == 3
        assert by_node(doc)["node-a"]["attempts"] == 1
    finally:
        tangram("down", str(inv), "--purge", home=home)


# ---------------------------------------------------------------- 5. what a failed `up` leaves


def test_failed_limit_keeps_healthy_agents_and_a_fresh_partial_failure_is_rolled_back(
    sshd_factory, ssh_key, tmp_path: Path
) -> None:
    dead = host("node-c", "127.0.0.4", refused_port("127.0.0.4"), "0", tmp_path / "nodes")
    _a, _b, cluster, nodes, inv = two_nodes(sshd_factory, ssh_key, tmp_path, "lim", [dead])
    home = tmp_path / "home"
    try:
        first = tangram("up", str(inv), "--timeout", "90s", home=home)  # fresh: all or nothing
        assert first.returncode == 1, first.stdout + first.stderr
        assert re.search(
            r"stopped the controller \(pid \d+\) and the agents on node-a,node-b that this `up` "
            r"started: 1 of 3 host\(s\) failed",
            first.stderr,
        ), first.stderr
        assert "or pass --allow-partial to keep the hosts that came up running" in first.stderr
        assert "tangram down" not in first.stderr
        assert first.stdout.count("ok (stopped again)") == 2
        assert controllers_of(home, cluster) == [] and wait_no_agents(nodes) == []

        partial = tangram("up", str(inv), "--allow-partial", "--timeout", "90s", home=home)
        assert partial.returncode == 3, partial.stdout + partial.stderr
        assert "2/3 agents registered" in partial.stdout and len(agent_pids(nodes)) == 2

        limited = tangram("up", str(inv), "--limit", "node-c", home=home)
        assert limited.returncode == 1, limited.stdout + limited.stderr
        assert f"rerun `tangram up {inv} --limit node-c` after fixing" in limited.stderr
        assert "the cluster's 2 other agent(s) keep running" in limited.stderr
        assert "tangram down" not in limited.stderr and "stopped" not in limited.stderr
        assert len(controllers_of(home, cluster)) == 1 and len(agent_pids(nodes)) == 2
    finally:
        down = tangram("down", str(inv), "--purge", home=home)
    assert down.returncode == 0, down.stdout + down.stderr  # node-c never held anything: not a failure
    assert "node-c: skipped (connection refused" in down.stdout
    assert left_on_nodes(nodes) == [] and not (home / "clusters" / cluster).exists()


def test_local_only_flags_are_refused_with_an_inventory(ssh_key, tmp_path: Path) -> None:
    cluster = f"flags-{uuid.uuid4().hex[:8]}"
    inv = write_inventory(
        tmp_path, cluster, [host("node-a", "127.0.0.2", 22, "0", tmp_path)], key=str(ssh_key.path)
    )
    home = tmp_path / "home"
    up = tangram("up", str(inv), "--gpus", "4", "--executor", "process", "--insecure", home=home)
    assert up.returncode == 2, up.stdout + up.stderr
    for flag in ("--gpus", "--executor", "--insecure"):
        assert flag in up.stderr
    assert "only for the local default" in up.stderr
    assert "--gpu-mem" not in up.stderr  # not given: not named
    assert controllers_of(home, cluster) == [] and not (home / "clusters" / cluster / "state.json").exists()
    curve = tangram("up", str(inv), "--curve", "--dry-run", home=home)  # what an inventory does anyway
    assert curve.returncode == 0, curve.stdout + curve.stderr


# ---------------------------------------------------------------- 6. a no-op `up`


def test_a_noop_up_only_logs_in_and_checks(sshd_factory, ssh_key, tmp_path: Path) -> None:
    _a, _b, cluster, nodes, inv = two_nodes(sshd_factory, ssh_key, tmp_path, "noop")
    home = tmp_path / "home"
    try:
        first = json.loads(tangram("up", str(inv), "--timeout", "90s", "-o", "json", home=home).stdout)
        assert first["exit_code"] == 0
        steps = {"connect", "check", "probe", "upload", "install", "start", "wait"}
        assert [set(h["timings"]) for h in first["hosts"]] == [steps, steps]
        again = tangram("up", str(inv), "-o", "json", home=home)
        assert again.returncode == 0, again.stderr
        doc = json.loads(again.stdout)
        assert [h["started"] for h in doc["hosts"]] == ["running", "running"]
        assert [set(h["timings"]) for h in doc["hosts"]] == [{"connect", "check", "wait"}] * 2
        assert doc["counts"] == {"bootstrapped": 2, "registered": 2}
    finally:
        tangram("down", str(inv), "--purge", home=home)
