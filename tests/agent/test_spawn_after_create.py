"""A Spawn sent right behind its sandbox's CreateSandbox, before the reply (agent/pool_requests.py): the agent
runs it once the sandbox exists, or answers SANDBOX_LOST when the creation failed; it never runs first. The
Hello says so (`spawn_after_create`); only an executor with pools lists `pool`."""
from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
from test_link import FakeController, make_cfg, spawn, start, two_cpus, welcomed  # noqa: F401 - `start`

from agent.executors.docker import DockerExecutor
from agent.link import Agent, build_facts
from agent.probe import probe
from tangram import protocol as p


@pytest.fixture
async def ctl():
    c = FakeController()
    yield c
    c.destroy()


async def replies(ctl: FakeController, n: int) -> dict[int, p.Envelope]:
    out: dict[int, p.Envelope] = {}
    while len(out) < n:
        _, env = await ctl.recv(timeout=60)
        if not isinstance(env.msg, p.Ack):
            out[env.request_id] = env
    return out


async def test_a_spawn_right_behind_its_create_runs_in_the_new_sandbox(ctl, start, tmp_path):  # noqa: F811
    _, ident, hello = await welcomed(ctl, start, tmp_path)
    assert hello.facts["spawn_after_create"] is True
    assert "pool" not in hello.facts  # the process executor keeps no pools
    core = two_cpus()[1]
    for i in range(5):
        sb = f"quick{i}"
        await ctl.send(ident, p.CreateSandbox(sb, "", 64), 10 + 2 * i)
        await ctl.send(ident, spawn(f"a{i}", "echo here > mark; cat mark", [core], sandbox=sb), 11 + 2 * i)
        got = await replies(ctl, 2)
        assert isinstance(got[10 + 2 * i].msg, p.Result), got[10 + 2 * i].msg
        run = got[11 + 2 * i]
        assert isinstance(run.msg, p.Result), run.msg
        assert run.msg.body["exit_code"] == 0 and run.blobs[0] == b"here\n"


@pytest.fixture
async def docker_agent(ctl, tmp_path, docker_client):
    cpus = two_cpus()
    cluster = f"t{uuid.uuid4().hex[:8]}"
    cfg = make_cfg(ctl, tmp_path, executor="docker", cluster=cluster)
    ex = DockerExecutor(docker_client, cluster, str(cpus[0]), cfg.image, pool_max=4,
                        workdir=str(tmp_path / "wd"))
    facts = build_facts(cfg, probe(check_docker=False, check_gpus=False), cpus, cpus[:1], "docker", [])
    agent = Agent(cfg, ex, facts=facts, cpus=cpus)
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stop("test over")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await agent.close()
        for c in docker_client.containers.list(all=True, filters={"label": [f"tangram.cluster={cluster}"]}):
            with contextlib.suppress(Exception):  # what a failed test left
                c.remove(force=True, v=True)


@pytest.mark.docker
async def test_a_spawn_behind_a_cold_docker_create_waits_for_it(ctl, docker_agent, busybox_image):
    """A cold container takes many awaits to make: the Spawn behind it must not run (and fail) first."""
    ident, hello = await ctl.handshake()
    assert hello.facts["spawn_after_create"] is True and hello.facts["pool"] == []
    await ctl.send(ident, p.CreateSandbox("cold", busybox_image, 64), 31)
    await ctl.send(ident, spawn("a1", "echo in-box", [two_cpus()[1]], sandbox="cold"), 32)
    got = await replies(ctl, 2)
    assert isinstance(got[31].msg, p.Result), got[31].msg
    assert isinstance(got[32].msg, p.Result) and got[32].blobs[0] == b"in-box\n", got[32].msg
    env = await ctl.request(ident, p.DestroySandbox("cold"), timeout=60)
    assert isinstance(env.msg, p.Result)


@pytest.mark.docker
async def test_a_spawn_behind_a_failed_create_is_answered_sandbox_lost(ctl, docker_agent):
    ident, _ = await ctl.handshake()
    await ctl.send(ident, p.CreateSandbox("nobox", "no-such-image:0", 64), 21)
    await ctl.send(ident, spawn("a1", "true", [two_cpus()[1]], sandbox="nobox"), 22)
    got = await replies(ctl, 2)
    assert isinstance(got[21].msg, p.Error) and got[21].msg.code == "BAD_REQUEST", got[21].msg
    assert isinstance(got[22].msg, p.Error) and got[22].msg.code == "SANDBOX_LOST", got[22].msg
