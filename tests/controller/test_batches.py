"""Batches on the wire (protocol 1.5, rule 7) with a real controller and real ZeroMQ sockets:
requests in one batch are each answered once, a bad item is answered alone, what one decision
starts on a node reaches its agent in one message, and peers of protocol 1.4 get no batches.
Counts, not timings."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tangram import protocol as p


async def _finals(raw: Any, rids: set[int], quiet_s: float = 0.5) -> dict[int, list[p.Envelope]]:
    """Every final reply for `rids` until each has one, then `quiet_s` more to catch a second."""
    got: dict[int, list[p.Envelope]] = {rid: [] for rid in rids}
    while any(not v for v in got.values()):
        env = await raw.recv(10)
        if env.request_id in got and isinstance(env.msg, (p.Result, p.Error)):
            got[env.request_id].append(env)
    try:
        while True:
            env = await raw.recv(quiet_s)
            if env.request_id in got and isinstance(env.msg, (p.Result, p.Error)):
                got[env.request_id].append(env)
    except (TimeoutError, asyncio.TimeoutError):
        pass
    return got


async def _open(raw: Any) -> str:
    await raw.send(p.SandboxOpen(mem_mib=64), 2)
    return (await raw.final(2)).msg.body["sandbox"]


async def test_a_batch_of_requests_is_answered_once_each_and_a_bad_item_alone(
    controller, agent, raw_client
) -> None:
    raw = raw_client(controller.submit_addr)
    sb = await _open(raw)
    runs = [p.encode(p.Exec(sb, "true", 1, 1), rid, token=raw.token) for rid in range(100, 120)]
    unknown = [p.encode(p.Exec(sb + "-gone", "true", 1, 1), rid, token=raw.token) for rid in range(200, 230)]
    bad = p.encode_trusted(p.Exec(sb, "true", 0, 1), 999)  # cpus_min 0: only a trusted encoder writes it
    (message,) = p.pack([*runs, bad, *unknown], raw.token)
    await raw.send_raw(message)
    got = await _finals(raw, set(range(100, 120)) | set(range(200, 230)) | {999})
    assert {rid: len(v) for rid, v in got.items() if len(v) != 1} == {}
    assert all(isinstance(got[rid][0].msg, p.Result) for rid in range(100, 120))
    assert all(got[rid][0].msg.code == "BAD_REQUEST" for rid in range(200, 230))
    assert got[999][0].msg.code == "BAD_REQUEST" and "cpus_min" in got[999][0].msg.message
    assert len(agent.runs) == 20
    assert raw.batches_in >= 1  # the 30 refusals of one batch went back in one
    assert controller.gateway.batcher.batched >= 30


async def test_a_client_of_protocol_1_4_is_sent_no_batches(controller, agent, raw_client) -> None:
    raw = raw_client(controller.submit_addr, minor=p.BATCH_MINOR - 1)
    sb = await _open(raw)
    for rid in range(200, 240):
        await raw.send(p.Exec(sb + "-gone", "true", 1, 1), rid)
    got = await _finals(raw, set(range(200, 240)))
    assert all(len(v) == 1 for v in got.values())
    assert raw.batches_in == 0


@pytest.mark.parametrize("minor", [p.PROTOCOL_MINOR, p.BATCH_MINOR - 1])
async def test_one_decision_reaches_an_agent_in_one_message(
    controller, make_agent, raw_client, minor
) -> None:
    node = await make_agent(controller, "n1", cpus=tuple(range(8)), minor=minor)
    raw = raw_client(controller.submit_addr)
    sbs = []
    for rid in (2, 3, 4, 5):
        await raw.send(p.SandboxOpen(mem_mib=64), rid)
        sbs.append((await raw.final(rid)).msg.body["sandbox"])
        await raw.send(p.Exec(sbs[-1], "true", 1, 1), rid + 10)  # placed and created on the node now
        await raw.final(rid + 10)
    node.batches_in = 0
    execs = [p.encode(p.Exec(sbs[i % 4], "sleep 0.3", 1, 1), 100 + i, token=raw.token) for i in range(16)]
    (message,) = p.pack(execs, raw.token)
    await raw.send_raw(message)
    got = await _finals(raw, set(range(100, 116)))
    assert all(len(v) == 1 and isinstance(v[0].msg, p.Result) for v in got.values())
    assert len(node.runs) == 16 + 4
    if minor >= p.BATCH_MINOR:
        assert node.batches_in >= 1  # several Spawns of one decision in one message
    else:
        assert node.batches_in == 0  # an agent of protocol 1.4 gets each alone


async def test_the_client_library_sends_what_one_loop_iteration_asks_in_batches(controller, agent) -> None:
    import tangram

    async with tangram.AsyncClient(controller.submit_addr, name="batcher") as tg:
        sb = await tg.sandbox(mem="64MiB")
        results = await asyncio.gather(*(sb.exec("true") for _ in range(100)))
        transport = tg._transport
        assert [r.exit_code for r in results] == [0] * 100
        assert transport.batches_sent >= 2  # 100 requests of one iteration: at least two of 64
        assert transport.stray_replies == 0 and transport.resent == 0
    assert len(agent.runs) == 100
    assert controller.gateway.counters["replayed"] == 0 and controller.gateway.counters["joined"] == 0


class _Sock:
    """A stand-in for the ROUTER's synchronous side: records sends, or refuses them all."""

    def __init__(self, refuse: bool = False) -> None:
        self.sent: list[list[bytes]] = []
        self.refuse = refuse

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        import zmq

        if self.refuse:
            raise zmq.Again()
        self.sent.append(frames)


def test_the_batcher_sends_a_connections_first_words_at_once_and_hands_back_what_did_not_go() -> None:
    from tangram_cli.controller.wire import Batcher

    sock = _Sock()
    batcher = Batcher(sock, lambda ident: True, lambda ident, frames: None)
    with batcher.holding():
        batcher.send(b"c", p.encode(p.Welcome(1, p.PROTOCOL_MINOR, 7), 0))
        batcher.send(b"c", p.encode(p.Result({}), 1))
        batcher.send(b"c", p.encode(p.Result({}), 2))
        assert len(sock.sent) == 1 and p.decode(sock.sent[0][1:]).msg == p.Welcome(1, p.PROTOCOL_MINOR, 7)
    assert len(sock.sent) == 2 and p.is_batch(sock.sent[1][1:])
    assert [e.request_id for e in p.decode_all(sock.sent[1][1:])] == [1, 2]

    failed: list[tuple[bytes, int]] = []
    refusing = Batcher(
        _Sock(refuse=True), lambda ident: True, lambda i, f: failed.append((i, p.decode(f).request_id))
    )
    with refusing.holding():
        for rid in (3, 4, 5):
            refusing.send(b"d", p.encode(p.Result({}), rid))
    assert failed == [(b"d", 3), (b"d", 4), (b"d", 5)]  # in order, as unsent finals


def test_the_batcher_asks_again_at_release_and_hands_back_what_may_no_longer_go() -> None:
    """A peer that could be sent to when its message was held but not at release (a client whose
    connection dropped meanwhile) gets nothing; its messages go to `on_fail`, in order, and the
    `before_release` hook (the gateway's monitor read) runs once, before any send."""
    from tangram_cli.controller.wire import Batcher

    sock, open_peers, order = _Sock(), {b"a", b"b"}, []
    failed: list[tuple[bytes, int]] = []
    batcher = Batcher(
        sock,
        lambda ident: ident in open_peers,
        lambda i, f: failed.append((i, p.decode(f).request_id)),
        lambda: order.append(len(sock.sent)),
    )
    with batcher.holding():
        for rid in (1, 2):
            batcher.send(b"a", p.encode(p.Result({}), rid))
            batcher.send(b"b", p.encode(p.Result({}), rid + 10))
        open_peers.discard(b"a")  # dropped while held
    assert order == [0]  # once, before anything was sent
    assert failed == [(b"a", 1), (b"a", 2)]
    assert len(sock.sent) == 1 and sock.sent[0][0] == b"b"
    assert [e.request_id for e in p.decode_all(sock.sent[0][1:])] == [11, 12]
