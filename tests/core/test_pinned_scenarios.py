"""Behaviours that a mutation of the core once broke without any test noticing (issue 13).

Each test here fails on a named single-point mutation of ``tangram/core`` (docs/testing.md
lists them and how they were checked):

1. FCFS within a node: when a blocked head needs more cores than are free, no later
   action (another sandbox's, or a new trajectory's first) starts in the free ones
   (docs/scheduler.md, pipeline step 3: "that node is then blocked, so nobody overtakes
   that action on that node"; the paper's Algorithm 1 takes the longest FCFS prefix whose
   minimums fit, with no backfilling).
2. LRU among several evictable resident services on a GPU: the least recently used one is
   evicted and the others stay resident (the GPU manager: docs/gpu.md).
3. A GPU call whose duration is unknown (no T_ori, no history) or that has no elasticity
   gets its smallest chunk, as a CPU action gets its minimum (pipeline step 4).
"""

from __future__ import annotations

from sched_util import Ledger, call_spec, exec_spec, node
from test_hold_for_units import _fill_with_tools, _teach_tool_history
from test_scheduler import make, open_sb, started

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.resources import GPU, Demand
from tangram.core.scheduler import Scheduler
from tangram.core.status import Code


def _submit(s: Scheduler, led: Ledger, spec: ActionSpec, now: float) -> list[cmd.Command]:
    out = s.handle(ev.ActionSubmitted(spec), now)
    led.apply(out)
    return out


def _blocked_node(s: Scheduler, led: Ledger) -> None:
    """n1 (4 cores): "a" holds 3, "head" (2 cores) waits with one core free. The sandboxes
    of "head" and of "old" are bound to n1 (each ran an action there before)."""
    for sb in ("s1", "s2", "old"):
        open_sb(s, sb)
    _submit(s, led, exec_spec("a", "s1", 3), 0.0)
    for i, sb in enumerate(("s2", "old")):
        _submit(s, led, exec_spec(f"{sb}-0", sb, 1), 0.1 * i)
        led.apply(s.handle(ev.ActionFinished(f"{sb}-0"), 0.1 * i + 0.05))
    assert s.cpu.sandbox_node == {"s1": "n1", "s2": "n1", "old": "n1"}
    assert s.cpu.nodes["n1"].free == 1
    _submit(s, led, exec_spec("head", "s2", 2), 1.0)
    st = s.status_of("head")
    assert "head" not in led.started and st is not None and st.code is Code.UNSCHEDULABLE
    (short,) = st.reasons
    assert (short.resource, short.requested, short.free, short.where) == ("cpu", 2, 1, "n1")


# -- 1. FCFS within a node --------------------------------------------------------------------
def test_a_later_action_of_a_bound_sandbox_does_not_take_the_cores_a_blocked_head_waits_for():
    s = make(cores=4)
    led = Ledger(s)
    _blocked_node(s, led)
    _submit(s, led, exec_spec("o2", "old", 1), 2.0)  # one core would do, and one is free
    assert "o2" not in led.started
    assert s.cpu.nodes["n1"].free == 1
    out = s.handle(ev.ActionFinished("a"), 3.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["head", "o2"]  # in FCFS order, once the head fits


def test_a_new_trajectory_is_not_placed_in_the_cores_a_blocked_head_waits_for():
    s = make(cores=4)
    led = Ledger(s)
    _blocked_node(s, led)
    open_sb(s, "new", now=2.0)
    out = _submit(s, led, exec_spec("n", "new", 1), 2.0)
    assert "n" not in led.started and not [c for c in out if isinstance(c, cmd.CreateSandbox)]
    assert s.sandboxes["new"].node is None  # not bound either: it may still go to another node
    out = s.handle(ev.ActionFinished("a"), 3.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["head", "n"]


def test_a_new_trajectory_goes_to_another_node_rather_than_overtake_a_blocked_head():
    s = make(cores=4)
    s.handle(node("n2", 2, mem=8_000), 0.0)  # less free memory than n1: placement would prefer n1
    led = Ledger(s)
    _blocked_node(s, led)
    open_sb(s, "new", now=2.0)
    out = _submit(s, led, exec_spec("n", "new", 1), 2.0)
    assert [(c.action_id, c.node) for c in started(out)] == [("n", "n2")]
    assert "head" not in led.started


def test_a_trajectory_placed_in_this_pass_does_not_overtake_the_head_it_blocked():
    # "t1" and "t2" of one new trajectory wait with "head" (bound to the node) between them.
    # When 4 cores free up, "t1" is placed there and leaves 3: "head" (4) blocks the node,
    # and "t2", which follows its sandbox onto that node in the same pass, waits behind it.
    s = make(cores=8)
    led = Ledger(s)
    for sb in ("s1", "s2", "s3", "new"):
        open_sb(s, sb)
    _submit(s, led, exec_spec("warm", "s2", 1), 0.0)  # binds s2 to the node
    led.apply(s.handle(ev.ActionFinished("warm"), 0.1))
    _submit(s, led, exec_spec("a", "s1", 4), 0.2)
    _submit(s, led, exec_spec("b", "s3", 4), 0.2)
    _submit(s, led, exec_spec("t1", "new", 1), 0.3)
    _submit(s, led, exec_spec("head", "s2", 4), 0.4)
    _submit(s, led, exec_spec("t2", "new", 1), 0.5)
    assert led.started == {"warm", "a", "b"}
    out = s.handle(ev.ActionFinished("b"), 1.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["t1"]
    assert s.cpu.nodes["n1"].free == 3 and "t2" not in led.started
    out = s.handle(ev.ActionFinished("a"), 2.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["head", "t2"]


def test_a_head_held_for_more_cores_keeps_a_later_action_out_of_the_free_ones():
    # the head's minimum fits but it waits for more cores (cpu_pass._allocate, hold_all): the
    # whole prefix waits with it; a later one-core action does not start on the free cores
    s = make(cores=16)
    led = Ledger(s)
    _teach_tool_history(s, led)
    tools = _fill_with_tools(s, led, 14, now=1.0)
    open_sb(s, "r", now=1.0)
    _submit(s, led, exec_spec("reward", "r", 1, 16, t_ori=160.0, serial=0.05), 1.1)
    assert "reward" not in led.started and s.cpu.nodes["n1"].free == 2
    open_sb(s, "late", now=1.2)
    _submit(s, led, exec_spec("late", "late", 1, action_type="tool"), 1.2)
    assert "late" not in led.started and "behind reward" in str(s.status_of("late"))
    for i, aid in enumerate(tools):
        led.apply(s.handle(ev.ActionFinished(aid, ok=True), 2.0 + 0.01 * i))
        if "reward" in led.started:
            break
    assert "late" not in led.started or s.running["late"].started >= s.running["reward"].started


def test_an_earlier_action_is_not_blocked_by_a_later_one_that_does_not_fit():
    # the converse: FCFS is by submission, so a small action queued before the big one runs
    s = make(cores=4)
    led = Ledger(s)
    for sb in ("s1", "s2", "s3"):
        open_sb(s, sb)
    _submit(s, led, exec_spec("a", "s1", 4), 0.0)
    _submit(s, led, exec_spec("small", "s2", 1), 0.1)
    _submit(s, led, exec_spec("big", "s3", 4), 0.2)
    out = s.handle(ev.ActionFinished("a"), 1.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["small"]  # big does not fit in the other 3


# -- 2. LRU among resident services -----------------------------------------------------------
def _lru_gpu() -> tuple[Scheduler, Ledger]:
    """One GPU of 100 GB holding three 30 GB services, used in the order a, b, c, a: b is
    the least recently used."""
    s = make(cores=1, gpus=1, gpu_mem=100_000)
    for name in ("a", "b", "c", "d"):
        s.handle(ev.ServiceDefined(name, 30_000, (1,), load_s=1.0, t_ori=1.0), 0.0)
    led = Ledger(s)
    t = 0.0
    for i, svc in enumerate(("a", "b", "c", "a")):
        out = _submit(s, led, call_spec(f"g{i}", svc), t)
        assert [type(c) for c in out] == ([cmd.Invoke] if i == 3 else [cmd.Load, cmd.Invoke])
        led.apply(s.handle(ev.ActionFinished(f"g{i}"), t + 2.0))
        t += 3.0
    assert set(_resident(s)) == {"a", "b", "c"}
    return s, led


def _resident(s: Scheduler) -> list[str]:
    return sorted(inst[0] for inst in s.gpu.nodes["n1"].resident)


def test_the_least_recently_used_service_is_the_one_evicted():
    s, led = _lru_gpu()
    out = _submit(s, led, call_spec("x", "d"), 20.0)
    assert [type(c) for c in out] == [cmd.Evict, cmd.Load, cmd.Invoke]
    assert out[0].service == "b"  # used at 3-5 s; c at 6-8 s, a again at 9-11 s
    assert _resident(s) == ["a", "c", "d"]
    led.apply(s.handle(ev.ActionFinished("x"), 22.0))
    for aid, svc in (("y", "a"), ("z", "c")):  # the others stayed: no restore
        out = _submit(s, led, call_spec(aid, svc), 23.0)
        assert [type(c) for c in out] == [cmd.Invoke], svc
        led.apply(s.handle(ev.ActionFinished(aid), 24.0))


def test_lru_follows_the_last_use_not_the_first_restore():
    s, led = _lru_gpu()
    _submit(s, led, call_spec("u", "b"), 20.0)  # b is now the most recent, c the oldest
    led.apply(s.handle(ev.ActionFinished("u"), 21.0))
    out = _submit(s, led, call_spec("x", "d"), 22.0)
    assert [(type(c), getattr(c, "service", None)) for c in out[:1]] == [(cmd.Evict, "c")]
    assert _resident(s) == ["a", "b", "d"]


def test_eviction_takes_only_as_many_lru_services_as_the_restore_needs():
    s, led = _lru_gpu()
    s.handle(ev.ServiceDefined("big", 60_000, (1,), load_s=1.0, t_ori=1.0), 20.0)
    out = _submit(s, led, call_spec("x", "big"), 20.0)
    assert [(type(c), getattr(c, "service", None)) for c in out] == [
        (cmd.Evict, "b"),
        (cmd.Evict, "c"),
        (cmd.Load, "big"),
        (cmd.Invoke, "big"),
    ]
    assert _resident(s) == ["a", "big"]


# -- 3. GPU calls without a duration model get their smallest chunk ---------------------------
def _gpu8(t_ori: float | None) -> Scheduler:
    s = make(cores=1, gpus=8)
    s.handle(ev.ServiceDefined("t", 10_000, (1, 2, 4, 8), load_s=0.0, t_ori=t_ori), 0.0)
    return s


def _call(aid: str, serial: float | None, action_type: str = "", sizes=(1, 2, 4, 8)) -> ActionSpec:
    el = Elasticity.amdahl(serial) if serial is not None else None
    return ActionSpec(
        aid,
        Kind.CALL,
        ((GPU, Demand.of(list(sizes))),),
        key=GPU,
        service="t",
        elasticity=el,
        action_type=action_type,
        client="c",
    )


def _chunk(out: list[cmd.Command]) -> int:
    (inv,) = started(out, cmd.Invoke)
    return inv.end - inv.start


def test_a_gpu_call_of_unknown_duration_gets_its_smallest_chunk():
    s = _gpu8(t_ori=None)
    assert _chunk(s.handle(ev.ActionSubmitted(_call("x", serial=0.0)), 0.0)) == 1
    assert _chunk(s.handle(ev.ActionSubmitted(_call("y", serial=0.0, sizes=(2, 4, 8))), 0.0)) == 2


def test_a_gpu_call_without_elasticity_gets_its_smallest_chunk():
    s = _gpu8(t_ori=8.0)
    assert _chunk(s.handle(ev.ActionSubmitted(_call("x", serial=None)), 0.0)) == 1


def test_a_gpu_call_gets_more_once_its_type_has_a_history():
    # the control for the two above: the same call with a known T_ori does get the node
    s = _gpu8(t_ori=None)
    assert _chunk(s.handle(ev.ActionSubmitted(_call("x", serial=0.0, action_type="judge")), 0.0)) == 1
    s.handle(ev.ActionFinished("x"), 4.0)
    assert s.history.known("judge")
    assert _chunk(s.handle(ev.ActionSubmitted(_call("y", serial=0.0, action_type="judge")), 5.0)) == 8
