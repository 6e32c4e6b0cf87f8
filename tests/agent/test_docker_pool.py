"""Warm sandbox pools of the Docker executor with a real dockerd (``agent.executors.docker_pool``): a burst of
opens is served from the pool, the pool refills in the background and waits while every core is busy, and a
restarted agent finishes claims, adopts idle pooled containers or removes them: none is leaked."""
from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from support import waiting
from test_link import cpus_seen, two_cpus

from agent.executors import docker_pool
from agent.executors.base import RunRequest, SandboxSpec
from agent.executors.docker import LABEL_CLUSTER, DockerExecutor, container_name
from agent.executors.docker_pool import LABEL_POOL, Shape, is_pool_name

pytestmark = pytest.mark.docker

WAIT_S = 90.0  # container creation on a loaded 2-core machine


async def until(cond, timeout: float = WAIT_S, what: str = "condition") -> None:
    await waiting.until(cond, timeout, what, poll_s=0.1)


def cluster_containers(client, cluster: str) -> list:
    """The cluster's containers. The SDK lists, then inspects each: one removed in between (the pool
    removes in the background) raises NotFound, and the list is read again."""
    import docker.errors

    for _ in range(20):
        try:
            return client.containers.list(all=True, filters={"label": [f"{LABEL_CLUSTER}={cluster}"]})
        except docker.errors.NotFound:
            continue
    raise AssertionError("the cluster's containers kept changing under the list")


@pytest.fixture
def cluster(docker_client):
    name = f"p{uuid.uuid4().hex[:8]}"
    yield name
    for c in cluster_containers(docker_client, name):
        with contextlib.suppress(Exception):
            c.remove(force=True, v=True)


def make(docker_client, cluster: str, image: str, tmp_path, labels, **kw) -> DockerExecutor:
    cpus = two_cpus()
    return DockerExecutor(docker_client, cluster, str(cpus[0]), image, node="n1", mem_mib=64,
                          workdir=str(tmp_path / "wd"), pool_max=8, pool_labels=labels, **kw)


def spec(name: str, image: str, labels) -> SandboxSpec:
    return SandboxSpec(name, image, 0, {"tangram.sandbox": name, **labels})


async def test_a_burst_of_opens_is_served_from_the_pool_and_refilled(docker_client, busybox_image, tmp_path,
                                                                     cluster, test_labels):
    ex = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    pool = ex.pool
    shape = Shape(busybox_image, 0)
    try:
        pool.set_target(shape, 3)
        await until(lambda: len(pool.pools[shape].ready) == 3, what="the pool filled")
        pooled = {sb.cid for sb in pool.pools[shape].ready}
        names = [f"b{i}" for i in range(3)]
        await asyncio.gather(*(ex.create_sandbox(spec(n, busybox_image, test_labels)) for n in names))
        assert pool.stats.claimed == 3 and pool.stats.missed == 0
        assert {ex._sandboxes[n].cid for n in names} == pooled  # every open took a pooled container
        cpus = two_cpus()
        for i, n in enumerate(names):
            cmd = "grep Cpus_allowed_list /proc/self/status; id -u"
            r = await ex.run(RunRequest(f"a{i}", n, cmd, (cpus[1],)))
            assert r.exit_code == 0, r.stderr
            assert cpus_seen(r.stdout) == (cpus[1],)
            assert r.stdout.decode().split()[-1] == "65534"  # the sandbox user, as in a cold one
        await until(lambda: not pool.renames, what="the claims' renames")
        for n in names:  # the container now carries the sandbox's name
            c = docker_client.containers.get(container_name(cluster, n))
            assert c.id in pooled and LABEL_POOL in c.labels
        assert sorted(await ex.list_sandboxes()) == names
        await until(lambda: len(pool.pools[shape].ready) == 3, what="the refill")
        assert pool.stats.made >= 6
        for n in names:
            await ex.destroy_sandbox(n)
        idle = [c for c in cluster_containers(docker_client, cluster)]
        assert len(idle) == 3 and all(is_pool_name(c.name, ex._name("")) for c in idle)
        assert await ex.list_sandboxes() == []
        assert await pool.drain() == 3
        assert cluster_containers(docker_client, cluster) == []
    finally:
        await ex.close()


async def test_a_request_the_pool_cannot_serve_is_made_cold(docker_client, busybox_image, tmp_path, cluster,
                                                            test_labels):
    ex = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    try:
        ex.pool.set_target(Shape(busybox_image, 0), 1)
        await until(lambda: ex.pool.idle() == 1, what="the pool filled")
        await ex.create_sandbox(SandboxSpec("m1", busybox_image, 128,
                                            {"tangram.sandbox": "m1", **test_labels}))
        await ex.create_sandbox(SandboxSpec("u1", busybox_image, 0, {"tangram.sandbox": "u1", **test_labels},
                                            user="1000:1000"))
        assert ex.pool.stats.claimed == 0 and ex.pool.idle() == 1  # another memory, another user: cold
        assert ex.pool.stats.missed == 0  # no pool of that shape was asked for
    finally:
        await ex.pool.drain()
        await ex.close()


async def test_refill_waits_while_every_core_runs_an_action(docker_client, busybox_image, tmp_path, cluster,
                                                           test_labels):
    ex = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    cpus = two_cpus()
    try:
        await ex.create_sandbox(spec("s1", busybox_image, test_labels))
        ex.pool.total_cores = 1  # the node hands out one core: while it runs an action, refill waits
        run = asyncio.ensure_future(ex.run(RunRequest("long", "s1", "sleep 3", (cpus[1],))))
        await until(lambda: ex.busy_cores() == {cpus[1]}, what="the action started")
        ex.pool.set_target(Shape(busybox_image, 0), 1)
        while not run.done():
            assert ex.pool.pools[Shape(busybox_image, 0)].making == 0 and ex.pool.idle() == 0
            await asyncio.sleep(0.05)
        assert (await run).exit_code == 0
        await until(lambda: ex.pool.idle() == 1, what="the refill after the action")
    finally:
        await ex.pool.drain()
        await ex.close()


async def test_a_restarted_agent_finishes_claims_adopts_or_removes_pooled_containers(
        docker_client, busybox_image, tmp_path, cluster, test_labels, monkeypatch):
    first = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    shape = Shape(busybox_image, 0)
    first.pool.set_target(shape, 3)
    await until(lambda: first.pool.idle() == 3, what="the pool filled")

    async def no_rename(cid: str, sandbox: str) -> None:  # the agent dies before its rename
        return None

    monkeypatch.setattr(first.pool, "_rename", no_rename)
    await first.create_sandbox(spec("kept", busybox_image, test_labels))
    await first.pool._stop_refill()
    await first.close()  # a crash leaves the same: containers running, spawners gone with the agent
    assert len(cluster_containers(docker_client, cluster)) == 3  # 1 claimed (pool-named still) + 2 idle

    second = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    try:
        await second.recover()
        assert docker_client.containers.get(container_name(cluster, "kept")).status == "running"
        assert await second.list_sandboxes() == ["kept"]  # the claim stood
        assert second.pool.idle() == 2 and second.pool.stats.adopted == 2
        r = await second.run(RunRequest("a1", "kept", "true", (two_cpus()[1],)))
        assert r.exit_code == 0
        second.pool.set_target(shape, 1)  # the controller's target: one too many adopted
        await until(lambda: len(cluster_containers(docker_client, cluster)) == 2, what="the trim")
        await second.pool._stop_refill()
    finally:
        await second.close()

    monkeypatch.setattr(docker_pool, "ADOPT_GRACE_S", 0.0)  # never told: the adopted pool goes
    third = DockerExecutor(docker_client, cluster, str(two_cpus()[0]), busybox_image, node="n1", mem_mib=128,
                           workdir=str(tmp_path / "wd"), pool_max=8, pool_labels=test_labels)
    try:
        await third.recover()  # made with another default memory: unlike, so removed
        assert third.pool.idle() == 0
        left = cluster_containers(docker_client, cluster)
        assert [c.name for c in left] == [container_name(cluster, "kept")]
        await third.destroy_sandbox("kept")
        assert cluster_containers(docker_client, cluster) == []
    finally:
        await third.close()


async def test_an_adopted_pool_nobody_names_is_removed_after_the_grace(docker_client, busybox_image, tmp_path,
                                                                      cluster, test_labels, monkeypatch):
    first = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    first.pool.set_target(Shape(busybox_image, 0), 1)
    await until(lambda: first.pool.idle() == 1, what="the pool filled")
    await first.pool._stop_refill()
    await first.close()
    monkeypatch.setattr(docker_pool, "ADOPT_GRACE_S", 0.2)
    second = make(docker_client, cluster, busybox_image, tmp_path, test_labels)
    try:
        await second.recover()
        assert second.pool.stats.adopted == 1
        await until(lambda: cluster_containers(docker_client, cluster) == [], what="the adopted pool removed")
    finally:
        await second.close()
