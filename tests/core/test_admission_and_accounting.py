"""Admission answers, the counters, the duration history and reserved sandboxes, pinned to
exact values where the mutation run of docs/testing.md found only their kind checked."""

from __future__ import annotations

from dataclasses import replace

from sched_util import call_spec, exec_spec, lease_spec
from test_scheduler import make, open_sb

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import duration
from tangram.core.scheduler import Scheduler


def submit(s: Scheduler, spec, now: float = 0.0) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(spec), now)


def test_bad_requests_say_what_is_wrong():
    s = make(cores=2)
    open_sb(s, "sb")
    submit(s, exec_spec("dup", "sb", 1))
    assert submit(s, exec_spec("dup", "sb", 1)) == [
        cmd.Reject("dup", "BAD_REQUEST", "action id 'dup' is already in use")
    ]
    assert submit(s, exec_spec("a", "nope", 1)) == [
        cmd.Reject("a", "BAD_REQUEST", "unknown sandbox 'nope': open it first")
    ]
    assert submit(s, exec_spec("b", "sb", 3, 2)) == [
        cmd.Reject("b", "BAD_REQUEST", "cpu: min 3 is above max 2")
    ]
    assert submit(s, exec_spec("c", "sb", 0)) == [cmd.Reject("c", "BAD_REQUEST", "cpus must be >= 1")]
    assert submit(s, call_spec("g", "svc", (3,))) == [
        cmd.Reject("g", "BAD_REQUEST", "gpus must be one of (1, 2, 4, 8), got [3]")
    ]
    assert submit(s, lease_spec("l", "nope")) == [
        cmd.Reject("l", "BAD_REQUEST", "unknown API 'nope' (known: none)")
    ]


def test_an_action_of_a_sandbox_lost_with_its_node_is_answered_at_once():
    s = make(cores=2)
    open_sb(s, "sb")
    submit(s, exec_spec("a", "sb", 1))
    s.handle(ev.NodeLost("n1"), 1.0)
    assert submit(s, exec_spec("b", "sb", 1), 2.0) == [
        cmd.Reject("b", "SANDBOX_LOST", "sandbox sb was lost with its node")
    ]


def test_a_plain_sandbox_opens_without_a_reservation():
    s = make(cores=2)
    assert s.handle(ev.SandboxOpened("sb", client="c", mem_mib=500, image="img", task="t"), 0.0) == []
    assert not s.queues.get("cpu") and s.sandboxes["sb"].client == "c"
    out = submit(s, exec_spec("a", "sb", 1), 1.0)
    assert out[0] == cmd.CreateSandbox("n1", "sb", 500, "img")
    assert s.handle(ev.SandboxOpened("sb", client="d", mem_mib=9), 2.0) == []  # opened twice: the first stays
    assert s.sandboxes["sb"].client == "c"


def test_the_counters_count_every_answer():
    s = make(cores=1, gpus=1)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=1.0, t_ori=1.0), 0.0)
    open_sb(s, "sb")
    submit(s, exec_spec("a", "sb", 1))
    submit(s, exec_spec("too-big", "sb", 2))  # NO_CAPACITY
    submit(s, exec_spec("a", "sb", 1))  # BAD_REQUEST: not counted as rejected
    submit(s, call_spec("g", "rm"))
    s.handle(ev.ActionFinished("a", ok=True), 1.0)
    s.handle(ev.ActionFinished("g", ok=False), 2.0)
    submit(s, call_spec("h", "rm"), 3.0)  # resident: no load
    assert dict(s.counters) == {
        "submitted": 5,
        "rejected": 1,
        "started": 3,
        "loads": 1,
        "finished": 1,
        "failed": 1,
    }


def test_the_history_learns_single_unit_work_from_what_ran():
    s = make(cores=4, gpus=1)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=2.0, t_ori=None), 0.0)
    open_sb(s, "sb")
    # 4 cores, perfectly parallel, 2 s: 8 s of single-core work
    submit(s, exec_spec("a", "sb", 4, 4, t_ori=None, serial=0.0, action_type="test"), 0.0)
    s.handle(ev.ActionFinished("a"), 2.0)
    assert s.history.items() == [("test", 8.0)]
    # one core: no elasticity factor; a short run counts as short
    submit(s, exec_spec("b", "sb", 1, t_ori=None, action_type="tool"), 3.0)
    s.handle(ev.ActionFinished("b"), 3.25)
    # a call's restore time is not work: 2 s load + 3 s run
    submit(s, replace(call_spec("g", "rm"), action_type="judge"), 4.0)
    assert s.running["g"].load_s == 2.0
    s.handle(ev.ActionFinished("g"), 9.0)
    assert s.history.items() == [("judge", 3.0), ("test", 8.0), ("tool", 0.25)]
    # failed and killed runs teach nothing
    submit(s, exec_spec("c", "sb", 1, action_type="tool"), 10.0)
    s.handle(ev.ActionFinished("c", ok=False), 20.0)
    submit(s, exec_spec("d", "sb", 1, action_type="tool", timeout_s=1.0), 21.0)
    s.handle(ev.Tick(), 22.0)
    s.handle(ev.ActionFinished("d", ok=True), 30.0)
    assert s.history.items() == [("judge", 3.0), ("test", 8.0), ("tool", 0.25)]


def test_an_amdahl_run_teaches_its_single_core_work():
    s = make(cores=4)
    open_sb(s, "sb")
    submit(s, exec_spec("a", "sb", 4, 4, serial=0.5, action_type="t"), 0.0)
    s.handle(ev.ActionFinished("a"), 5.0)  # E(4) = 1 / (0.5 * 4 + 0.5) = 0.4: 5 s * 4 * 0.4
    ((_, t),) = s.history.items()
    assert abs(t - 8.0) < 1e-9


def test_an_exec_in_a_reserved_sandbox_runs_on_its_cores_at_the_dop_they_allow():
    s = make(cores=4)
    open_sb(s, "pod", reserve=3)
    (reserve,) = [c for c in s.running.values()]
    cores = s.sandboxes["pod"].cores
    assert len(cores) == 3 and reserve.spec.action_id == "open:pod"
    out = submit(s, exec_spec("wide", "pod", 1, 8, t_ori=6.0, serial=0.0, timeout_s=4.0), 1.0)
    assert out == [cmd.Spawn("wide", "n1", "pod", cores, 3, duration(6.0, None, 1) / 3)]
    r = s.running["wide"]
    assert (r.node, r.units, r.started, r.est_end, r.deadline) == ("n1", 0, 1.0, 3.0, 5.0)
    out = submit(s, exec_spec("narrow", "pod", 1, 2, t_ori=6.0, serial=0.0), 1.0)
    assert out == [cmd.Spawn("narrow", "n1", "pod", cores, 2, 3.0)]
    assert s.running["narrow"].deadline is None
    assert s.counters["started"] == 1  # the reservation; its execs take no units of their own
    assert s.next_deadline() == 5.0
    assert s.handle(ev.Tick(), 5.0) == [cmd.Kill("wide", "n1", "timeout")]


def test_a_one_core_reservation_runs_its_execs_one_at_a_time_on_it():
    s = make(cores=2)
    open_sb(s, "pod", reserve=1)
    cores = s.sandboxes["pod"].cores
    out = submit(s, exec_spec("x", "pod", 1, 4, t_ori=2.0, serial=0.0), 1.0)
    assert out == [cmd.Spawn("x", "n1", "pod", cores, 1, 2.0)]
    assert s.cpu.nodes["n1"].free == 1  # nothing beyond the reservation


def test_an_exec_waits_for_its_reservation_and_starts_with_it():
    s = make(cores=2)
    open_sb(s, "hog")
    submit(s, exec_spec("h", "hog", 2))
    open_sb(s, "pod", reserve=2, now=0.5)
    assert submit(s, exec_spec("x", "pod", 1, 2, t_ori=4.0, serial=0.0, timeout_s=10.0), 1.0) == []
    assert s.sandboxes["pod"].held[0].action_id == "x"
    out = s.handle(ev.ActionFinished("h"), 2.0)
    assert out == [
        cmd.Done("h", True, ""),
        cmd.CreateSandbox("n1", "pod", 1000),
        cmd.Reserve("open:pod", "n1", "pod", (0, 1)),
        cmd.Spawn("x", "n1", "pod", (0, 1), 2, 2.0),
    ]
    assert s.sandboxes["pod"].held == [] and s.running["x"].deadline == 12.0
