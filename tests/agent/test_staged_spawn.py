"""Staged starts on a real agent (agent/staged.py): a Spawn with ``after`` runs on its
predecessor's cores once the predecessor's process is gone, never before, and a kill while
staged drops it unstarted. Real agent, process executor, real ZeroMQ on 127.0.0.1 (the test
"controller" of test_link.py); the checks read files the actions wrote, not timings."""
from __future__ import annotations

import asyncio

import pytest
import test_link
from test_link import HB, FakeController, sandbox, spawn, two_cpus, welcomed

from agent import staged
from tangram import protocol as p
from tangram.outcomes import ExecOutcome

ctl, start = test_link.ctl, test_link.start  # the fixtures of test_link.py


@pytest.fixture(autouse=True)
def patient(monkeypatch):
    """The tests of what a staged start waits for: no give-back within them (those below set it)."""
    monkeypatch.setattr(staged, "GIVE_BACK_S", 60.0)


async def send(ctl: FakeController, ident: bytes, msg: p.Message) -> int:
    ctl.rid += 1
    await ctl.send(ident, msg, ctl.rid)
    return ctl.rid


async def replies(ctl: FakeController, rids: list[int], timeout: float = 10.0,
                  ) -> list[tuple[int, p.Envelope]]:
    """The replies to ``rids``, in the order they arrived (Acks of kills are skipped)."""
    got: list[tuple[int, p.Envelope]] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while len(got) < len(rids):
        _, env = await ctl.recv(max(0.05, end - loop.time()))
        if env.request_id in rids and not isinstance(env.msg, p.Ack):
            got.append((env.request_id, env))
    return got


def outcome(env: p.Envelope) -> ExecOutcome:
    assert isinstance(env.msg, p.Result), env.msg
    return ExecOutcome.from_body(env.msg.body)


async def test_a_staged_spawn_starts_when_its_predecessor_has_ended(ctl, start, tmp_path):
    _, ident, hello = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    core = two_cpus()[0]
    a = await send(ctl, ident, spawn("a", "sleep 0.4; echo a-done > a.txt", [core]))
    b = await send(ctl, ident, spawn("b", "cat a.txt", [core], after="a"))
    (first, env_a), (second, env_b) = await replies(ctl, [a, b])
    assert (first, second) == (a, b)  # a's result first: b started only at a's exit
    assert env_b.blobs[0] == b"a-done\n"  # b ran after a had written its file and exited
    res = outcome(env_b)
    assert res.exit_code == 0 and not res.killed and res.cores == (core,)
    assert res.waited_s > 0.1  # it waited on the agent for a's end, not in the controller


async def test_after_an_action_that_is_not_here_starts_at_once(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    env = await ctl.request(ident, spawn("b", "echo hi", [two_cpus()[0]], after="gone-long-ago"))
    assert env.blobs[0] == b"hi\n" and outcome(env).exit_code == 0


async def test_a_kill_while_staged_answers_at_once_and_nothing_runs(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    core = two_cpus()[0]
    a = await send(ctl, ident, spawn("a", "sleep 0.5", [core]))
    b = await send(ctl, ident, spawn("b", "echo ran > b.txt", [core], after="a"))
    await send(ctl, ident, p.Kill("b"))
    (first, env_b), (second, env_a) = await replies(ctl, [a, b])
    assert (first, second) == (b, a)  # dropped unstarted: answered before a ends
    res = outcome(env_b)
    assert res.killed and res.exit_code == -1 and res.run_s == 0.0
    env = await ctl.request(ident, spawn("c", "ls", [core]))
    assert b"b.txt" not in env.blobs[0]  # b never ran


async def test_a_chain_behind_a_dropped_link_still_waits_for_the_first(ctl, start, tmp_path):
    """a runs; b is staged after a, c after b; b is killed while staged: c must still wait for a
    (its cores are a's), not start when b's drop is answered."""
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    core = two_cpus()[0]
    a = await send(ctl, ident, spawn("a", "sleep 0.5; echo a-done > a.txt", [core]))
    b = await send(ctl, ident, spawn("b", "true", [core], after="a"))
    c = await send(ctl, ident, spawn("c", "cat a.txt", [core], after="b"))
    await send(ctl, ident, p.Kill("b"))
    got = await replies(ctl, [a, b, c])
    assert [rid for rid, _ in got] == [b, a, c]
    assert got[2][1].blobs[0] == b"a-done\n"


async def test_a_new_session_never_starts_what_the_old_one_staged(ctl, start, tmp_path):
    run, ident, _ = await welcomed(ctl, start, tmp_path, heartbeat_s=HB)
    await sandbox(ctl, ident)
    core = two_cpus()[0]
    a = await send(ctl, ident, spawn("a", "sleep 2.0", [core]))
    b = await send(ctl, ident, spawn("b", "echo ran > b.txt", [core], after="a"))
    # no heartbeats from here: after 3 x HB of silence the agent says Hello again, while a runs
    _, env = await ctl.expect(p.Hello, timeout=5.0)
    hello = env.msg
    assert run.agent._running["a"].outcome.done() is False  # a still runs: b is still staged
    await ctl.send(ident, p.Welcome(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, 8, 2, 1.0))
    assert {x["action"] for x in hello.actions} == {"a", "b"}  # the staged one is listed too
    got = dict(await replies(ctl, [a, b], timeout=10))
    res = outcome(got[b])
    assert res.killed and res.exit_code == -1
    assert not outcome(got[a]).killed  # a ran to its end
    env = await ctl.request(ident, spawn("c", "ls", [core], epoch=8, agent_epoch=2))
    assert b"b.txt" not in env.blobs[0]
    assert not run.agent._running


async def test_a_start_whose_predecessor_overruns_is_given_back_unstarted(ctl, start, tmp_path, monkeypatch):
    """1.7: the core guessed a's end wrong (it runs 2 s): b is given back unstarted after
    GIVE_BACK_S, before a ends, and never runs; a runs to its end."""
    monkeypatch.setattr(staged, "GIVE_BACK_S", 0.3)
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    core = two_cpus()[0]
    a = await send(ctl, ident, spawn("a", "sleep 2", [core]))
    b = await send(ctl, ident, spawn("b", "echo ran > b.txt", [core], after="a"))
    (first, env_b), (second, env_a) = await replies(ctl, [a, b])
    assert (first, second) == (b, a)
    res = outcome(env_b)
    assert res.unstaged and not res.killed and res.exit_code == -1 and res.waited_s >= 0.3
    assert outcome(env_a).exit_code == 0 and not outcome(env_a).unstaged
    env = await ctl.request(ident, spawn("c", "ls", [core]))
    assert b"b.txt" not in env.blobs[0]


async def test_a_start_given_back_runs_again_and_its_followers_wait_for_that_run_only(ctl, start, tmp_path,
                                                                                   monkeypatch):
    """b is given back while a still runs (a longer run); b is sent again on the other core, and c
    is staged behind that new run: c starts when b's new run ends, not when a does (b's old,
    dropped flight, which waits for a, is not b's new one)."""
    monkeypatch.setattr(staged, "GIVE_BACK_S", 0.3)
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    first_core, other = two_cpus()
    a = await send(ctl, ident, spawn("a", "sleep 2", [first_core]))  # (< 3 heartbeats: no heartbeats here)
    b = await send(ctl, ident, spawn("b", "true", [first_core], after="a"))
    [(rid, env)] = await replies(ctl, [b])
    assert outcome(env).unstaged
    b2 = await send(ctl, ident, spawn("b", "sleep 0.2; echo b > b.txt", [other]))
    c = await send(ctl, ident, spawn("c", "cat b.txt", [other], after="b"))
    got = await replies(ctl, [a, b2, c])
    assert [r for r, _ in got] == [b2, c, a]  # c ran on b's new run's core well before a ended
    assert got[1][1].blobs[0] == b"b\n" and not outcome(got[1][1]).unstaged


async def test_an_old_controller_never_gets_a_start_back(ctl, start, tmp_path, monkeypatch):
    """A controller of 1.6 cannot queue a start again: to it the agent waits, as before."""
    monkeypatch.setattr(staged, "GIVE_BACK_S", 0.1)
    _, ident, _ = await welcomed(ctl, start, tmp_path, minor=6)
    await sandbox(ctl, ident)
    core = two_cpus()[0]
    a = await send(ctl, ident, spawn("a", "sleep 0.6; echo a-done > a.txt", [core]))
    b = await send(ctl, ident, spawn("b", "cat a.txt", [core], after="a"))
    got = await replies(ctl, [a, b])
    assert [r for r, _ in got] == [a, b] and got[1][1].blobs[0] == b"a-done\n"
