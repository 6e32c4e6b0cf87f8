"""Backpressure: per-client and global caps answer RETRY_LATER at once; a client that stops
reading has its final replies kept in a bounded outbox, and an overflow cancels its work
(docs/protocol.md, "Backpressure")."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import pytest
import zmq
import zmq.asyncio

import tangram
from tangram import protocol as p
from tangram.errors import RetryLater


async def wait_for(cond: Any, timeout: float = 3.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.01)


def counters(c: Any) -> dict[str, int]:
    return c._records(["cluster"], 10)["cluster"]["counters"]


async def finals(raw: Any, rids: set[int], timeout: float = 5.0) -> dict[int, p.Envelope]:
    """The final replies to `rids`, in whatever order they come."""
    got: dict[int, p.Envelope] = {}
    while set(got) != rids:
        env = await raw.recv(timeout)
        if env.request_id in rids and not isinstance(env.msg, p.Accepted):
            got[env.request_id] = env
    return got


async def open_sandbox(raw: Any, rid: int) -> str:
    await raw.send(p.SandboxOpen(), rid)
    return str((await raw.final(rid)).msg.body["sandbox"])


async def test_client_over_its_cap_gets_retry_later_and_others_are_served(
    make_controller, make_agent, raw_client
) -> None:
    c = await make_controller(max_outstanding_per_client=2)
    agent = await make_agent(c, "n1", cpus=(0, 1))
    raw = raw_client(c.submit_addr)
    sb = await open_sandbox(raw, 1)
    await raw.send(p.Exec(sb, "sleep 0.4", 1, 1), 2)
    await raw.send(p.Exec(sb, "sleep 0.4", 1, 1), 3)
    await wait_for(lambda: c.gateway.outstanding.get(next(iter(c.gateway.clients))) == 2)
    t0 = time.monotonic()
    await raw.send(p.Exec(sb, "echo third", 1, 1), 4)
    refused = await raw.final(4, timeout=2)
    assert time.monotonic() - t0 < 1.0
    assert isinstance(refused.msg, p.Error) and refused.msg.code == "RETRY_LATER" and refused.msg.retryable
    assert "cap of 2 outstanding" in refused.msg.message and "(2 pending" in refused.msg.message
    assert counters(c)["retry_later_client"] == 1
    # another client is served meanwhile
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        assert (await env.exec("echo other", cpus=1, timeout=5)).stdout == "other\n"
    # once the first two finish, a copy of the refused request id still gets the refusal (it is
    # cached like any final reply, so a late resend can never run it); a new request id runs
    assert all(e.msg.body["exit_code"] == 0 for e in (await finals(raw, {2, 3})).values())
    await raw.send(p.Exec(sb, "echo third", 1, 1), 4)
    again = await raw.final(4)
    assert isinstance(again.msg, p.Error) and again.msg.code == "RETRY_LATER"
    assert counters(c)["replayed"] == 1
    await raw.send(p.Exec(sb, "echo third", 1, 1), 6)
    done = await raw.final(6)
    assert isinstance(done.msg, p.Result) and done.blobs[0] == b"third\n"
    assert len(agent.runs) == 4  # 2 + the other client's + the resubmitted one: the refusal ran nothing
    rows = c._records(["clients"], 10)["clients"]
    assert all(r["outstanding"] == 0 and r["outbox"] == 0 for r in rows)
    # freeing requests are never refused
    await raw.send(p.SandboxClose(sb), 5)
    assert isinstance((await raw.final(5)).msg, p.Result)


async def test_global_cap_on_queued_actions(make_controller, make_agent, raw_client) -> None:
    c = await make_controller(max_queued=2)
    await make_agent(c, "n1", cpus=(0, 1))
    a, b = raw_client(c.submit_addr), raw_client(c.submit_addr)
    sa, sbb = await open_sandbox(a, 1), await open_sandbox(b, 1)
    await a.send(p.Exec(sa, "sleep 0.4", 2, 2), 2)  # runs on both cores
    await a.send(p.Exec(sa, "true", 2, 2), 3)  # queued behind it
    await wait_for(lambda: len(c.registry.actions) == 2)
    await b.send(p.Exec(sbb, "echo b", 1, 1), 2)
    refused = await b.final(2, timeout=2)
    assert refused.msg.code == "RETRY_LATER" and refused.msg.retryable
    assert "cap of 2 queued actions" in refused.msg.message
    await b.send(p.Put(sbb, "f"), 3, [b"x"])  # not an action: still served
    assert isinstance((await b.final(3)).msg, p.Result)
    assert counters(c)["retry_later_global"] == 1
    await finals(a, {2, 3})
    await b.send(p.Exec(sbb, "echo b", 1, 1), 2)  # the refused id: its refusal again
    assert (await b.final(2)).msg.code == "RETRY_LATER"
    await b.send(p.Exec(sbb, "echo b", 1, 1), 4)  # a new id runs
    assert (await b.final(4)).blobs[0] == b"b\n"


async def test_client_library_retries_retry_later_with_backoff(
    make_controller, make_agent, raw_client
) -> None:
    c = await make_controller(max_queued=1)
    await make_agent(c, "n1", cpus=(0, 1))
    raw = raw_client(c.submit_addr)
    sb = await open_sandbox(raw, 1)
    await raw.send(p.Exec(sb, "sleep 0.5", 1, 1), 2)
    await wait_for(lambda: len(c.registry.actions) == 1)
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        with pytest.raises(RetryLater) as info:  # the total timeout runs out while refused (the run
            await env.exec("echo late", timeout=10, total_timeout=0.2)  # timeout does not count refusals)
        assert info.value.retryable
        t0 = time.monotonic()
        r = await env.exec("echo retried", timeout=10)  # retried until the blocker finished
        assert r.stdout == "retried\n" and time.monotonic() - t0 < 3
        assert tg.retried_later >= 2
    assert counters(c)["retry_later_global"] >= 3


async def test_slow_client_outbox_overflow_cancels_its_work(make_controller, make_agent) -> None:
    c = await make_controller(max_outbox=3)
    agent = await make_agent(c, "n1", cpus=(0, 1))
    c.submit_sock.setsockopt(zmq.SNDHWM, 1)  # small pipes; a listener copies options at bind: bind again
    c.submit_sock.setsockopt(zmq.SNDBUF, 4096)
    c.submit_sock.unbind(c.submit_addr)
    for _ in range(100):  # the old listener closes in the I/O thread
        try:
            c.submit_sock.bind(c.submit_addr)
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.02)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(c.submit_addr)

    async def final(rid: int, timeout: float = 5.0) -> p.Envelope:
        while True:
            env = p.decode(await asyncio.wait_for(sock.recv_multipart(), timeout))
            if env.request_id == rid and isinstance(env.msg, (p.Result, p.Error)):
                return env

    try:
        await sock.send_multipart(p.encode(p.Hello("client", "slow", p.PROTOCOL_MAJOR, p.BATCH_MINOR - 1), 99))
        while not isinstance((welcome := p.decode(await sock.recv_multipart())).msg, p.Welcome):
            pass
        token = bytes.fromhex(welcome.msg.session)  # the session token every later frame carries
        await sock.send_multipart(p.encode(p.SandboxOpen(), 1, token=token))
        s1 = (await final(1)).msg.body["sandbox"]
        await sock.send_multipart(p.encode(p.Put(s1, "big"), 2, [b"z" * (1 << 20)], token=token))
        await final(2)
        await sock.send_multipart(p.encode(p.SandboxOpen(), 3, token=token))
        s2 = (await final(3)).msg.body["sandbox"]
        await sock.send_multipart(p.encode(p.Exec(s2, "sleep 30", 1, 1), 4, token=token))
        await wait_for(lambda: agent.runs)
        for rid in range(100, 130):  # 1 MiB replies, none read
            await sock.send_multipart(p.encode(p.Get(s1, "big"), rid, token=token))
        await wait_for(lambda: c.gateway.counters["outbox_overflows"] >= 1 and agent.runs[0].end > 0)
        cnt = counters(c)
        assert cnt["outbox_queued"] >= 3 and cnt["outbox_cancelled"] == 1
        assert max(len(b) for b in c.gateway.outbox.values()) <= 3  # bounded
        # the client reads again: what waited arrives (flushed on its messages / heartbeats)
        got: set[int] = set()
        ident = sock.getsockopt(zmq.IDENTITY)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and ident in c.gateway.outbox:
            await sock.send_multipart(p.encode(p.Heartbeat(), 0, token=token))
            try:
                env = p.decode(await asyncio.wait_for(sock.recv_multipart(), 0.2))
            except TimeoutError:
                continue
            got.add(env.request_id)
        assert c.gateway.outbox == {} and len(got & set(range(100, 130))) >= 3
        # a resent request finds its final reply in the cache: the exec was cancelled, with an error
        await sock.send_multipart(p.encode(p.Exec(s2, "sleep 30", 1, 1), 4, token=token))
        cancelled = await final(4)
        assert cancelled.msg.code == "CANCELLED" and "outbox full" in cancelled.msg.message
        assert len(agent.runs) == 1  # nothing ran twice
    finally:
        sock.close(0)
        ctx.term()
