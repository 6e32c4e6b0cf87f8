"""The controller with real ZeroMQ, real processes and the in-test fake agent (fast)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from support.waiting import until

import tangram
from tangram import protocol as p
from tangram.errors import ActionTimeout, BadRequest, NoCapacity, QuotaExceeded, RemoteError, SandboxLost


def overlapping(runs: list[Any]) -> list[tuple[Any, Any]]:
    return [(a, b) for i, a in enumerate(runs) for b in runs[i + 1 :] if a.start < b.end and b.start < a.end]


async def test_exec_end_to_end(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr, name="t1") as tg, tg.sandbox(mem="64MiB") as env:
        await env.put("in.txt", b"hello")  # before the first exec: kept, written after placement
        assert await env.get("in.txt") == b"hello"
        r = await env.exec("cat in.txt; echo; echo err >&2; exit 3", cpus=1, timeout=30)
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hello\n", "err\n")
        assert r.node == "n1" and len(r.cores) == 1 and r.cores[0] in (0, 1)
        assert r.queued_s >= 0 and r.run_s > 0 and r.overhead_s >= 0
        r = await env.exec("echo out > out.txt", cpus=1)
        assert await env.get("out.txt") == b"out\n"
    # the destroy is fire-and-forget: the client's close returns before the agent has it
    await until(lambda: agent.destroyed == agent.created, what="the sandbox destroyed on the agent")


async def test_sandboxes_without_a_memory_limit_are_destroyed_when_closed(controller, agent) -> None:
    """Three sandboxes open at once, none with `mem` (0 MiB: the library's default), each placed by an
    exec, then closed: every one is destroyed on the agent. (The core used to raise on the second close,
    in the job book's memory count, and its `DestroySandbox` never went out: the sandbox stayed.)"""
    async with tangram.AsyncClient(controller.submit_addr, name="plain") as tg:
        async with tg.sandbox() as a, tg.sandbox() as b, tg.sandbox() as c:
            for env in (a, b, c):
                assert (await env.exec("true", cpus=1)).exit_code == 0
            assert len(agent.created) == 3
    await until(lambda: sorted(agent.destroyed) == sorted(agent.created), what="all three destroyed")
    assert controller.core.jobs.mem == {}


async def test_elastic_exec_gets_dop_when_cores_are_free(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg, tg.sandbox() as env:
        r = await env.exec(
            "echo {dop} $TANGRAM_DOP", cpus=(1, 2), elastic={1: 1.0, 2: 0.95}, duration_hint=2.0
        )
        assert r.stdout.split() == ["2", "2"] and sorted(r.cores) == [0, 1] and r.dop == 2
        r = await env.exec("echo {dop}", cpus=(1, 2), elastic="linear", duration_hint=2.0)
        assert r.stdout.strip() == "2"
        r = await env.exec("echo {dop}", cpus=(1, 2))  # no elasticity: the minimum
        assert r.stdout.strip() == "1"


async def test_concurrent_execs_never_share_a_core(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg:
        envs = [await tg.open_sandbox() for _ in range(3)]
        results = await asyncio.gather(*(envs[i % 3].exec("sleep 0.2", cpus=1) for i in range(6)))
        assert all(r.exit_code == 0 for r in results)
        for a, b in overlapping(agent.runs):
            assert not set(a.cores) & set(b.cores), (a, b)
        assert any(overlapping(agent.runs))  # two ran at once, on different cores
        for env in envs:
            await env.close()


async def test_no_capacity_at_once(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg, tg.sandbox() as env:
        t0 = time.monotonic()
        with pytest.raises(NoCapacity) as info:
            await env.exec("true", cpus=99)
        assert time.monotonic() - t0 < 1.0 and not info.value.retryable
        with pytest.raises(NoCapacity):
            await tg.call("echo", {}, gpus=4)  # the node has 2 GPUs
        assert (await env.exec("echo still fine")).stdout == "still fine\n"


async def test_bad_requests_are_answered_and_others_keep_being_served(controller, agent, raw_client) -> None:
    raw = raw_client(controller.submit_addr)
    async with tangram.AsyncClient(controller.submit_addr) as tg, tg.sandbox() as env:
        await raw.send_raw([b"garbage"])
        env1 = await raw.recv()
        assert isinstance(env1.msg, p.Error) and env1.msg.code == "BAD_REQUEST"
        frames = p.encode(p.Exec("sb-x", "true", 1, 1), 41)
        await raw.send_raw([*frames[:3], b"\xc1\xff\x00"])  # undecodable body, request id kept
        env2 = await raw.recv()
        assert env2.request_id == 41 and env2.msg.code == "BAD_REQUEST"
        await raw.send_raw([b"TGR9", b"\x24", (5).to_bytes(8, "big"), b"\x80"])
        env3 = await raw.recv()
        assert env3.msg.code == "VERSION"
        big = p.encode(p.SandboxOpen(), 43)
        await raw.send_raw([*big[:3], b"\x80" + b"\x00" * (2 << 20)])  # a 2 MiB body
        env5 = await raw.recv()
        assert env5.request_id == 43 and env5.msg.code == "BAD_REQUEST" and "1048576" in env5.msg.message
        await raw.send(p.Exec("sb-nope", "true", 1, 1), 42)  # decodes, but not this client's sandbox
        env4 = await raw.final(42)
        assert env4.msg.code == "BAD_REQUEST"
        r = await env.exec("echo served")
        assert r.stdout == "served\n"
        with pytest.raises(BadRequest):
            await env.exec("true", elastic="no-such-profile")
        with pytest.raises(BadRequest):
            await tg.call("no-such-service", {})
    assert controller.gateway.counters["bad_requests"] >= 3


async def test_timeout_kills_and_cores_return(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg, tg.sandbox() as env:
        t0 = time.monotonic()
        with pytest.raises(ActionTimeout) as info:
            await env.exec("sleep 30", cpus=2, timeout=0.5)
        assert info.value.retryable and time.monotonic() - t0 < 5
        r = await env.exec("echo next", cpus=2, timeout=10)  # needs both cores: they came back
        assert r.stdout == "next\n" and sorted(r.cores) == [0, 1]


async def test_cancel_kills_the_action(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg, tg.sandbox() as env:
        task = asyncio.ensure_future(env.exec("sleep 30", cpus=2))
        for _ in range(200):
            if agent.runs:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = await env.exec("echo after", cpus=2, timeout=10)
        assert r.stdout == "after\n"
        assert agent.runs[0].end > 0  # the first run was killed, not left running


async def test_cancel_while_queued(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg, tg.sandbox() as env:
        blocker = asyncio.ensure_future(env.exec("sleep 0.5", cpus=2))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(env.exec("touch ran-anyway", cpus=2))
        await asyncio.sleep(0.1)
        queued.cancel()
        await blocker
        await asyncio.sleep(0.2)
        r = await env.exec("ls", cpus=1)
        assert "ran-anyway" not in r.stdout


async def test_resent_request_runs_once(controller, agent, raw_client) -> None:
    raw = raw_client(controller.submit_addr)
    await raw.send(p.SandboxOpen(), 1)
    sandbox = (await raw.final(1)).msg.body["sandbox"]
    exec_msg = p.Exec(sandbox, "echo x >> marker; sleep 0.3; wc -l < marker", 1, 1)
    await raw.send(exec_msg, 7)
    await raw.send(exec_msg, 7)  # resent while pending: joins the action
    first = await raw.final(7)
    await raw.send(exec_msg, 7)  # resent after the result: replayed from the cache
    second = await raw.final(7)
    assert first.msg.body["exit_code"] == 0 and first.blobs[0].strip() == b"1"
    assert second.blobs == first.blobs and second.msg.body == first.msg.body
    await raw.send(p.Exec(sandbox, "wc -l < marker", 1, 1), 8)
    assert (await raw.final(8)).blobs[0].strip() == b"1"  # the marker was written once
    assert len(agent.runs) == 2
    assert controller.gateway.counters["replayed"] >= 1 and controller.gateway.counters["joined"] >= 1


async def test_client_gone_releases_sandboxes(make_controller, make_agent, raw_client) -> None:
    c = await make_controller(client_grace_s=0.5)
    agent = await make_agent(c, "n1")
    raw = raw_client(c.submit_addr)
    await raw.send(p.SandboxOpen(), 1)
    sandbox = (await raw.final(1)).msg.body["sandbox"]
    await raw.send(p.Exec(sandbox, "sleep 30", 1, 1), 2)
    for _ in range(200):
        if agent.runs:
            break
        await asyncio.sleep(0.01)
    raw.close()  # silent from now on
    for _ in range(300):
        if sandbox in agent.destroyed:
            break
        await asyncio.sleep(0.02)
    assert sandbox in agent.destroyed
    for _ in range(250):  # the kill lands before the destroy; the process is reaped a moment later
        if agent.runs[0].end > 0:
            break
        await asyncio.sleep(0.02)
    assert agent.runs[0].end > 0  # its running action was killed
    for _ in range(250):  # and its answer reached the core (the agent sends it after the reap)
        if c.core.snapshot().running == 0:
            break
        await asyncio.sleep(0.02)
    assert c.core.snapshot().running == 0


async def test_lease_concurrency_limit(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg:
        async with tg.api("search") as a, tg.api("search") as b:
            assert a.lease != b.lease
            with pytest.raises(QuotaExceeded) as info:
                async with tg.api("search", timeout=0.3):
                    pass
            assert info.value.retryable
            waiter = asyncio.ensure_future(tg.api("search", timeout=10).acquire())
            await asyncio.sleep(0.2)
            assert not waiter.done()
        lease = await asyncio.wait_for(waiter, 5)  # granted once a slot came back
        await lease.release()
        with pytest.raises(BadRequest):
            await tg.api("no-such-api").acquire()


async def test_gpu_call_through_agent(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg:
        r1 = await tg.call("echo", {"x": 1}, gpus=1, timeout=10)
        assert r1.value == {"echo": {"x": 1}, "gpus": list(r1.gpus)} and r1.loaded and r1.node == "n1"
        r2 = await tg.call("echo", {"x": 2}, gpus=1, timeout=10)
        assert not r2.loaded  # resident: no restore
        r3 = await tg.call("echo", {"x": 3}, gpus=2, timeout=10)
        assert len(r3.gpus) == 2
        with pytest.raises(RemoteError):
            await tg.call("echo", {"raise": True})
    assert agent.prepared == ["echo"]
    assert agent.loads[0] == ("echo", r1.gpus)


async def test_node_lost_fails_running_actions(make_controller, make_agent) -> None:
    c = await make_controller(heartbeat_s=0.1)
    agent = await make_agent(c, "n1", heartbeat_s=0.05)
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        task = asyncio.ensure_future(env.exec("sleep 30", cpus=1))
        for _ in range(200):
            if agent.runs:
                break
            await asyncio.sleep(0.01)
        agent.mute = True
        with pytest.raises(SandboxLost):
            await asyncio.wait_for(task, 5)
        rows = {r["node"]: r for r in c._records(["nodes"], 10)["nodes"]}
        assert rows["n1"]["agent_state"] == "lost" and rows["n1"]["state"] == "down*"


async def test_unknown_sandboxes_at_hello_are_destroyed(controller, make_agent) -> None:
    agent = await make_agent(controller, "n2", sandboxes_at_hello=["sb-stale"])
    for _ in range(100):
        if agent.destroyed:
            break
        await asyncio.sleep(0.01)
    assert agent.destroyed == ["sb-stale"]


async def test_status_records(controller, agent, raw_client) -> None:
    raw = raw_client(controller.status_addr)
    async with tangram.AsyncClient(controller.submit_addr, name="status-test") as tg, tg.sandbox() as env:
        await env.exec("true")
        await raw.send(p.StatusReq(), 3)
        env_ = await raw.final(3)
    assert isinstance(env_.msg, p.Status)
    rec = env_.msg.records
    assert set(rec) == {"cluster", "nodes", "services", "apis", "queue", "actions", "clients", "jobs"}
    cl = rec["cluster"]
    assert cl["name"] == "test" and cl["agents_up"] == 1 and cl["proto"] == f"{p.PROTOCOL_MAJOR}.{p.PROTOCOL_MINOR}" == "1.8" and cl["uptime_s"] > 0
    assert cl["wait_p50_s"] is not None and cl["counters"]["finished"] >= 1
    node = rec["nodes"][0]
    assert node["node"] == "n1" and node["state"] == "idle" and node["cpus_total"] == 2
    assert node["heartbeat_age_s"] < 1 and node["gpus_total"] == 2 and node["executor"] == "process"
    assert rec["services"][0]["service"] == "echo" and rec["apis"][0]["limit"] == 2
    assert rec["clients"][0]["name"] == "status-test"
    await raw.send(p.StatusReq(sections=["nope"]), 4)
    assert (await raw.final(4)).msg.code == "BAD_REQUEST"
    await raw.send(p.StatusReq(sections=["queue"], limit=5), 5)
    assert set((await raw.final(5)).msg.records) == {"queue"}


async def test_reserved_sandbox_holds_cores(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr) as tg:
        async with tg.sandbox(reserve=2) as env:
            r = await env.exec("echo {dop}", cpus=(1, 2))
            assert r.stdout.strip() == "2" and sorted(r.cores) == [0, 1]
            assert controller._records(["nodes"], 5)["nodes"][0]["cpus_used"] == 2
        assert controller._records(["nodes"], 5)["nodes"][0]["cpus_used"] == 0
        with pytest.raises(NoCapacity):
            await tg.open_sandbox(reserve=8)


def test_sync_client_in_a_thread_pool(controller_thread) -> None:
    import concurrent.futures

    addr = controller_thread
    with tangram.Client(addr, name="sync") as tg, tg.sandbox() as env:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: env.exec(f"echo {i}").stdout, range(8)))
        assert outs == [f"{i}\n" for i in range(8)]
        fut = tg.submit(env.exec, "echo fanned")
        assert fut.result(10).stdout == "fanned\n"
        with tg.api("search"):
            pass
        assert tg.call("echo", {"a": 1}).value["echo"] == {"a": 1}


async def test_closing_a_client_releases_its_leases_and_sandboxes(controller, agent) -> None:
    tg = await tangram.AsyncClient(controller.submit_addr).connect()
    await tg.api("search").acquire()
    await tg.api("search").acquire()  # both slots held, never released
    env = await tg.open_sandbox()
    await env.exec("true")
    await tg.close()  # says Bye
    for _ in range(100):
        if controller.core.snapshot().apis[0]["in_flight"] == 0 and env.id in agent.destroyed:
            break
        await asyncio.sleep(0.02)
    assert controller.core.snapshot().apis[0]["in_flight"] == 0
    assert env.id in agent.destroyed
    async with tangram.AsyncClient(controller.submit_addr) as tg2, tg2.api("search", timeout=2):
        pass


async def test_elastic_gpu_call_gets_a_larger_chunk_when_it_is_free(controller, agent) -> None:
    async with tangram.AsyncClient(controller.submit_addr, name="t") as tg:
        r = await tg.call("echo", {"x": 1}, gpus=[1, 2], elastic="linear", timeout=10)
        assert len(r.gpus) == 2  # alone on the node and perfectly parallel: both GPUs
        r = await tg.call("echo", {"x": 2}, gpus=[1, 2], timeout=10)
        assert len(r.gpus) == 1  # no profile: unknown elasticity, the minimum
        with pytest.raises(BadRequest, match="unknown elasticity profile"):
            await tg.call("echo", {}, gpus=[1, 2], elastic="nope", timeout=10)
