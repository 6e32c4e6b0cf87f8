"""A controller started on a state file (`Options.state`) that its predecessor left: restored
sandboxes wait for their node's agent, which adopts them (or not), and resent requests get the
recorded outcome. In-process controller, the in-test agent, real sockets."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import pytest

from tangram import protocol as p
from tangram_cli.controller.daemon import Controller
from tangram_cli.controller.ledger import Ledger
from tests.controller.conftest import CONFIG


@pytest.fixture
def restarted(tmp_path: Path, controllers: Any) -> Any:
    """`await restarted(write)`: a state file written by `write(ledger)`, then a controller on it."""

    async def make(write: Any) -> Controller:
        path = str(tmp_path / "state.jsonl")
        old = Ledger(path, epoch=1)
        old.restore()
        write(old)
        old.close()
        return await controllers(state=path)

    return make


async def test_a_restored_sandbox_waits_for_its_agent_and_is_adopted(
    restarted: Any, make_agent: Any, raw_client: Any, tmp_path: Path
) -> None:
    (tmp_path / "agent-n1" / "sb-1").mkdir(parents=True)  # what the agent kept across the restart
    (tmp_path / "agent-n1" / "sb-1" / "kept.txt").write_text("kept\n")
    ident = secrets.token_bytes(16)
    c = await restarted(lambda led: (led.opened("sb-1", ident, "", 64, 0), led.placed("sb-1", "n1")))
    assert c.registry.sandboxes["sb-1"].restoring
    client = _raw_as(raw_client, c.submit_addr, ident, c.gateway.token_for(ident))
    await client.send(p.Exec("sb-1", "cat kept.txt", 1, 1), 7)  # held until n1 says Hello
    agent = await make_agent(c, "n1", sandboxes_at_hello=["sb-1"])
    env = await client.final(7)
    assert isinstance(env.msg, p.Result), env.msg
    assert env.blobs[0] == b"kept\n"
    assert agent.created == []  # adopted, not created again
    assert [r.sandbox for r in agent.runs] == ["sb-1"]
    assert c.recovery.counters["adopted_sandboxes"] == 1


async def test_a_sandbox_its_agent_no_longer_holds_is_lost(
    restarted: Any, make_agent: Any, raw_client: Any
) -> None:
    ident = secrets.token_bytes(16)
    c = await restarted(lambda led: (led.opened("sb-1", ident, "", 64, 0), led.placed("sb-1", "n1")))
    client = _raw_as(raw_client, c.submit_addr, ident, c.gateway.token_for(ident))
    await client.send(p.Exec("sb-1", "echo hi", 1, 1), 7)
    agent = await make_agent(c, "n1")  # its Hello lists no sandbox
    env = await client.final(7)
    assert isinstance(env.msg, p.Error) and env.msg.code == "SANDBOX_LOST", env.msg
    assert agent.runs == [] and c.recovery.counters["unadopted_sandboxes"] == 1


async def test_resent_requests_get_the_recorded_reply_or_node_lost(
    restarted: Any, raw_client: Any, make_agent: Any
) -> None:
    ident = secrets.token_bytes(16)
    answer = p.encode(p.Result({"sandbox": "sb-9"}), 3)

    def write(led: Ledger) -> None:
        led.ran(ident, 3, "open")
        led.answered(ident, 3, "open", answer)
        led.ran(ident, 4, "exec", "n1", "x4")  # no answer: it was running on n1

    c = await restarted(write)
    stranger = _raw_as(raw_client, c.submit_addr, ident)  # the identity without its session token
    hello = p.Hello("client", "t", p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR)
    await stranger.send(hello, 1)
    assert isinstance((await stranger.final(1)).msg, p.Reject)  # no session for a known identity
    stranger.close()
    for _ in range(200):  # its connection is gone (one route per identity: the next one needs it)
        if c.gateway.counters["client_disconnects"]:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    token = c.gateway.token_for(ident)  # what the client's predecessor controller had issued
    client = _raw_as(raw_client, c.submit_addr, ident, token)
    await client.send(hello, 1)
    welcome = await client.final(1)
    assert isinstance(welcome.msg, p.Welcome) and welcome.msg.durable
    assert welcome.msg.session == token.hex()  # the same session goes on
    await client.send(p.SandboxOpen(), 3)
    env = await client.final(3)
    assert env.msg == p.Result({"sandbox": "sb-9"})
    await client.send(p.Exec("sb-9", "true", 1, 1), 4)
    with pytest.raises(TimeoutError):  # held until n1 has stopped what it still ran
        await client.final(4, timeout=0.5)
    await make_agent(c, "n1")
    env = await client.final(4)
    assert isinstance(env.msg, p.Error) and env.msg.code == "NODE_LOST" and env.msg.retryable
    await client.send(p.Exec("sb-9", "true", 1, 1), 4)  # once more: the same one reply
    again = await client.final(4)
    assert again.msg == env.msg


def _raw_as(raw_client: Any, addr: str, ident: bytes, token: bytes | None = None) -> Any:
    """A raw client with routing identity ``ident``; ``token``: the session token it holds from
    before the restart (None: it says Hello for a new session)."""
    import zmq

    client = raw_client(addr)
    client.sock.close(0)
    client.sock = client.ctx.socket(zmq.DEALER)
    client.sock.setsockopt(zmq.IDENTITY, ident)
    client.sock.setsockopt(zmq.LINGER, 0)
    client.sock.connect(addr)
    client.token = token
    return client


async def test_a_sandbox_whose_agent_never_comes_back_is_lost_after_the_grace(
    restarted: Any, raw_client: Any
) -> None:
    ident = secrets.token_bytes(16)
    c = await restarted(lambda led: (led.opened("sb-1", ident, "", 64, 0), led.placed("sb-1", "gone")))
    client = _raw_as(raw_client, c.submit_addr, ident, c.gateway.token_for(ident))
    await client.send(p.Exec("sb-1", "true", 1, 1), 7)
    for _ in range(500):  # until the gateway has read it and holds it
        if c.registry.sandboxes["sb-1"].deferred:
            break
        await asyncio.sleep(0.01)
    assert len(c.registry.sandboxes["sb-1"].deferred) == 1
    c.recovery.expire()  # within the grace: nothing happens
    assert c.registry.sandboxes["sb-1"].restoring
    c.recovery.restoring_until = c.clock.now() - 1  # the grace is over
    c.recovery.expire()
    env = await client.final(7)
    assert isinstance(env.msg, p.Error) and env.msg.code == "SANDBOX_LOST", env.msg
    assert "sb-1" not in c.gateway.ledger._sandboxes  # written as gone: the next restart forgets it


async def test_held_leases_and_quota_windows_survive_a_restart(
    tmp_path: Path, raw_client: Any, controllers: Any
) -> None:
    """A lease granted before the crash still counts against the API's concurrency, and a quota
    window keeps what it spent: a restart gives no client extra calls."""
    config = {
        **CONFIG,
        "apis": [
            {"name": "search", "mode": "concurrency", "limit": 2},
            {"name": "llm", "mode": "quota", "limit": 3, "period_s": 600},
        ],
    }
    path = str(tmp_path / "state.jsonl")
    holder = secrets.token_bytes(16)
    first = await controllers(config, state=path)
    client = _raw_as(raw_client, first.submit_addr, holder)
    for rid, api in ((1, "search"), (2, "search"), (3, "llm"), (4, "llm")):
        await client.send(p.Lease(api, 1), rid)
        env = await client.final(rid)
        assert isinstance(env.msg, p.Result), env.msg
    held = env.msg.body["lease"]
    await client.send(p.Release(held), 5)
    await client.final(5)
    await first.stop()  # an orderly stop keeps the same file a kill -9 would (written before each reply)
    c = await controllers(config, state=path)
    assert c.recovery.counters["restored_leases"] == 3  # search x2, llm x1 (the other was released)
    apis = {a.name: a for a in c.core.basic.apis.values()}
    assert len(apis["search"].in_flight) == 2 and apis["llm"].used == 2
    other = _raw_as(raw_client, c.submit_addr, secrets.token_bytes(16))
    await other.send(p.Lease("llm", 1), 1)
    assert isinstance((await other.final(1)).msg, p.Result)  # the quota's third and last unit
    await other.send(p.Lease("search", 1, budget_ms=300), 2)
    env = await other.final(2)
    assert isinstance(env.msg, p.Error), env.msg  # both search slots are still held


async def test_a_client_of_a_previous_controller_learns_the_epoch_on_first_contact(
    restarted: Any, raw_client: Any
) -> None:
    c = await restarted(lambda led: None)
    ident = secrets.token_bytes(16)
    token = c.gateway.token_for(ident)  # issued by the previous controller (the same state file)
    client = _raw_as(raw_client, c.submit_addr, ident, token)
    await client.send(p.Cancel(99), 5)  # no Hello: this client spoke to the controller before
    first = await client.recv()
    assert isinstance(first.msg, p.Welcome) and first.request_id == 0
    assert first.msg.controller_epoch == c.epoch and first.msg.durable
    assert first.msg.session == token.hex()  # its session goes on
    assert isinstance((await client.final(5)).msg, p.Result)
    await client.send(p.Cancel(98), 6)
    assert (await client.recv()).request_id == 6  # told once


async def test_after_a_restart_work_waits_for_the_nodes_instead_of_failing_no_capacity(
    restarted: Any, make_agent: Any, raw_client: Any
) -> None:
    c = await restarted(lambda led: led.node("n1", True))
    client = _raw_as(raw_client, c.submit_addr, secrets.token_bytes(16))
    await client.send(p.SandboxOpen(), 1)
    sandbox = (await client.final(1)).msg.body["sandbox"]
    await client.send(p.Exec(sandbox, "echo hi", 1, 1), 2)
    with pytest.raises(TimeoutError):  # no NO_CAPACITY: n1 was up before the restart
        await client.final(2, timeout=0.5)
    assert len(c.recovery.held) == 1
    await make_agent(c, "n1")
    env = await client.final(2)
    assert isinstance(env.msg, p.Result), env.msg
    assert c.gateway.hold is None and not c.recovery.held


async def test_an_unknown_agent_that_heartbeats_is_told_to_say_hello(restarted: Any, raw_client: Any) -> None:
    c = await restarted(lambda led: None)
    agent = _raw_as(raw_client, c.agents_addr, b"n9")
    await agent.send(p.Heartbeat(), 0)
    env = await agent.recv()
    assert isinstance(env.msg, p.Bye)
    await agent.send(p.Heartbeat(), 0)  # at most once a second
    with pytest.raises(TimeoutError):
        await agent.recv(timeout=0.3)
    assert c.agents.counters["hello_asked"] == 1
