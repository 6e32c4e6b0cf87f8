"""The CPU pass's decisions pinned to exact values where the mutation run of docs/testing.md
found them unchecked: policies at their edges, a table elasticity's useful maximum, the
statuses of held candidates, the memo of a waiting action's options, a sandbox's first
placement, and a head its node can never hold."""

from __future__ import annotations

import pytest
from sched_util import Ledger, exec_spec, node
from test_hold_for_units import _fill_with_tools, _teach_tool_history
from test_scheduler import make, open_sb, started

from tangram.core import commands as cmd
from tangram.core import cpu_pass
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind, duration
from tangram.core.resources import CPU, Demand
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.state import Waiting
from tangram.core.status import Shortfall, wait


def submit(s: Scheduler, spec, now: float = 0.0) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(spec), now)


def test_fixed_dop_counts_only_under_the_fixed_policy():
    cases = (
        ({"fixed_dop": 4}, 8),  # tangram ignores fixed_dop
        ({"policy": "fixed", "fixed_dop": 0}, 8),  # no K: elastic as under tangram
        ({"policy": "fixed", "fixed_dop": 1}, 1),
        ({"policy": "fixed", "fixed_dop": 3}, 3),
    )
    for cfg, want in cases:
        s = make(cores=8, **cfg)
        open_sb(s, "sb")
        (spawn,) = started(submit(s, exec_spec("a", "sb", 1, 8, t_ori=8.0, serial=0.0)))
        assert spawn.dop == want, cfg
        assert spawn.est_s == duration(8.0, Elasticity.amdahl(0.0), want), cfg


def test_a_profiled_elasticity_is_not_given_more_cores_than_its_table_uses():
    s = make(cores=8)
    open_sb(s, "sb")
    el = Elasticity.of_table({1: 1.0, 2: 0.9, 4: 0.8})
    spec = ActionSpec(
        "a", Kind.EXEC, ((CPU, Demand.range(1, 8)),), sandbox="sb", t_ori=8.0, elasticity=el, client="c"
    )
    (spawn,) = started(submit(s, spec))
    assert (spawn.dop, spawn.cores, spawn.est_s) == (4, (0, 1, 2, 3), 8.0 / (0.8 * 4))


def test_a_max_policy_candidate_takes_what_its_predecessors_leave():
    s = make(cores=8, policy="max")
    open_sb(s, "a")
    open_sb(s, "b")
    open_sb(s, "c")
    for aid in ("a", "b", "c"):
        s.handle(ev.ActionSubmitted(exec_spec(aid, aid, 2, 6, t_ori=4.0, serial=0.0)), 0.0, decide=False)
    out = s.decide(0.0)
    # the minimums first (2 + 2 + 2 of 8), then the spare 2 to the first in FCFS order
    assert [(c.action_id, c.dop) for c in started(out)] == [("a", 4), ("b", 2), ("c", 2)]


def test_a_held_prefix_says_who_waits_for_more_cores_and_who_waits_behind_it():
    s = make(cores=16)
    led = Ledger(s)
    _teach_tool_history(s, led)
    _fill_with_tools(s, led, 14, now=1.0)
    open_sb(s, "r", now=1.0)
    led.apply(submit(s, exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05), 1.1))
    open_sb(s, "late", now=1.2)
    led.apply(submit(s, exec_spec("late", "late", 1, action_type="tool"), 1.2))
    assert s.status_of("reward") == wait(
        Shortfall(CPU, 16, 2, 16, "n1"),
        message="waiting for more cores: a run on the 2 free now would end later",
    )
    assert s.status_of("late") == wait(message="behind reward, which waits for more cores on n1")


def test_candidates_held_back_by_greedy_eviction_say_so():
    s = make(cores=4)
    led = Ledger(s)
    _teach_tool_history(s, led)
    open_sb(s, "b")
    open_sb(s, "x")
    led.apply(submit(s, exec_spec("big", "b", 3, 3, t_ori=3.0), 1.0))
    led.apply(submit(s, exec_spec("long", "x", 1, action_type="other"), 1.0))
    for name in ("r", "y", "z"):
        open_sb(s, name, now=1.0)
    led.apply(submit(s, exec_spec("reward", "r", 1, 4, t_ori=160.0, serial=0.05), 1.1))
    led.apply(submit(s, exec_spec("y", "y", 1, action_type="tool"), 1.2))
    led.apply(submit(s, exec_spec("z", "z", 1, action_type="tool"), 1.3))
    out = s.handle(ev.ActionFinished("big", ok=True), 4.0)
    (spawn,) = started(out)
    assert spawn == cmd.Spawn("reward", "n1", "r", (0, 1, 2), 3, duration(160.0, Elasticity.amdahl(0.05), 3))
    held = wait(message="held back: starting it now would raise the summed completion time")
    assert s.status_of("y") == held and s.status_of("z") == held


def test_the_options_of_a_waiting_action_follow_its_t_ori():
    s = make(cores=8)
    open_sb(s, "sb")
    spec = exec_spec("a", "sb", 1, 4, t_ori=None, serial=0.0, action_type="t")
    w = Waiting(spec, 1, 0.0, None, need=1)
    opts, _ = cpu_pass._memo_options(s._ctx, w, 3)
    assert opts == {1: 1.0}  # unknown duration: the minimum only
    s.history.record("t", 8.0)
    opts, _ = cpu_pass._memo_options(s._ctx, w, 3)
    assert opts == {u: duration(8.0, Elasticity.amdahl(0.0), u) for u in (1, 2, 3, 4)}
    assert cpu_pass._memo_options(s._ctx, w, 1)[0] == {1: 8.0, 2: 4.0}  # per spare count
    s.history.record("t", 18.0)  # mean 10
    assert cpu_pass._memo_options(s._ctx, w, 1)[0] == {1: 10.0, 2: 5.0}


def test_a_new_trajectory_reserves_the_memory_of_its_sandbox_not_of_its_action():
    s = Scheduler()
    s.handle(node("small", 4, mem=2_000), 0.0)
    s.handle(node("large", 4, mem=6_000), 0.0)
    s.handle(ev.SandboxOpened("sb", client="c", mem_mib=3_000, image="py"), 0.0)
    out = submit(s, exec_spec("a", "sb", 1))
    assert out[0] == cmd.CreateSandbox("large", "sb", 3_000, "py")
    open_sb(s, "other", mem=2_500)  # "large" keeps 3000 free, "small" 2000: only "large" holds it
    assert submit(s, exec_spec("b", "other", 1))[0] == cmd.CreateSandbox("large", "other", 2_500)


def test_new_trajectories_placed_in_one_pass_spread_by_the_memory_that_pass_left():
    s = Scheduler()
    s.handle(node("n1", 4, mem=8_000), 0.0)
    s.handle(node("n2", 4, mem=8_000), 0.0)
    for i, n in ((1, "n1"), (2, "n2")):
        s.handle(ev.SandboxOpened(f"hog{i}", client="c", mem_mib=0), 0.0)
        assert submit(s, exec_spec(f"h{i}", f"hog{i}", 4))[0].node == n
    for i in range(4):
        s.handle(ev.SandboxOpened(f"t{i}", client="c", mem_mib=1_000), 0.0)
        assert started(submit(s, exec_spec(f"x{i}", f"t{i}", 1), 0.5)) == []  # no core free anywhere
    s.handle(ev.ActionFinished("h1"), 1.0, decide=False)
    out = s.handle(ev.ActionFinished("h2"), 1.0)  # one pass places all four
    placed = {c.sandbox: c.node for c in out if isinstance(c, cmd.CreateSandbox)}
    assert sorted(placed.values()) == ["n1", "n1", "n2", "n2"], placed  # not four on the first node


def test_queued_actions_of_a_sandbox_follow_it_to_its_node():
    s = make(cores=2)
    open_sb(s, "hog")
    submit(s, exec_spec("h", "hog", 2))
    open_sb(s, "sb")
    submit(s, exec_spec("a", "sb", 1), 1.0)
    submit(s, exec_spec("b", "sb", 1), 1.1)  # both wait before the sandbox has a node
    out = s.handle(ev.ActionFinished("h"), 2.0)
    assert [type(c) for c in out] == [cmd.Done, cmd.CreateSandbox, cmd.Spawn, cmd.Spawn]
    assert [c.action_id for c in started(out)] == ["a", "b"]
    assert s.pending.cpu_queues() == []


def test_a_head_its_sandboxs_node_can_never_hold_is_rejected_with_the_nodes_size():
    s = Scheduler(CoreConfig())
    s.handle(node("big", 8, mem=1000), 0.0)
    s.handle(node("small", 2, mem=64_000), 0.0)
    for sb in ("x", "filler", "filler2"):
        s.handle(ev.SandboxOpened(sb, client="c", mem_mib=10), 0.0)
    submit(s, exec_spec("fill", "filler", 2, t_ori=5.0))  # small (more memory)
    submit(s, exec_spec("fill2", "filler2", 8, t_ori=5.0))  # big
    submit(s, exec_spec("a", "x", 1, t_ori=1.0))
    submit(s, exec_spec("b", "x", 4, t_ori=1.0))
    out = s.handle(ev.ActionFinished("fill"), 1.0)  # "a" lands on small: "b" can never run there
    assert out[1:] == [  # rejections, then bindings, then starts
        cmd.Reject(
            "b", "NO_CAPACITY", "its sandbox's node is too small", (Shortfall(CPU, 4, 2, 2, "small"),)
        ),
        cmd.CreateSandbox("small", "x", 10),
        cmd.Spawn("a", "small", "x", (0,), 1, 1.0),
    ]


def test_a_blocked_head_on_a_node_says_how_many_of_its_cores_are_free():
    s = make(cores=4)
    open_sb(s, "a")
    open_sb(s, "b")
    submit(s, exec_spec("x", "a", 3))
    submit(s, exec_spec("y", "b", 1))
    s.handle(ev.ActionFinished("y"), 1.0)  # b is bound to n1
    submit(s, exec_spec("z", "b", 2), 2.0)
    assert s.status_of("z") == wait(Shortfall(CPU, 2, 1, 4, "n1"))
    before = s.examined["cpu"]
    submit(s, exec_spec("z2", "b", 1), 3.0)
    assert s.examined["cpu"] - before == 1  # the blocked head only


# -- the queue behind a blocked head, and held nodes -------------------------------------------
def _reward_with(blocked: bool) -> Scheduler:
    """12 one-core tools (1 s history) on a 16-core node; a reward (1-16 cores) arrives with
    4 free, and (``blocked``) an 8-core action of a bound sandbox right behind it."""
    s = Scheduler(CoreConfig())
    s.handle(node("n1", 16), 0.0)
    s.handle(ev.SandboxOpened("w", client="c", mem_mib=0), 0.0)
    submit(s, exec_spec("w0", "w", 1, action_type="tool"))
    s.handle(ev.ActionFinished("w0"), 1.0)
    for i in range(12):
        s.handle(ev.SandboxOpened(f"t{i}", client="c", mem_mib=0), 1.0)
        submit(s, exec_spec(f"tool{i}", f"t{i}", 1, action_type="tool"), 1.0)
    for sb in ("r", "b"):
        s.handle(ev.SandboxOpened(sb, client="c", mem_mib=0), 1.0)
        s.handle(ev.SandboxAdopted(sb, "n1"), 1.0)
    s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 16, t_ori=20.0, serial=0.3)), 1.0, decide=False)
    if blocked:
        s.handle(ev.ActionSubmitted(exec_spec("big", "b", 8, 8, t_ori=1.0)), 1.0, decide=False)
    s.decide(1.0)
    return s


def test_the_action_blocked_behind_the_candidates_weighs_in_their_decision():
    alone = _reward_with(blocked=False)
    assert "reward" not in alone.running  # waits for more than the 4 free cores
    behind = _reward_with(blocked=True)
    assert behind.running["reward"].units == 4  # waiting would keep the 8-core action waiting too
    assert behind.status_of("big") == wait(Shortfall(CPU, 8, 3, 16, "n1"))


def test_a_held_node_is_not_decided_again_when_another_node_changes():
    s = _reward_with(blocked=False)
    due = s.next_deadline()
    assert due is not None and due > 1.0
    s.handle(node("n2", 4, mem=100_000), 1.5)  # more free memory: new trajectories go there
    s.handle(ev.SandboxOpened("other", client="c", mem_mib=0), 1.5)
    out = submit(s, exec_spec("o", "other", 1), 1.5)
    assert [(c.action_id, c.node) for c in started(out)] == [("o", "n2")]
    assert "reward" not in s.running and s.next_deadline() == due
    for i in range(12):  # the tools end: the reward starts, and its old deadline goes
        s.handle(ev.ActionFinished(f"tool{i}"), 2.0)
        if "reward" in s.running:
            break
    assert s.running["reward"].units >= 8
    assert s.next_deadline() is None


def test_a_doomed_head_does_not_stop_its_nodes_queue():
    s = Scheduler(CoreConfig())
    s.handle(node("big", 8, mem=1000), 0.0)
    s.handle(node("small", 2, mem=64_000), 0.0)
    for sb in ("x", "filler", "filler2"):
        s.handle(ev.SandboxOpened(sb, client="c", mem_mib=10), 0.0)
    submit(s, exec_spec("fill", "filler", 2, t_ori=5.0))
    submit(s, exec_spec("fill2", "filler2", 8, t_ori=5.0))
    submit(s, exec_spec("a", "x", 1, t_ori=1.0))
    submit(s, exec_spec("b", "x", 4, t_ori=1.0))
    submit(s, exec_spec("c", "x", 1, t_ori=1.0))
    out = s.handle(ev.ActionFinished("fill"), 1.0)
    assert [c.action_id for c in started(out)] == ["a", "c"]  # "b" is rejected, "c" goes on


def test_new_trajectories_behind_a_blocked_one_are_still_placed():
    s = Scheduler(CoreConfig())
    s.handle(node("n1", 2, mem=10_000), 0.0)
    s.handle(node("n2", 2, mem=1_000), 0.0)
    for sb, mem in (("x", 5_000), ("y", 500), ("h1", 0), ("h2", 0)):
        s.handle(ev.SandboxOpened(sb, client="c", mem_mib=mem), 0.0)
    submit(s, exec_spec("hog1", "h1", 2))
    submit(s, exec_spec("hog2", "h2", 2))
    assert {r.node for r in s.running.values()} == {"n1", "n2"}
    for aid, sb, cores in (("x1", "x", 1), ("x2", "x", 2), ("y1", "y", 1)):
        s.handle(ev.ActionSubmitted(exec_spec(aid, sb, cores)), 1.0, decide=False)
    s.handle(ev.ActionFinished("hog1"), 2.0, decide=False)
    s.handle(ev.ActionFinished("hog2"), 2.0, decide=False)
    out = s.decide(2.0)
    # x1 lands on n1 (memory) and leaves 1 core: x2 waits behind it; y1 still goes to n2
    assert [(c.action_id, c.node) for c in started(out)] == [("x1", "n1"), ("y1", "n2")]


def test_without_eviction_every_candidate_starts():
    for eviction, want in ((True, [("reward", 3), ("y", 1)]), (False, [("reward", 2), ("y", 1), ("z", 1)])):
        s = make(cores=4, eviction=eviction)
        led = Ledger(s)
        _teach_tool_history(s, led)
        for name in ("r", "y", "z", "b"):
            open_sb(s, name, now=1.0)
        submit(s, exec_spec("big", "b", 4, 4, t_ori=3.0), 1.0)
        submit(s, exec_spec("reward", "r", 1, 4, t_ori=160.0, serial=0.05), 1.1)
        submit(s, exec_spec("y", "y", 1, action_type="tool"), 1.2)
        submit(s, exec_spec("z", "z", 1, action_type="tool"), 1.3)
        out = s.handle(ev.ActionFinished("big"), 4.0)
        assert [(c.action_id, c.dop) for c in started(out)] == want, eviction


# -- small pieces ---------------------------------------------------------------------------------
def test_the_peek_reader_counts_what_it_read():
    ws = [Waiting(exec_spec(f"a{i}", "sb", 1), i, 0.0, None, need=1) for i in range(4)]
    p = cpu_pass._Peek(ws[0], iter(ws[1:]))
    assert p.read == 1 and p.peek_seq() == 0 and p.pop() is ws[0]
    assert p.pop() is ws[1] and p.read == 2  # read on demand
    assert p.has_next() and p.read == 3 and p.peek_seq() == 2
    assert p.take(1) == [ws[2]] and p.read == 3
    assert p.take(5) == [ws[3]] and p.read == 4
    assert not p.has_next() and p.read == 4
    with pytest.raises(IndexError, match="^peek_seq on an exhausted queue$"):
        p.peek_seq()


def test_a_node_reads_its_queue_up_to_the_first_action_that_does_not_fit():
    s = make(cores=4)
    for sb in ("a", "b", "c"):
        open_sb(s, sb)
        s.handle(ev.SandboxAdopted(sb, "n1"), 0.0)
    submit(s, exec_spec("x", "a", 3))
    before = s.examined["cpu"]
    s.handle(ev.ActionSubmitted(exec_spec("fits", "b", 1)), 1.0, decide=False)
    s.handle(ev.ActionSubmitted(exec_spec("blocks", "c", 2)), 1.0, decide=False)
    s.handle(ev.ActionSubmitted(exec_spec("after", "b", 1)), 1.0, decide=False)
    out = s.decide(1.0)
    assert [c.action_id for c in started(out)] == ["fits"]
    assert s.examined["cpu"] - before == 2


def test_max_hands_the_spare_cores_out_in_fcfs_order():
    s = make(cores=10, policy="max")
    for aid in ("a", "b", "c"):
        open_sb(s, aid)
    for aid, lo, hi in (("a", 2, 4), ("b", 2, 6), ("c", 1, 1)):
        s.handle(ev.ActionSubmitted(exec_spec(aid, aid, lo, hi, t_ori=4.0, serial=0.0)), 0.0, decide=False)
    assert [(c.action_id, c.dop) for c in started(s.decide(0.0))] == [("a", 4), ("b", 5), ("c", 1)]


def test_an_exec_held_for_its_reservation_frees_its_id_once_it_ran():
    s = make(cores=2)
    open_sb(s, "hog")
    submit(s, exec_spec("h", "hog", 2))
    open_sb(s, "pod", reserve=2, now=0.5)
    submit(s, exec_spec("x", "pod", 1, timeout_s=0.5), 1.0)
    s.handle(ev.ActionFinished("h"), 2.0)
    assert s.running["x"].deadline == 2.5
    s.handle(ev.ActionFinished("x"), 2.2)
    assert isinstance(submit(s, exec_spec("x", "pod", 1), 3.0)[0], cmd.Spawn)  # the id is free again
    assert isinstance(submit(s, exec_spec("x2", "pod", 1), 3.0)[0], cmd.Spawn)


def test_a_trajectorys_later_actions_run_on_its_node_whatever_the_others_memory():
    s = Scheduler()
    s.handle(node("n1", 2, mem=10_000), 0.0)
    s.handle(node("n2", 2, mem=8_000), 0.0)
    s.handle(ev.SandboxOpened("sb", client="c", mem_mib=5_000), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 2)), 0.0, decide=False)
    s.handle(ev.ActionSubmitted(exec_spec("b", "sb", 2)), 0.0, decide=False)
    out = s.decide(0.0)  # a on n1 (more memory); b waits for n1, where its sandbox now lives
    assert [(c.action_id, c.node) for c in started(out)] == [("a", "n1")]
    out = s.handle(ev.ActionFinished("a"), 1.0)
    assert [(c.action_id, c.node) for c in started(out)] == [("b", "n1")]
    s.handle(ev.ActionFinished("b"), 2.0)
    submit(s, exec_spec("c", "sb", 1), 3.0)  # submitted once its sandbox has a node
    assert s.running["c"].node == "n1"


def test_a_fixed_dop_the_demand_does_not_allow_gives_way_to_the_minimum():
    s = make(cores=8, policy="fixed", fixed_dop=3)
    open_sb(s, "sb")
    spec = ActionSpec(
        "a",
        Kind.EXEC,
        ((CPU, Demand.of([2, 4])),),
        sandbox="sb",
        t_ori=4.0,
        elasticity=Elasticity.amdahl(0.0),
        client="c",
    )
    (spawn,) = started(submit(s, spec))
    assert spawn.dop == 2
