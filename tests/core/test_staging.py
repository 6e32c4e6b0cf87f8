"""Staged starts (tangram/core/staging.py): a blocked node's next fixed-size execs are decided
on a running exec's cores before it ends, and take them over when it does.

Each test pins the commands and what the core holds afterwards; the last one drives random
event orders (the agent's reports in any interleaving with kills) and checks that no core is
ever used twice, counting a staged action as using its cores only from its predecessor's end,
exactly as the agent runs it."""
from __future__ import annotations

import dataclasses
import random

from sched_util import exec_spec, node
from test_scheduler import make, open_sb

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.status import ADMITTED


def submit(s: Scheduler, spec, now: float) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(spec), now)


def spawns(out: list[cmd.Command]) -> list[cmd.Spawn]:
    return [c for c in out if isinstance(c, cmd.Spawn)]


def two_running(stage: bool = True, within: float = 10.0, depth: int = 1) -> Scheduler:
    """n1 with 2 cores: "a" (t_ori 1 s) runs in sb1 on core 0, "b" (t_ori 5 s) in sb2 on core 1;
    staging behind runs expected to end within ``within`` seconds, ``depth`` deep."""
    s = make(cores=2, stage=stage, stage_within_s=within, stage_depth=depth)
    open_sb(s, "sb1")
    open_sb(s, "sb2")
    assert spawns(submit(s, exec_spec("a", "sb1", 1, t_ori=1.0), 0.0))[0].cores == (0,)
    assert spawns(submit(s, exec_spec("b", "sb2", 1, t_ori=5.0), 0.0))[0].cores == (1,)
    return s


def test_without_staging_a_blocked_head_waits_for_the_end():
    s = two_running(stage=False)
    assert submit(s, exec_spec("c", "sb1", 1, t_ori=1.0), 0.1) == []
    assert "c" in s.queues["cpu"] and len(s.stages) == 0


def test_the_blocked_head_is_staged_behind_the_run_expected_to_end_first():
    s = two_running()
    out = submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    assert out == [cmd.Spawn("c", "n1", "sb2", (0,), 1, 1.0, after="a")]
    assert "c" not in s.queues.get("cpu", {}) and "c" not in s.running
    assert s.status_of("c") == ADMITTED and s.snapshot().staged == 1
    assert s.cpu.nodes["n1"].free == 0
    # d: b (ends at 5) is free of followers, but the chain a→c ends at 2: a core frees sooner there
    assert submit(s, exec_spec("d", "sb1", 1, t_ori=1.0), 0.2) == []
    assert "d" in s.queues["cpu"]
    assert dict(s.counters)["staged"] == 1


def test_nothing_is_staged_behind_a_run_expected_to_end_later_than_the_window():
    s = two_running(within=0.5)  # a is expected to end in 0.9 s
    assert submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1) == []
    assert spawns(submit(s, exec_spec("d", "sb1", 1, t_ori=1.0), 0.6)) == [
        cmd.Spawn("c", "n1", "sb2", (0,), 1, 1.0, after="a")]  # at 0.6 a's end is 0.4 s away: c, the head
    assert "d" in s.queues["cpu"]  # b ends in 4.4 s


def test_the_predecessors_end_hands_its_cores_to_the_staged_one_without_a_second_spawn():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    assert submit(s, exec_spec("d", "sb1", 1, t_ori=1.0), 0.2) == []
    out = s.handle(ev.ActionFinished("a"), 1.0)
    assert cmd.Done("a", True, "") in out
    assert s.running["c"].cores == (0,) and s.running["c"].started == 1.0
    assert s.cpu.nodes["n1"].free == 0  # the core never went back to the pool
    # d, still blocked, is staged behind c now (c ends at 2.0, before b at 5.0)
    assert spawns(out) == [cmd.Spawn("d", "n1", "sb1", (0,), 1, 1.0, after="c")]
    out = s.handle(ev.ActionFinished("c"), 2.0)
    assert s.running["d"].cores == (0,) and s.cpu.nodes["n1"].free == 0
    s.handle(ev.ActionFinished("d"), 3.0)
    assert s.cpu.nodes["n1"].free == 1 and len(s.stages) == 0


def test_chains_grow_to_the_depth_and_a_dropped_link_passes_its_follower_on():
    s = two_running(depth=2)
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    assert spawns(submit(s, exec_spec("d", "sb1", 1, t_ori=1.0), 0.2)) == [
        cmd.Spawn("d", "n1", "sb1", (0,), 1, 1.0, after="c")]  # a→c ends at 2, before b at 5
    assert submit(s, exec_spec("e", "sb2", 1, t_ori=1.0), 0.3) == []  # a→c→d is full and ends at 3
    s.handle(ev.ActionCancelled("c", "cancelled"), 0.4)
    out = s.handle(ev.ActionFinished("c", ok=False, reason="killed"), 0.5)
    assert out == [cmd.Done("c", False, "killed")]
    assert s.stages.get("d").after == "a"  # the agent holds d until a is gone too
    out = s.handle(ev.ActionFinished("a"), 1.0)
    assert s.running["d"].cores == (0,) and s.cpu.nodes["n1"].free == 0
    assert spawns(out) == [cmd.Spawn("e", "n1", "sb2", (0,), 1, 1.0, after="d")]


def test_a_staged_action_killed_and_dropped_unstarted_ends_before_its_predecessor():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    out = s.handle(ev.ActionCancelled("c", "client cancelled"), 0.2)
    assert out == [cmd.Kill("c", "n1", "client cancelled")]
    assert s.handle(ev.ActionCancelled("c", "again"), 0.25) == []  # one kill
    out = s.handle(ev.ActionFinished("c", ok=False, reason="killed"), 0.3)  # the agent dropped it
    assert out == [cmd.Done("c", False, "killed")]
    assert "c" not in s.stages and "c" not in s.running
    s.handle(ev.ActionFinished("a"), 1.0)
    assert s.cpu.nodes["n1"].free == 1  # a had no follower left: its core is free again


def test_a_staged_action_killed_after_its_predecessor_ended_is_killed_running():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    s.handle(ev.ActionCancelled("c", "client cancelled"), 0.2)
    s.handle(ev.ActionFinished("a"), 0.5)  # the agent started c at a's exit, before the kill came
    assert s.running["c"].killed
    out = s.handle(ev.ActionFinished("c", ok=False, reason="killed"), 0.6)
    assert cmd.Done("c", False, "killed") in out and s.cpu.nodes["n1"].free == 1


def test_a_lost_node_fails_its_staged_actions_first_never_started():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    out = s.handle(ev.NodeLost("n1", "power"), 0.5)
    assert out[:2] == [cmd.Done("c", False, "power"), cmd.Reject("c", "SANDBOX_LOST", "n1: power")]
    assert [c.action_id for c in out if isinstance(c, cmd.Done)] == ["c", "a", "b"]
    assert len(s.stages) == 0 and not s.running


def test_closing_the_sandbox_and_the_deadline_kill_a_staged_action():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    out = s.handle(ev.SandboxClosed("sb2"), 0.2)
    assert cmd.Kill("c", "n1", "sandbox closed") in out and cmd.Kill("b", "n1", "sandbox closed") in out
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0, timeout_s=0.5), 0.1)
    assert s.next_deadline() == 0.6
    assert s.handle(ev.Tick(), 0.6) == [cmd.Kill("c", "n1", "timeout")]
    assert s.next_deadline() is None


def test_a_staged_id_is_in_use():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    out = submit(s, exec_spec("c", "sb1", 1), 0.2)
    assert out == [cmd.Reject("c", "BAD_REQUEST", "action id 'c' is already in use")]


def test_elastic_heads_and_other_sizes_are_not_staged_and_nothing_passes_them():
    s = two_running()
    assert submit(s, exec_spec("e", "sb1", 1, 2, t_ori=1.0, serial=0.1), 0.1) == []  # elastic: waits
    assert submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.2) == []  # FCFS behind e
    s = two_running()
    assert submit(s, exec_spec("w", "sb1", 2, t_ori=1.0), 0.1) == []  # 2 cores: no run of that size
    assert len(s.stages) == 0


def test_several_jobs_waiting_turn_staging_off():
    s = two_running()
    s.handle(ev.JobDefined("j1"), 0.0)
    s.handle(ev.JobDefined("j2"), 0.0)
    s.handle(ev.JobJoined("c", "j1"), 0.0)
    s.handle(ev.SandboxOpened("sbx", client="x", mem_mib=1000), 0.0)
    s.handle(ev.JobJoined("x", "j2"), 0.0)
    spec_x = exec_spec("x1", "sbx", 1, t_ori=1.0)
    submit(s, spec_x.__class__(**{**spec_x.__dict__, "client": "x"}), 0.05)  # j2 waits (unplaced)
    assert submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1) == []
    assert len(s.stages) == 0


def test_random_report_orders_never_use_a_core_twice():
    for seed in range(40):
        _random_run(random.Random(seed))


def _random_run(rng: random.Random) -> None:
    """4 cores, 8 sandboxes, 60 one-core execs with random estimates, kills and give-backs. An
    agent model runs what the core sends as agent/staged.py does: a staged Spawn starts once
    every flight of its predecessor is over (at once if none is); a Kill drops a staged one
    unstarted and reports it at once, and so does a give-back (``ActionUnstaged``: the core
    queues it again), and what was staged behind the dropped one waits for its predecessor (a
    later Spawn of the same action is a flight of its own); a Kill ends a running one."""
    s = Scheduler(CoreConfig(stage=True, stage_within_s=1.0, stage_depth=rng.choice([1, 2, 3])))
    s.handle(node("n1", 4), 0.0)
    for i in range(8):
        open_sb(s, f"sb{i}")
    now = 0.0
    busy: dict[int, str] = {}  # core -> running action
    waiting: list[cmd.Spawn] = []  # staged spawns not started
    done: set[str] = set()
    reports: list[tuple[str, bool]] = []

    def open_flight(aid: str) -> bool:
        return aid in busy.values() or any(w.action_id == aid for w in waiting)

    def start(c: cmd.Spawn) -> None:
        for core in c.cores:
            assert core not in busy, f"core {core} used by {busy.get(core)} and {c.action_id}"
            busy[core] = c.action_id

    def settle() -> None:
        while (ready := next((w for w in waiting if not open_flight(w.after)), None)) is not None:
            waiting.remove(ready)
            start(ready)

    def drop(w: cmd.Spawn, event: ev.Event) -> None:
        """Its followers now wait for its predecessor (agent/staged.py, ``Flights.leave``)."""
        waiting.remove(w)
        for i, f in enumerate(waiting):
            if f.after == w.action_id:
                waiting[i] = dataclasses.replace(f, after=w.after)
        apply(s.handle(event, now))
        settle()

    def apply(out: list[cmd.Command]) -> None:
        for c in out:
            if isinstance(c, cmd.Spawn):
                if c.after and open_flight(c.after):
                    waiting.append(c)
                else:
                    start(c)
            elif isinstance(c, cmd.Kill):
                held = next((w for w in waiting if w.action_id == c.action_id), None)
                if held is not None:
                    drop(held, ev.ActionFinished(c.action_id, ok=False))
                elif c.action_id in busy.values():
                    reports.append((c.action_id, False))
            elif isinstance(c, (cmd.Done, cmd.Reject)):
                done.add(c.action_id)

    def agent_ends(aid: str, ok: bool) -> None:
        for core in [k for k, v in busy.items() if v == aid]:
            del busy[core]
        settle()
        apply(s.handle(ev.ActionFinished(aid, ok=ok), now))

    for i in range(60):
        now += rng.random() * 0.3
        apply(submit(s, exec_spec(f"x{i}", f"sb{i % 8}", 1, t_ori=rng.choice([0.1, 0.5, 2.0])), now))
        if rng.random() < 0.15:
            apply(s.handle(ev.ActionCancelled(f"x{rng.randrange(i + 1)}", "cancel"), now))
        if waiting and rng.random() < 0.25:  # its predecessor overran: the agent gives it back
            back = rng.choice(waiting)
            drop(back, ev.ActionUnstaged(back.action_id))
        while reports:
            aid, ok = reports.pop(0)
            if aid in busy.values():
                agent_ends(aid, ok)
        if busy and rng.random() < 0.6:
            agent_ends(rng.choice(sorted(set(busy.values()))), True)
    while busy or reports:
        now += 0.1
        if reports:
            aid, ok = reports.pop(0)
            if aid in busy.values():
                agent_ends(aid, ok)
            continue
        agent_ends(sorted(set(busy.values()))[0], True)
    assert not waiting and len(s.stages) == 0 and not s.running and not s.queues.get("cpu")
    assert done == {f"x{i}" for i in range(60)}  # each answered (Done, or Reject when cancelled queued)
    assert s.cpu.nodes["n1"].free == 4


def test_random_bursts_over_many_sandboxes_keep_the_queues_whole():
    """The queue behind a blocked head is read lazily from the per-sandbox lanes; staging must read
    it before the pass starts or binds anything (a lane read after a removal yields an action twice
    or skips one). Found by `tangram bench burst` (10 clients x 4 sandboxes, thousands queued);
    random batches of submissions and ends, decided per event or per batch."""
    for seed in range(200):
        rng = random.Random(seed)
        sandboxes = rng.choice([3, 6, 12])
        s = make(cores=rng.choice([2, 3, 4]), stage=True, stage_within_s=rng.choice([0.01, 0.05, 1.0]),
                 stage_depth=rng.choice([1, 2]))
        for i in range(sandboxes):
            open_sb(s, f"sb{i}")
        t = 0.0
        for k in range(60):
            spec = exec_spec(f"x{k}", f"sb{rng.randrange(sandboxes)}", 1, t_ori=rng.choice([0.002, 0.02, 0.5]))
            s.handle(ev.ActionSubmitted(spec), t, decide=rng.random() < 0.5)
            t += rng.random() * 0.01
            if rng.random() < 0.4 and s.running:
                s.handle(ev.ActionFinished(rng.choice(sorted(s.running))), t)
        s.decide(t)
        while s.running:
            t += 0.01
            s.handle(ev.ActionFinished(rng.choice(sorted(s.running))), t)
        assert s.counters["finished"] == 60 and not s.queues.get("cpu") and len(s.stages) == 0, seed


def test_a_start_given_back_queues_again_in_its_place_and_nothing_more_is_staged_behind_that_run():
    """The agent gives a staged start back when its predecessor overruns the guess (agent/staged.py):
    it queues again ahead of what came after it, and the next free core takes it."""
    s = two_running(within=1.0)  # b (ends at 5.0) is never within the window
    assert spawns(submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)) == [
        cmd.Spawn("c", "n1", "sb2", (0,), 1, 1.0, after="a")]
    assert submit(s, exec_spec("d", "sb2", 1, t_ori=1.0), 0.2) == []  # queued behind c (same sandbox)
    out = s.handle(ev.ActionUnstaged("c"), 1.5)  # a was to end at 1.0 and still runs
    assert spawns(out) == [] and len(s.stages) == 0 and "c" in s.queues["cpu"]
    assert list(s.queues["cpu"]) == ["c", "d"]  # c is back ahead of d: FCFS holds
    assert submit(s, exec_spec("e", "sb1", 1, t_ori=1.0), 1.6) == []  # nothing staged behind a again
    out = s.handle(ev.ActionFinished("b"), 5.0)  # b's core frees: c takes it; d is staged behind c
    assert spawns(out)[0] == cmd.Spawn("c", "n1", "sb2", (1,), 1, 1.0)
    assert s.running["c"].cores == (1,) and dict(s.counters)["unstaged"] == 1
    out = s.handle(ev.ActionFinished("a"), 6.0)  # a's end gives its core back (no follower of a)
    assert "a" not in s.stages.overran and s.cpu.nodes["n1"].free == 0  # e took it
    assert spawns(out) == [cmd.Spawn("e", "n1", "sb1", (0,), 1, 1.0)]


def test_a_give_back_that_crosses_a_kill_ends_the_action_and_one_for_an_unknown_action_changes_nothing():
    s = two_running()
    submit(s, exec_spec("c", "sb2", 1, t_ori=1.0), 0.1)
    out = s.handle(ev.ActionCancelled("c", "cancelled"), 0.2)
    assert cmd.Kill("c", "n1", "cancelled") in out
    out = s.handle(ev.ActionUnstaged("c"), 0.3)
    assert cmd.Done("c", False, "killed while staged") in out and "c" not in s.queues.get("cpu", {})
    assert s.handle(ev.ActionUnstaged("nobody"), 0.4) == [] and len(s.stages) == 0
    s.handle(ev.ActionFinished("a"), 1.0)
    assert s.cpu.nodes["n1"].free == 1  # a's core came back: c never held it
