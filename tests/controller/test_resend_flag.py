"""Protocol 1.8's resend flag: a client library's copy of a request, sent after a `Welcome`, whose
final reply already went out over the connection the copy came over is not answered again (the
reply is on its way, in order); an unmarked copy, or a marked one over a new connection, is."""

from __future__ import annotations

import zmq
import zmq.asyncio
from support.waiting import until

from tangram import protocol as p


async def _hang_up(raw, controller) -> bytes:
    """End the raw client's connection and wait until the controller saw it; its identity."""
    counters = controller.gateway.counters
    drops = counters["client_disconnects"]
    ident = raw.sock.getsockopt(zmq.IDENTITY)
    raw.sock.close(0)
    await until(lambda: counters["client_disconnects"] > drops, what="the controller saw the disconnect")
    return ident


def _dial(raw, controller, ident: bytes) -> None:
    """The same session (identity, token) over a new connection."""
    raw.sock = raw.ctx.socket(zmq.DEALER)
    raw.sock.setsockopt(zmq.IDENTITY, ident)
    raw.sock.setsockopt(zmq.LINGER, 0)
    raw.sock.connect(controller.submit_addr)


async def _next_final(raw) -> p.Envelope:
    while True:
        env = await raw.recv()
        if isinstance(env.msg, (p.Result, p.Error)):
            return env


async def _exec_in_new_sandbox(raw, cmd: str, rid: int) -> list[bytes]:
    """Open a sandbox and send one exec in it with request id ``rid``; its frames, for copies."""
    await raw.send(p.SandboxOpen(), 1)
    sandbox = (await raw.final(1)).msg.body["sandbox"]
    frames = p.encode(p.Exec(sandbox, cmd, 1, 1), rid, token=raw.token)
    await raw.send_raw(frames)
    return frames


async def test_a_marked_copy_of_an_answered_request_is_not_answered_again(
    controller, agent, raw_client
) -> None:
    raw = raw_client(controller.submit_addr)
    exec_frames = await _exec_in_new_sandbox(raw, "echo once >> marker; wc -l < marker", 7)
    first = await raw.final(7)
    assert first.blobs[0].strip() == b"1"
    counters = controller.gateway.counters
    replayed = counters["replayed"]

    await raw.send_raw(p.as_resend(exec_frames))  # its final already went out over this connection
    await raw.send(p.SandboxOpen(), 8)
    after = await _next_final(raw)
    assert after.request_id == 8  # nothing for 7 came before 8's reply (one connection keeps order)
    assert counters["resends_already_answered"] == 1 and counters["replayed"] == replayed

    await raw.send_raw(exec_frames)  # an unmarked copy: "gets that reply again" (docs/protocol.md)
    again = await _next_final(raw)
    assert again.request_id == 7 and again.blobs == first.blobs and counters["replayed"] == replayed + 1
    assert len(agent.runs) == 1


async def test_a_marked_copy_over_a_new_connection_is_answered(controller, agent, raw_client) -> None:
    raw = raw_client(controller.submit_addr)
    await raw.send(p.SandboxOpen(), 1)
    await raw.final(1)
    cancel = p.encode(p.Cancel(target_request_id=99), 5, token=raw.token)  # a request with a cached final
    await raw.send_raw(cancel)
    first = await raw.final(5)
    counters = controller.gateway.counters
    _dial(raw, controller, await _hang_up(raw, controller))  # the same session over a new connection
    await raw.send_raw(p.as_resend(cancel))  # the first answer may have been lost with the old one
    again = await _next_final(raw)
    assert again.request_id == 5 and again.msg == first.msg
    assert counters["resends_already_answered"] == 0


async def test_a_final_kept_while_disconnected_counts_as_sent_once_the_new_connection_takes_it(
    controller, agent, raw_client
) -> None:
    raw = raw_client(controller.submit_addr)
    exec_frames = await _exec_in_new_sandbox(raw, "sleep 0.5; echo done", 7)
    await until(lambda: agent.runs, what="the exec started")
    gateway = controller.gateway
    ident = await _hang_up(raw, controller)
    entry = gateway.cache[(ident, 7)]
    await until(lambda: entry.final is not None, what="the final, kept for the session")
    assert ident in gateway.outbox  # kept: its connection is gone
    _dial(raw, controller, ident)
    await raw.send_raw(p.as_resend(exec_frames))  # its frame sends the kept final over this connection
    await raw.send(p.SandboxOpen(), 8)
    got = [(await _next_final(raw)).request_id, (await _next_final(raw)).request_id]
    assert got == [7, 8] and gateway.counters["resends_already_answered"] == 1
