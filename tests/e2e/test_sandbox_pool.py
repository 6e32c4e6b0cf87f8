"""Warm sandbox pools end to end with real Docker: an in-process controller sizes the pool of a real agent
(`python -m agent --executor docker`); a burst of opens is served from the pool, which refills; the agent is
killed (SIGKILL) and started again: its sandboxes are lost (docs/recovery.md) and removed, its idle pooled
containers adopted and used, nothing is made twice and nothing leaks; `down` leaves no container."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

import tangram
from agent.executors.docker import LABEL_CLUSTER, container_name
from agent.executors.docker_pool import LABEL_POOL, is_pool_name
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options

from .conftest import CONFIG, cpus_for_test, start_agent, stop_process, wait_for_node

pytestmark = pytest.mark.docker

POOL = 3
WAIT_S = 120.0


def docker_env(docker_client: Any) -> dict[str, str]:
    adapter = getattr(docker_client.api, "_custom_adapter", None)  # the fixture's daemon, private or not
    socket_path = getattr(adapter, "socket_path", None)
    return {"DOCKER_HOST": f"unix://{socket_path}" if socket_path else docker_client.api.base_url}


@dataclass(frozen=True)
class Box:
    id: str
    name: str
    labels: dict[str, str]


def containers(client: Any, cluster: str) -> list[Box]:
    """The cluster's containers, from one list call (no inspect that a removal meanwhile could fail)."""
    found = client.api.containers(all=True, filters={"label": [f"{LABEL_CLUSTER}={cluster}"]})
    return [Box(c["Id"], c["Names"][0].lstrip("/"), c.get("Labels") or {}) for c in found]


def idle(client: Any, cluster: str) -> int:
    return sum(is_pool_name(c.name, container_name(cluster, "")) for c in containers(client, cluster))


def holder(client: Any, cluster: str, sandbox: str) -> str | None:
    """The id of the container named for ``sandbox`` (None: none yet, e.g. its rename is pending)."""
    return {x.name: x.id for x in containers(client, cluster)}.get(container_name(cluster, sandbox))


def ready(c: Controller) -> int:
    """Idle pooled sandboxes the agent says it has ready (its heartbeats): containers made and attached."""
    agent = c.agents.agents.get("n1")
    return int(agent.load.get("pool_idle", -1)) if agent is not None and agent.live else -1


async def refilled(c: Controller, client: Any, cluster: str) -> None:
    """The pool is full: POOL idle containers, and a heartbeat after that says all are ready."""
    await until(lambda: idle(client, cluster) == POOL, "the pool's containers made")
    c.agents.agents["n1"].load = {}  # the next heartbeat's word, not an older one
    await until(lambda: ready(c) == POOL, "the pool ready")


async def until(cond: Any, what: str, timeout: float = WAIT_S) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(cond):
        assert asyncio.get_running_loop().time() < end, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.2)


async def test_pool_serves_a_burst_refills_and_survives_an_agent_crash(tmp_path, docker_client,
                                                                       busybox_image):
    cluster = f"pool-{uuid.uuid4().hex[:8]}"
    # mem_fraction 1: sandboxes hold the agent's default limit (4 GiB), more than a quarter of a small host
    config = {**CONFIG, "cluster": cluster, "sandbox_pool": {"min": POOL, "max": POOL, "mem_fraction": 1.0}}
    c = Controller(parse_config(config), Options())
    c.start()
    flags = ("--executor", "docker", "--cpus", cpus_for_test(), "--image", busybox_image,
             "--cluster", cluster)
    env = docker_env(docker_client)
    workdir = tmp_path / "agent"
    workdir.mkdir()
    proc = start_agent(c.agents_addr, str(workdir), *flags, env=env)
    try:
        await wait_for_node(c, "n1", timeout=60)
        await refilled(c, docker_client, cluster)
        pooled = {x.id for x in containers(docker_client, cluster)}
        async with tangram.AsyncClient(c.submit_addr, name="pool-e2e") as tg:
            boxes = [await tg.open_sandbox() for _ in range(POOL)]
            results = await asyncio.gather(*(b.exec("echo in-box", timeout=60) for b in boxes))
            assert [r.stdout.strip() for r in results] == ["in-box"] * POOL
            names = [container_name(cluster, b.id) for b in boxes]

            def claimed() -> bool:
                found = {x.name: x for x in containers(docker_client, cluster)}
                return all(n in found for n in names)

            await until(claimed, "the claims renamed")
            found = {x.name: x for x in containers(docker_client, cluster)}
            for n in names:  # every open took one of the containers made before it
                assert found[n].id in pooled and LABEL_POOL in found[n].labels
            await refilled(c, docker_client, cluster)

            proc.send_signal(signal.SIGKILL)  # the agent dies with 3 sandboxes open and 3 idle pooled ones
            proc.wait(10)
            epoch = c.agents.agents["n1"].agent_epoch
            proc = start_agent(c.agents_addr, str(workdir), *flags, env=env)
            await until(lambda: c.agents.agents["n1"].agent_epoch != epoch and c.agents.agents["n1"].live,
                        "the agent back")
            with pytest.raises(tangram.SandboxLost):  # docs/recovery.md: a killed agent's sandboxes are lost
                await boxes[0].exec("true", timeout=60)
            await until(lambda: len(containers(docker_client, cluster)) == POOL, "the lost sandboxes removed")
            await refilled(c, docker_client, cluster)
            await asyncio.sleep(3.0)  # sizing rounds: the adopted pool is the pool, none is made twice
            assert len(containers(docker_client, cluster)) == POOL == idle(docker_client, cluster)
            adopted = {x.id for x in containers(docker_client, cluster)}
            box = await tg.open_sandbox()
            assert (await box.exec("echo served", timeout=60)).stdout.strip() == "served"
            await until(lambda: holder(docker_client, cluster, box.id) in adopted, "an adopted one served it")
            await box.close()
        await until(lambda: len(containers(docker_client, cluster)) == POOL, "the sandboxes removed")
        await c.agents.shutdown_agents("down")  # `tangram down`: the idle pool goes too
        await until(lambda: containers(docker_client, cluster) == [], "nothing left after down")
    finally:
        await asyncio.to_thread(stop_process, proc)
        await c.stop()
        for x in containers(docker_client, cluster):
            with contextlib.suppress(Exception):
                docker_client.api.remove_container(x.id, force=True, v=True)
