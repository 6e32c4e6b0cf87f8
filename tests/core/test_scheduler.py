"""Scenario tests for the scheduler: events in, commands out, statuses with reasons."""
from __future__ import annotations

from sched_util import Ledger, call_spec, exec_spec, lease_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.status import Code


def started(out, kind=cmd.Spawn):
    return [c for c in out if isinstance(c, kind)]


def make(cores=8, gpus=0, numa=1, gpu_mem=80_000, **cfg):
    s = Scheduler(CoreConfig(**cfg))
    s.handle(node("n1", cores, gpus=gpus, numa=numa, gpu_mem=gpu_mem), 0.0)
    return s


def open_sb(s, name, mem=1000, reserve=0, now=0.0):
    return s.handle(ev.SandboxOpened(name, client="c", mem_mib=mem, reserve=reserve), now)


def test_elastic_action_alone_gets_its_useful_maximum_on_one_numa_node():
    s = make(cores=16, numa=2)
    open_sb(s, "sb")
    out = s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 1, 8, t_ori=8.0, serial=0.05)), 0.0)
    assert isinstance(out[0], cmd.CreateSandbox) and out[0].node == "n1"
    (spawn,) = started(out)
    assert spawn.dop == 8 and spawn.cores == tuple(range(8))  # one NUMA domain of 8


def test_non_elastic_and_unknown_duration_get_their_minimum():
    s = make(cores=8)
    open_sb(s, "sb")
    out = s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 2, 8, t_ori=None, serial=0.0)), 0.0)
    assert started(out)[0].dop == 2  # no profile and no history: minimum


def test_fcfs_within_a_node_and_cores_return_on_finish():
    s = make(cores=2)
    led = Ledger(s)
    for sb in ("s1", "s2", "s3"):
        open_sb(s, sb)
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("a", "s1", 2)), 0.0))
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("b", "s2", 2)), 0.1))
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("c", "s3", 1)), 0.2))
    assert led.started == {"a"}
    st = s.status_of("b")
    assert st is not None and st.code is Code.UNSCHEDULABLE
    # "c" would fit in no core either; it waits behind "b" (FCFS), never jumps ahead
    out = s.handle(ev.ActionFinished("a"), 1.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["b"]
    out = s.handle(ev.ActionFinished("b"), 2.0)
    led.apply(out)
    assert [c.action_id for c in started(out)] == ["c"]


def test_unplaceable_demand_is_rejected_at_once_with_a_shortfall():
    s = make(cores=4)
    open_sb(s, "sb")
    out = s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 5)), 0.0)
    (rej,) = out
    assert isinstance(rej, cmd.Reject) and rej.code == "NO_CAPACITY"
    assert rej.reasons[0].resource == "cpu" and rej.reasons[0].requested == 5 and rej.reasons[0].capacity == 4


def test_trajectory_memory_picks_the_node_and_stays_reserved():
    s = Scheduler()
    s.handle(node("big", 4, mem=10_000), 0)
    s.handle(node("small", 4, mem=2_000), 0)
    open_sb(s, "sb", mem=5_000)
    out = s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 1)), 0)
    assert started(out)[0].node == "big"
    s.handle(ev.ActionFinished("a"), 1)
    assert s.cpu.nodes["big"].mem_reserved == 5_000  # kept for the whole trajectory
    out = s.handle(ev.ActionSubmitted(exec_spec("b", "sb", 1)), 2)
    assert started(out)[0].node == "big"  # later actions stay on the trajectory's node
    out = s.handle(ev.SandboxClosed("sb"), 3)
    assert cmd.DestroySandbox("big", "sb") in out or any(isinstance(c, cmd.Kill) for c in out)
    assert s.cpu.nodes["big"].mem_reserved == 0


def test_api_quota_waits_do_not_block_cpu_actions():
    s = make(cores=2)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0)
    led = Ledger(s)
    led.apply(s.handle(ev.ActionSubmitted(lease_spec("l1", "search")), 0))
    led.apply(s.handle(ev.ActionSubmitted(lease_spec("l2", "search")), 0))
    assert "l2" not in led.started
    open_sb(s, "sb")
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 1)), 0.1))
    assert "a" in led.started  # the CPU pool is not stuck behind the API queue
    led.apply(s.handle(ev.ActionFinished("l1"), 1.0))
    assert "l2" in led.started


def test_quota_per_period_opens_at_the_next_window():
    s = make(cores=1)
    s.handle(ev.ApiDefined("pdf", "quota", 2, period_s=10.0), 0)
    led = Ledger(s)
    for i in range(3):
        led.apply(s.handle(ev.ActionSubmitted(lease_spec(f"l{i}", "pdf")), 1.0))
    assert led.started == {"l0", "l1"}
    led.apply(s.handle(ev.ActionFinished("l0"), 2.0))
    assert "l2" not in led.started  # quota, not concurrency: a release does not refill it
    assert s.next_deadline() == 11.0
    led.apply(s.handle(ev.Tick(), 11.0))
    assert "l2" in led.started


def test_lease_not_released_is_reclaimed_at_its_deadline():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0)
    led = Ledger(s)
    led.apply(s.handle(ev.ActionSubmitted(lease_spec("l1", "search", timeout_s=5.0)), 0))
    led.apply(s.handle(ev.ActionSubmitted(lease_spec("l2", "search")), 0))
    assert s.next_deadline() == 5.0
    out = s.handle(ev.Tick(), 5.0)
    led.apply(out)
    assert led.rejected.get("l1") == "TIMEOUT" and "l2" in led.started


def test_queued_action_times_out_and_running_one_is_killed():
    s = make(cores=1)
    open_sb(s, "s1")
    open_sb(s, "s2")
    s.handle(ev.ActionSubmitted(exec_spec("a", "s1", 1, timeout_s=10)), 0)
    s.handle(ev.ActionSubmitted(exec_spec("b", "s2", 1, timeout_s=3)), 0)
    out = s.handle(ev.Tick(), 3.0)
    assert cmd.Reject("b", "TIMEOUT", "timed out while queued") in out
    out = s.handle(ev.Tick(), 10.0)
    assert any(isinstance(c, cmd.Kill) and c.action_id == "a" for c in out)
    out = s.handle(ev.ActionFinished("a", ok=False, reason="timeout"), 10.1)
    assert cmd.Done("a", False, "timeout") in out
    assert s.cpu.nodes["n1"].free == 1


def test_gpu_restore_then_resident_then_lru_eviction():
    s = make(cores=1, gpus=1, gpu_mem=50_000)
    s.handle(ev.ServiceDefined("rm-a", 30_000, (1,), load_s=2.0, t_ori=1.0), 0)
    s.handle(ev.ServiceDefined("rm-b", 30_000, (1,), load_s=2.0, t_ori=1.0), 0)
    out = s.handle(ev.ActionSubmitted(call_spec("g1", "rm-a")), 0)
    assert [type(c) for c in out] == [cmd.Load, cmd.Invoke]
    s.handle(ev.ActionFinished("g1"), 3)
    out = s.handle(ev.ActionSubmitted(call_spec("g2", "rm-a")), 4)
    assert [type(c) for c in out] == [cmd.Invoke]  # resident: runs without restore
    s.handle(ev.ActionFinished("g2"), 5)
    out = s.handle(ev.ActionSubmitted(call_spec("g3", "rm-b")), 6)
    assert [type(c) for c in out] == [cmd.Evict, cmd.Load, cmd.Invoke]
    assert out[0].service == "rm-a"


def test_gpu_prefers_a_chunk_that_caches_the_service():
    s = make(cores=1, gpus=4)
    s.handle(ev.ServiceDefined("a", 10_000, (1,), load_s=1.0, t_ori=1.0), 0)
    s.handle(ev.ServiceDefined("b", 10_000, (1,), load_s=1.0, t_ori=1.0), 0)
    s.handle(ev.ActionSubmitted(call_spec("x", "a")), 0)  # a on GPU 0
    s.handle(ev.ActionSubmitted(call_spec("y", "b")), 0)  # b on GPU 1
    s.handle(ev.ActionFinished("x"), 1)
    s.handle(ev.ActionFinished("y"), 1)
    out = s.handle(ev.ActionSubmitted(call_spec("z", "b")), 2)
    (inv,) = out
    assert isinstance(inv, cmd.Invoke) and inv.start == 1


def test_elastic_gpu_calls_use_the_chunk_dp():
    s = make(cores=1, gpus=8)
    s.handle(ev.ServiceDefined("t", 10_000, (1, 2, 4, 8), load_s=0.0, t_ori=8.0), 0)
    out = s.handle(ev.ActionSubmitted(call_spec("x", "t", (1, 2, 4, 8), serial=0.0)), 0)
    (inv,) = started(out, cmd.Invoke)
    assert inv.end - inv.start == 8  # alone and perfectly parallel: the whole node


def test_reserved_sandbox_holds_cores_for_its_whole_life():
    s = make(cores=4)
    led = Ledger(s)
    led.apply(open_sb(s, "pod", reserve=2))
    assert s.cpu.nodes["n1"].free == 2
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("a", "pod", 1, 4)), 1))
    spawn = [c for c in s.running.values() if c.spec.action_id == "a"]
    assert spawn and s.cpu.nodes["n1"].free == 2  # runs on the reservation, takes nothing more
    led.apply(s.handle(ev.ActionFinished("a"), 2))
    assert s.cpu.nodes["n1"].free == 2  # still held between actions
    led.apply(s.handle(ev.SandboxClosed("pod"), 3))
    assert s.cpu.nodes["n1"].free == 4


def test_node_lost_fails_sandboxed_work_and_rejects_later_actions():
    s = Scheduler()
    s.handle(node("n1", 2), 0)
    s.handle(node("n2", 2), 0)
    open_sb(s, "sb")
    out = s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 2)), 0)
    n = started(out)[0].node
    out = s.handle(ev.NodeLost(n), 1)
    assert any(isinstance(c, cmd.Reject) and c.code == "SANDBOX_LOST" for c in out)
    out = s.handle(ev.ActionSubmitted(exec_spec("b", "sb", 1)), 2)
    assert out[0].code == "SANDBOX_LOST"


def test_cancel_queued_and_running():
    s = make(cores=1)
    open_sb(s, "s1")
    open_sb(s, "s2")
    s.handle(ev.ActionSubmitted(exec_spec("a", "s1", 1)), 0)
    s.handle(ev.ActionSubmitted(exec_spec("b", "s2", 1)), 0)
    assert s.handle(ev.ActionCancelled("b"), 1) == [cmd.Reject("b", "CANCELLED", "cancelled")]
    out = s.handle(ev.ActionCancelled("a"), 1)
    assert isinstance(out[0], cmd.Kill)


def test_bad_requests_are_typed():
    s = make(cores=2)
    open_sb(s, "sb")
    assert s.handle(ev.ActionSubmitted(exec_spec("a", "nope", 1)), 0)[0].code == "BAD_REQUEST"
    assert s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 3, 2)), 0)[0].code == "BAD_REQUEST"
    assert s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 0)), 0)[0].code == "BAD_REQUEST"
    assert s.handle(ev.ActionSubmitted(call_spec("g", "svc", (3,))), 0)[0].code == "BAD_REQUEST"
    assert s.handle(ev.ActionSubmitted(lease_spec("l", "nope")), 0)[0].code == "BAD_REQUEST"


def test_greedy_eviction_holds_back_a_candidate_when_that_lowers_summed_act():
    # 4 cores, two elastic actions: starting both at 2 cores is better than 4+wait or 1+3?
    # The objective decides; whatever it picks, every core goes to somebody and the
    # held-back action, if any, stays at the head of the queue.
    s = make(cores=4)
    led = Ledger(s)
    open_sb(s, "s1")
    open_sb(s, "s2")
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("a", "s1", 1, 4, t_ori=4.0, serial=0.0)), 0))
    assert s.running["a"].units == 4  # alone: all four
    led.apply(s.handle(ev.ActionSubmitted(exec_spec("b", "s2", 1, 4, t_ori=4.0, serial=0.0)), 0.1))
    assert "b" not in led.started  # nothing free: it waits
    led.apply(s.handle(ev.ActionFinished("a"), 1.0))
    assert s.running["b"].units == 4


def test_policies_plug_in():
    for policy, want in (("min", 1), ("max", 8), ("fixed", 4)):
        s = make(cores=8, policy=policy, fixed_dop=4)
        open_sb(s, "sb")
        out = s.handle(ev.ActionSubmitted(exec_spec("a", "sb", 1, 8, t_ori=8.0, serial=0.0)), 0)
        assert started(out)[0].dop == want, policy


def test_elastic_gpu_call_on_a_six_gpu_node_uses_the_tail_chunk():
    s = make(cores=1, gpus=6)
    s.handle(ev.ServiceDefined("t", 10_000, (1, 2, 4), load_s=0.0, t_ori=8.0), 0)
    first = started(s.handle(ev.ActionSubmitted(call_spec("x", "t", (4,))), 0), cmd.Invoke)[0]
    assert (first.start, first.end) == (0, 4)
    out = s.handle(ev.ActionSubmitted(call_spec("y", "t", (1, 2), serial=0.0)), 0)
    (inv,) = started(out, cmd.Invoke)
    assert (inv.start, inv.end) == (4, 6)  # the free 2-chunk past the first root chunk


def test_gpu_call_waits_for_a_busy_resident_copy_when_that_beats_a_restore():
    for load_s, expect_wait in ((5.0, True), (0.1, False)):
        s = make(cores=1, gpus=2)
        s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=load_s, t_ori=1.0), 0)
        s.handle(ev.ActionSubmitted(call_spec("a", "rm")), 0)  # restored on GPU 0, runs ~1 s
        s.handle(ev.ActionFinished("a"), load_s + 1.0)
        s.handle(ev.ActionSubmitted(call_spec("b", "rm")), 10.0)  # resident: no restore
        out = s.handle(ev.ActionSubmitted(call_spec("c", "rm")), 10.0)
        if expect_wait:  # GPU 0 frees in ~1 s, a restore on GPU 1 would take 5 s
            assert out == [] and "busy GPU that holds rm" in str(s.status_of("c"))
            out = s.handle(ev.ActionFinished("b"), 11.0)
            assert [type(c) for c in out] == [cmd.Done, cmd.Invoke] and out[1].start == 0
        else:  # a restore is quicker than waiting: it goes to the free GPU
            assert [type(c) for c in out] == [cmd.Load, cmd.Invoke] and out[1].start == 1


def test_an_adopted_sandbox_runs_on_its_node_without_being_created() -> None:
    """A restarted controller re-binds a sandbox its agent still holds (SandboxAdopted)."""
    s = Scheduler()
    s.handle(node("a", 4, mem=1000), 0.0)
    s.handle(node("b", 4, mem=1000), 0.0)
    s.handle(ev.SandboxOpened("sb", client="c", mem_mib=600), 0.0)
    s.handle(ev.SandboxAdopted("sb", "b"), 0.0)
    s.handle(ev.SandboxAdopted("sb", "a"), 0.0)  # a second word does not move it
    s.handle(ev.SandboxAdopted("nope", "a"), 0.0)  # unknown sandbox: nothing
    out = s.handle(ev.ActionSubmitted(exec_spec("x1", "sb", 1)), 1.0)
    assert not [c for c in out if isinstance(c, cmd.CreateSandbox)]
    (spawn,) = [c for c in out if isinstance(c, cmd.Spawn)]
    assert spawn.node == "b" and s.cpu.nodes["b"].mem_reserved == 600 and s.cpu.nodes["a"].mem_reserved == 0
    out = s.handle(ev.SandboxClosed("sb"), 2.0)
    assert s.cpu.nodes["b"].mem_reserved == 0
