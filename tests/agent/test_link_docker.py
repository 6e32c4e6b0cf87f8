"""The agent link with the Docker executor: CreateSandbox + Spawn in a real container on granted cores."""
from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from test_link import FakeController, cpus_seen, make_cfg, spawn, two_cpus

from agent.executors.docker import DockerExecutor
from agent.link import Agent, build_facts
from agent.probe import probe
from tangram import protocol as p

pytestmark = pytest.mark.docker

CGROUP_CPUS = ("cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null "
               "|| cat /sys/fs/cgroup/cpuset/cpuset.effective_cpus 2>/dev/null "
               "|| cat /sys/fs/cgroup/cpuset/cpuset.cpus")


@pytest.fixture
async def ctl():
    c = FakeController()
    yield c
    c.destroy()


@pytest.fixture(params=["auto", "docker"])
async def docker_agent(request, ctl, tmp_path, docker_client):
    cpus = two_cpus()
    cluster = f"t{uuid.uuid4().hex[:8]}"
    cfg = make_cfg(ctl, tmp_path, executor="docker", cluster=cluster, docker_mode=request.param)
    ex = DockerExecutor(docker_client, cluster, str(cpus[0]), cfg.image, mode=request.param)
    machine = probe(check_docker=False, check_gpus=False)
    facts = build_facts(cfg, machine, cpus, cpus[:1], "docker", [])
    agent = Agent(cfg, ex, facts=facts, cpus=cpus)
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stop("test over")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        for name in await ex.list_sandboxes():
            await ex.destroy_sandbox(name)
        await agent.close()


async def test_spawn_in_a_container_runs_on_exactly_the_granted_cores(ctl, docker_agent, busybox_image,
                                                                      test_labels):
    ident, hello = await ctl.handshake()
    assert hello.facts["executor"] == "docker"
    env = await ctl.request(ident, p.CreateSandbox("sb1", busybox_image, 64, test_labels), timeout=60)
    assert isinstance(env.msg, p.Result), env.msg
    cpus = two_cpus()
    for cores in ([cpus[1]], cpus):
        cmd = f"grep Cpus_allowed_list /proc/self/status; echo dop={{dop}}; {CGROUP_CPUS}"
        env = await ctl.request(ident, spawn(f"a{len(cores)}", cmd, cores), timeout=30)
        assert isinstance(env.msg, p.Result), env.msg
        body, out = env.msg.body, env.blobs[0].decode()
        assert body["exit_code"] == 0, env.blobs
        assert body["cores"] == cores
        assert cpus_seen(env.blobs[0]) == tuple(cores)
        assert f"dop={len(cores)}" in out
    env = await ctl.request(ident, p.PutFile("sb1", "x.txt"), blobs=(b"in the box",), timeout=30)
    assert isinstance(env.msg, p.Result), env.msg
    env = await ctl.request(ident, p.GetFile("sb1", "/work/x.txt"), timeout=30)
    assert env.blobs == (b"in the box",)
    env = await ctl.request(ident, spawn("k", "sleep 30", [cpus[1]], timeout_s=1.0), timeout=30)
    assert env.msg.body["timed_out"] and env.msg.body["exit_code"] == 137
    env = await ctl.request(ident, p.DestroySandbox("sb1"), timeout=60)
    assert isinstance(env.msg, p.Result)
    env = await ctl.request(ident, spawn("gone", "true", [cpus[1]]), timeout=30)
    assert env.msg.code == "SANDBOX_LOST"


async def test_missing_image_is_a_bad_request(ctl, docker_agent, test_labels):
    ident, _ = await ctl.handshake()
    msg = p.CreateSandbox("sb2", "tangram-test/missing:0", 64, test_labels)
    env = await ctl.request(ident, msg, timeout=60)
    assert env.msg.code == "BAD_REQUEST", env.msg


async def test_default_image_is_hostroot(ctl, docker_agent, hostroot_image, test_labels):
    ident, _ = await ctl.handshake()
    env = await ctl.request(ident, p.CreateSandbox("host", "", 64, test_labels), timeout=60)
    assert isinstance(env.msg, p.Result), env.msg
    core = two_cpus()[1]
    cmd = "python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'"
    env = await ctl.request(ident, spawn("py", cmd, [core], sandbox="host"), timeout=30)
    assert env.msg.body["exit_code"] == 0, env.blobs
    assert env.blobs[0].decode().strip() == f"[{core}]"
