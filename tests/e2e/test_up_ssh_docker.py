"""`tangram up INVENTORY` / `down` over real SSH with the docker executor.

The two loopback sshd nodes of test_up_ssh.py (127.0.0.2 and .3, one core each), but with
``executor: docker`` and the hostroot image: each sandbox must be a container labelled with the
cluster, its exec must run inside it on exactly the granted core, and `down` must leave no
labelled container and no agent behind. Both agents talk to this machine's dockerd at
/var/run/docker.sock (the one an SSH login sees, with no DOCKER_HOST).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from .test_docker_cluster import parse_cpulist
from .test_up_ssh import agent_pids, labelled_containers, tangram, write_inventory

pytestmark = [pytest.mark.ssh, pytest.mark.docker, pytest.mark.timeout(300)]

PRINT = "cat /proc/sys/kernel/hostname; grep Cpus_allowed_list /proc/self/status | cut -f2; echo {i}; sleep 1"


def docker_inventory(tmp: Path, key: Path, ports: tuple[int, int], cluster: str, image: str) -> Path:
    inv = write_inventory(tmp, key, ports, cluster)
    text = inv.read_text()
    assert "executor: process" in text
    inv.write_text(text.replace("executor: process", f"executor: docker, image: {json.dumps(image)}"))
    return inv


def cluster_containers(client: Any, cluster: str) -> dict[str, Any]:
    """{container hostname: container} for the containers labelled with ``cluster``."""
    found = client.containers.list(all=True, filters={"label": [f"tangram.cluster={cluster}"]})
    return {c.attrs["Config"]["Hostname"]: c for c in found}


def wait_containers(client: Any, cluster: str, n: int, timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    found = cluster_containers(client, cluster)
    while len(found) != n and time.monotonic() < deadline:
        time.sleep(0.2)
        found = cluster_containers(client, cluster)
    return found


async def exec_then_down(
    addr: str, certs: str, client: Any, cluster: str, down: Any
) -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
    """Two sandboxes, one exec each; close one, then run ``down()`` with the other still open."""
    import tangram

    tg = tangram.AsyncClient(addr, name="e2e-ssh-docker", certs=certs)
    await tg.connect()
    try:
        sandboxes = [await tg.open_sandbox(mem="256MiB") for _ in range(2)]
        results = await asyncio.gather(
            *(sb.exec(PRINT.format(i=i), cpus=1, timeout=60) for i, sb in enumerate(sandboxes))
        )
        # While the sandboxes are open: one running container per sandbox, labelled.
        running = await asyncio.to_thread(cluster_containers, client, cluster)
        await sandboxes[0].close()
        left = await asyncio.to_thread(wait_containers, client, cluster, 1)
        done = await asyncio.to_thread(down)  # sandboxes[1] is still open: `down` must remove it
    finally:
        await asyncio.wait_for(tg.close(), 10)
    out = []
    for i, r in enumerate(results):
        assert r.exit_code == 0, r.stderr
        host, cpus, echoed = r.stdout.splitlines()
        assert echoed == str(i)
        out.append({"node": r.node, "cores": r.cores, "host": host, "cpus": parse_cpulist(cpus)})
    return [{**o, "containers": running} for o in out], left, done


def check_agent_configs(nodes: Path, cluster: str, image: str, cluster_id: str) -> None:
    """Each node's agent.json: the docker executor, the image, and the cluster's unique id."""
    assert len(cluster_id) == 12
    for node in ("node-a", "node-b"):
        cfg = json.loads((nodes / node / cluster / "agent.json").read_text())
        assert (cfg["executor"], cfg["image"], cfg["cluster_id"]) == ("docker", image, cluster_id)


def test_up_docker_two_nodes_down_leaves_no_container(
    sshd_factory, ssh_key, tmp_path: Path, docker_client, hostroot_image
) -> None:
    adapter = getattr(docker_client.api, "_custom_adapter", None)
    if getattr(adapter, "socket_path", None) != "/var/run/docker.sock":
        pytest.skip("the agents (over SSH, no DOCKER_HOST) need the daemon at /var/run/docker.sock")
    a, b = sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")
    cluster = f"loopd-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    inv = docker_inventory(tmp_path, ssh_key.path, (a.port, b.port), cluster, hostroot_image)
    downs: list[Any] = []

    def down() -> Any:
        downs.append(tangram("down", str(inv), home=home))
        return downs[-1]

    try:
        up = tangram("up", str(inv), "--timeout", "60s", home=home)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "2/2 agents registered" in up.stdout
        state = json.loads((home / "clusters" / cluster / "state.json").read_text())
        check_agent_configs(tmp_path / "nodes", cluster, hostroot_image, state["cluster_id"])
        st = tangram("status", "-c", cluster, "-o", "json", home=home)
        assert st.returncode == 0, st.stderr
        nodes = {r["node"]: r for r in json.loads(st.stdout)["records"]["nodes"]}
        assert set(nodes) == {"node-a", "node-b"}
        assert all(r["cpus_total"] == 1 for r in nodes.values())
        assert len(agent_pids(tmp_path / "nodes")) == 2

        used, left, done = asyncio.run(
            exec_then_down(state["address"], state["certs"], docker_client, cluster, down)
        )
    finally:
        if not downs:
            down()
    assert {u["node"] for u in used} == {"node-a", "node-b"}
    want = {"node-a": (0,), "node-b": (1,)}
    for u in used:
        assert u["cores"] == want[u["node"]]
        assert u["cpus"] == set(u["cores"])  # the exec's cpuset is exactly the granted core
        containers = u["containers"]
        assert len(containers) == 2, list(containers)
        assert u["host"] in containers  # it ran inside one of the cluster's containers
        c = containers[u["host"]]
        assert c.status == "running"
        assert (c.labels["tangram.cluster"], c.labels["tangram.cluster-id"]) == (cluster, state["cluster_id"])
        assert c.name.startswith(f"tangram-{cluster}-{state['cluster_id']}-")  # unique on the daemon
        assert c.attrs["Config"]["Image"] == hostroot_image
    assert len({u["host"] for u in used}) == 2  # one container per sandbox
    assert len(left) == 1, list(left)  # closing a sandbox removed its container; the other stays

    assert done.returncode == 0, done.stdout + done.stderr
    # The nodes removed it (agent Shutdown("down"), else down's `docker rm` over SSH), not the
    # operator-side sweep that only works here because the "nodes" share this machine's dockerd.
    assert "container(s) of cluster" not in done.stdout, done.stdout
    for node in ("node-a", "node-b"):
        log = (tmp_path / "nodes" / node / cluster / "agent.log").read_text(errors="replace")
        assert "sandboxes destroyed" in log, log[-2000:]
    deadline = time.monotonic() + 10
    while agent_pids(tmp_path / "nodes") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert agent_pids(tmp_path / "nodes") == []
    assert labelled_containers(cluster) == 0  # the open sandbox's container went with `down`
    assert cluster_containers(docker_client, cluster) == {}
    assert not (home / "clusters" / cluster / "state.json").exists()
