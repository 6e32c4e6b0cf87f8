"""A long elastic action that meets one free core waits for more when that finishes sooner.

Without this the scheduler started it on the one core (its only option now) and it kept that
DoP for its whole run: the `fig9` reversal in docs/simulator.md §4.1.
"""
from __future__ import annotations

from sched_util import Ledger, approx_acts, exec_spec
from test_scheduler import make, open_sb, started

from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.approx import Behind
from tangram.core.resources import CPU, Demand
from tangram.core.state import Running, RunningTable


def _fill_with_tools(s, led, n, t_ori=1.0, now=0.0):
    """n one-core tools with a known short history, running on n cores."""
    for i in range(n):
        open_sb(s, f"t{i}", now=now)
        led.apply(s.handle(ev.ActionSubmitted(exec_spec(f"tool{i}", f"t{i}", 1, action_type="tool")), now))
    return [f"tool{i}" for i in range(n)]


def _teach_tool_history(s, led):
    open_sb(s, "warm")
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("w", "warm", 1, action_type="tool")), 0.0))
    led.apply(s.handle(ev.ActionFinished("w", ok=True), 1.0))


def test_long_elastic_run_waits_for_cores_rather_than_locking_in_at_one():
    s = make(cores=16)
    led = Ledger(s)
    _teach_tool_history(s, led)
    tools = _fill_with_tools(s, led, 15, now=1.0)
    open_sb(s, "r", now=1.0)
    out = s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05)), 1.1)
    led.apply(out)
    assert "reward" not in led.started  # one core free: 160 s there vs ~1 s wait for more
    assert "waiting for more cores" in str(s.queues["cpu"]["reward"].status)
    for i, aid in enumerate(tools):
        led.apply(s.handle(ev.ActionFinished(aid, ok=True), 2.0 + 0.01 * i))
        if "reward" in led.started:
            break
    assert s.running["reward"].units >= 8


def test_a_lone_candidate_with_nothing_running_starts_at_once():
    # Nothing on the node will ever free a core: holding back would wait forever.
    s = make(cores=1)
    open_sb(s, "r")
    out = s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05)), 0.0)
    assert started(out)[0].dop == 1


def test_a_long_wait_for_more_cores_is_not_worth_it():
    # The only other action holds 15 cores for 10,000 s: the reward takes the free core now.
    s = make(cores=16)
    led = Ledger(s)
    open_sb(s, "big")
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("big", "big", 15, 15, t_ori=150_000.0, serial=0.0)), 0.0))
    assert s.running["big"].units == 15
    open_sb(s, "r")
    out = s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05)), 1.0)
    assert started(out)[0].dop == 1


def test_fixed_and_min_policies_never_hold_the_lone_candidate():
    for policy in ("min", "fixed"):
        s = make(cores=16, policy=policy, fixed_dop=1)
        led = Ledger(s)
        _teach_tool_history(s, led)
        _fill_with_tools(s, led, 15, now=1.0)
        open_sb(s, "r", now=1.0)
        out = s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05)), 1.1)
        assert started(out), policy
        assert started(out)[0].dop == 1, policy


def test_running_table_indexes_by_node_and_counts_changes():
    t = RunningTable()
    spec = ActionSpec("x", Kind.EXEC, ((CPU, Demand.fixed(1)),), sandbox="sb", client="c")
    a = Running(spec, "n1", 1, 0.0, 1.0)
    b = Running(spec, "n2", 1, 0.0, 1.0)
    t["a"], t["b"] = a, b
    assert t.on("n1") == {"a": a}
    assert t.on("n2") == {"b": b}
    assert t.on("n3") == {}
    before = t.changes("n1")
    assert t.pop("a") is a
    assert t.on("n1") == {}
    assert t.changes("n1") == before + 1
    assert t.pop("a", None) is None
    t["b"] = Running(spec, "n1", 2, 0.0, 1.0)  # replaced onto another node
    assert t.on("n2") == {}
    assert set(t.on("n1")) == {"b"}
    assert len(t) == 1
    assert set(t.on("n1", Kind.EXEC)) == {"b"} and t.on("n1", Kind.CALL) == {}
    assert set(t.of_sandbox("sb")) == {"b"} and set(t.of_client("c")) == {"b"}
    del t["b"]
    assert not t
    assert t.on("n1") == {} and t.on("n1", Kind.EXEC) == {}
    assert t.of_sandbox("sb") == {} and t.of_client("c") == {}


def test_evicting_the_tail_gives_its_units_to_an_elastic_head():
    # 3 cores free up at once for [reward, tool, tool]: the reward's options must reach
    # the units the tools would leave, or greedy eviction can never hand them over.
    s = make(cores=4)
    led = Ledger(s)
    _teach_tool_history(s, led)
    open_sb(s, "b")
    open_sb(s, "x")
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("big", "b", 3, 3, t_ori=3.0)), 1.0))
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("long", "x", 1, action_type="other")), 1.0))
    for name in ("r", "y", "z"):
        open_sb(s, name, now=1.0)
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 4, t_ori=160.0, serial=0.05)), 1.1))
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("y", "y", 1, action_type="tool")), 1.2))
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("z", "z", 1, action_type="tool")), 1.3))
    assert not {"reward", "y", "z"} & led.started
    led.apply(s.handle(ev.ActionFinished("big", ok=True), 4.0))
    assert s.running["reward"].units == 3  # 160 s at one core vs 57 s at three; the tools wait ~1 s


def test_approx_depth_counts_only_actions_with_a_choice():
    tool = Behind(((1, 1.0),))
    reward = Behind(((1, 100.0), (4, 10.0)))
    # depth 1: the tool (one option) must not use up the window; the reward waits for 4 units
    obj = approx_acts(0.0, [], [(1.0, 4)], [tool, reward], capacity_free=0, depth=1)
    assert obj == 2.0 + 12.0
    assert approx_acts(0.0, [], [(1.0, 4)], [tool, reward], capacity_free=0, depth=0) == 2.0 + 101.0


def test_an_overdue_action_is_not_expected_to_end_this_instant():
    from tangram.core import cpu_pass

    s = make(cores=4)
    led = Ledger(s)
    _teach_tool_history(s, led)
    open_sb(s, "a", now=1.0)
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("t", "a", 1, action_type="tool")), 1.0))
    s.handle(ev.Tick(), 5.0)  # estimated to end at 2.0; still running at 5.0
    assert cpu_pass._running_on(s, "n1") == [(1.0, 1)]


def test_a_held_node_is_decided_again_when_its_expected_release_is_overdue():
    s = make(cores=16)
    led = Ledger(s)
    open_sb(s, "b")
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("big", "b", 15, 15, t_ori=150.0, serial=0.0)), 0.0))
    assert s.running["big"].est_end == 10.0
    open_sb(s, "r", now=1.0)
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05)), 1.0))
    assert "reward" not in led.started  # 9 s for 16 cores beats 160 s on one
    assert s.next_deadline() == 10.0  # nothing else will happen on the node: a Tick must come
    led.apply(s.handle(ev.Tick(), 10.0))  # "big" overran its estimate: decided again, still worth waiting
    assert "reward" not in led.started
    assert s.next_deadline() == 20.0
    led.apply(s.handle(ev.ActionFinished("big", ok=True), 12.0))
    assert s.running["reward"].units == 16
