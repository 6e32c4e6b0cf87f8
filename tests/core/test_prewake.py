"""Scenario tests for GPU pre-wake (issue 14, item 2; ``tangram/core/prewake.py``): a service is
restored onto an idle chunk while the call that needs it still waits, never evicting (or holding
the GPUs of) an instance a queued call could run on, and the call then runs with no restore on
its path. Counts and order of commands only, never wall-clock timings.

The node has 3 GPUs: its chunks are [0, 2) and [2, 3), so a call on 2 GPUs fits only on GPUs
0-1, and GPU 2 can never serve it."""

from __future__ import annotations

from sched_util import call_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import CoreConfig, Scheduler

LOAD = 1.0


def make(gpus: int = 3, mem: int = 30_000, **cfg: object) -> Scheduler:
    """``mem`` per GPU of each service on 80 GB GPUs: 30 GB ones share a GPU, 50 GB ones do not."""
    s = Scheduler(CoreConfig(**cfg))  # type: ignore[arg-type]
    s.handle(node("n1", 1, gpus=gpus, gpu_mem=80_000), 0.0)
    s.handle(ev.ServiceDefined("a", mem, (1, 2), load_s=LOAD, t_ori=5.0), 0.0)
    s.handle(ev.ServiceDefined("b", mem, (1,), load_s=LOAD, t_ori=1.0), 0.0)
    s.handle(ev.ServiceDefined("c", mem, (1,), load_s=LOAD, t_ori=1.0), 0.0)
    return s


def submit(
    s: Scheduler, aid: str, service: str, now: float, sizes: tuple[int, ...] = (1,)
) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(call_spec(aid, service, sizes)), now)


def kinds(out: list[cmd.Command]) -> list[tuple[str, str, int]]:
    """(command, service or action, GPU start) of the GPU commands, in order."""
    got = []
    for c in out:
        if isinstance(c, cmd.Load):
            got.append(("Load", c.service, c.start))
        elif isinstance(c, cmd.Evict):
            got.append(("Evict", c.service, c.start))
        elif isinstance(c, cmd.Invoke):
            got.append(("Invoke", c.action_id, c.start))
    return got


def blocked_queue(s: Scheduler) -> list[cmd.Command]:
    """x runs a on GPUs 0-1 until 6.0; h (a on 2 GPUs) waits for them and blocks the queue
    (FCFS); w (b) waits behind h while GPU 2 idles. Returns what w's arrival produced."""
    assert kinds(submit(s, "x", "a", 0.0, (2,))) == [("Load", "a", 0), ("Invoke", "x", 0)]
    assert kinds(submit(s, "h", "a", 0.5, (2,))) == []
    return submit(s, "w", "b", 0.5)


def test_a_call_blocked_behind_the_head_has_its_service_restored_on_the_idle_gpu():
    s = make()
    out = blocked_queue(s)
    assert kinds(out) == [("Load", "b", 2)]  # restored ahead: no Invoke, w still waits
    assert s.counters["prewakes"] == 1 and "w" in s.pending
    assert s.next_deadline() == 0.5 + LOAD  # the warm's end
    assert s.snapshot().nodes[0]["gpus_busy"] == 3  # GPU 2 is held while it restores
    assert kinds(s.handle(ev.Tick(), 1.5)) == []  # restored; w is still behind h (FCFS)
    out = s.handle(ev.ActionFinished("x"), 6.0)
    assert kinds(out) == [("Invoke", "h", 0), ("Invoke", "w", 2)]  # w: resident, no Load on its path
    (w,) = [c for c in out if isinstance(c, cmd.Invoke) and c.action_id == "w"]
    assert w.est_s == 1.0  # its run alone


def test_without_prewake_the_restore_starts_only_when_the_call_runs():
    s = make(prewake=False)
    assert kinds(blocked_queue(s)) == []
    assert s.counters.get("prewakes", 0) == 0
    out = s.handle(ev.ActionFinished("x"), 6.0)
    assert kinds(out) == [("Invoke", "h", 0), ("Load", "b", 2), ("Invoke", "w", 2)]


def test_a_warm_never_evicts_what_a_queued_call_could_run_on():
    # GPU 2 holds c; c1 (wanting c) and w (wanting b) wait behind h. Warming b on GPU 2 would evict
    # c, which c1 wants: no warm (c1 itself cannot start either: FCFS).
    s = make(mem=50_000)
    assert kinds(submit(s, "y", "c", 0.0)) == [("Load", "c", 0), ("Invoke", "y", 0)]
    s.handle(ev.ActionFinished("y"), 2.0)  # c stays resident on GPU 0
    assert kinds(submit(s, "x", "a", 2.0, (2,))) == [("Evict", "c", 0), ("Load", "a", 0), ("Invoke", "x", 0)]
    assert kinds(submit(s, "z", "c", 2.0)) == [("Load", "c", 2), ("Invoke", "z", 2)]
    s.handle(ev.ActionFinished("z"), 4.0)  # c resident and free on GPU 2
    assert kinds(submit(s, "h", "a", 4.5, (2,))) == []
    assert kinds(submit(s, "c1", "c", 4.5)) == []
    assert kinds(submit(s, "w", "b", 4.5)) == []
    assert s.counters.get("prewakes", 0) == 0


def test_a_warm_never_holds_the_gpus_of_a_wanted_instance_even_without_evicting_it():
    # 30 GB services on 80 GB GPUs: b fits beside c on GPU 2 without an eviction, but holding GPU 2
    # for b's restore would make c1 (which could run on c there) wait: no warm.
    s = make()
    assert kinds(submit(s, "x", "a", 0.0, (2,))) == [("Load", "a", 0), ("Invoke", "x", 0)]
    assert kinds(submit(s, "z", "c", 0.0)) == [("Load", "c", 2), ("Invoke", "z", 2)]
    s.handle(ev.ActionFinished("z"), 2.0)  # c resident and free on GPU 2, with room for b beside it
    submit(s, "h", "a", 2.5, (2,))
    submit(s, "c1", "c", 2.5)
    assert kinds(submit(s, "w", "b", 2.5)) == []
    assert s.counters.get("prewakes", 0) == 0


def test_a_failed_restore_ahead_frees_the_gpu_and_the_call_restores_on_its_own():
    s = make()
    assert kinds(blocked_queue(s)) == [("Load", "b", 2)]
    assert kinds(s.handle(ev.ServiceEvicted("n1", "b", 2), 1.0)) == []  # the load failed: not again
    assert s.next_deadline() != 1.5
    assert s.snapshot().nodes[0]["resident"] == ["a@0+2"] and s.snapshot().nodes[0]["gpus_busy"] == 2
    out = s.handle(ev.ActionFinished("x"), 6.0)
    assert ("Load", "b", 2) in kinds(out) and ("Invoke", "w", 2) in kinds(out)


def test_losing_the_node_during_a_warm_drops_it():
    s = make()
    assert kinds(blocked_queue(s)) == [("Load", "b", 2)]
    s.handle(ev.NodeLost("n1"), 1.0)
    s.handle(ev.Tick(), 1.5)  # the warm's deadline: nothing to give back
    assert s.gpu.nodes == {} and len(s._ctx.warming) == 0


def test_a_call_waits_for_a_copy_being_restored_rather_than_restore_another():
    # w1 and w2 (b) wait behind h; GPU 2 warms b for w1. When h is cancelled, GPUs 0-1 are busy
    # (x) and GPU 2 is restoring: w1 waits for the warm (ready at 1.5), w2 for w1's turn after it.
    s = make()
    assert kinds(blocked_queue(s)) == [("Load", "b", 2)]
    assert kinds(submit(s, "w2", "b", 0.6)) == []
    assert s.counters["prewakes"] == 1  # one copy serves both before another restore would
    out = s.handle(ev.ActionCancelled("h"), 1.0)
    assert kinds(out) == []
    assert kinds(s.handle(ev.Tick(), 1.5)) == [("Invoke", "w", 2)]
    assert kinds(s.handle(ev.ActionFinished("w"), 2.5)) == [("Invoke", "w2", 2)]


def test_an_elastic_call_takes_a_free_resident_copy_at_any_of_its_sizes():
    # a is resident on GPUs 0-1 (size 2) and free. An elastic call accepting 1 or 2 GPUs runs
    # there at size 2 with no restore; one of unknown elasticity gets its minimum, as ever.
    s = make()
    submit(s, "x", "a", 0.0, (2,))
    s.handle(ev.ActionFinished("x"), 7.0)
    out = s.handle(ev.ActionSubmitted(call_spec("e", "a", (1, 2), serial=0.2)), 8.0)
    assert kinds(out) == [("Invoke", "e", 0)]
    assert [c.end - c.start for c in out if isinstance(c, cmd.Invoke)] == [2]
    s.handle(ev.ActionFinished("e"), 12.0)
    out = submit(s, "u", "a", 13.0, (1, 2))
    assert [c.end - c.start for c in out if isinstance(c, cmd.Invoke)] == [1]


def shared_gpu(q_run_s: float, **cfg: object) -> Scheduler:
    """Two GPUs; p and q (30 GB each) fit on one GPU together. p ran on GPU 0 and stays
    resident there, idle, while y (q) runs on GPU 0 from 2.0 (restore 1 s, run ``q_run_s``)."""
    s = Scheduler(CoreConfig(**cfg))  # type: ignore[arg-type]
    s.handle(node("n1", 1, gpus=2, gpu_mem=80_000), 0.0)
    s.handle(ev.ServiceDefined("p", 30_000, (1,), load_s=LOAD, t_ori=1.0), 0.0)
    s.handle(ev.ServiceDefined("q", 30_000, (1,), load_s=LOAD, t_ori=q_run_s), 0.0)
    assert kinds(submit(s, "x", "p", 0.0)) == [("Load", "p", 0), ("Invoke", "x", 0)]
    s.handle(ev.ActionFinished("x"), 2.0)
    assert kinds(submit(s, "y", "q", 2.0)) == [("Load", "q", 0), ("Invoke", "y", 0)]  # beside p
    return s


def test_a_call_waits_for_its_idle_copy_on_gpus_another_service_runs_on():
    """z (p) comes at 3.5: GPU 1 is free but holds no p; GPU 0 holds p, idle, and frees at 4.0
    (y ends), sooner than a 1 s restore: z waits for it, nothing is restored (not even ahead),
    and it runs there with no restore on its path."""
    s = shared_gpu(q_run_s=1.0)
    assert kinds(submit(s, "z", "p", 3.5)) == []
    assert "z" in s.pending and s.counters.get("prewakes", 0) == 0
    out = s.handle(ev.ActionFinished("y"), 4.0)
    assert kinds(out) == [("Invoke", "z", 0)]
    assert s.counters["loads"] == 2  # p and q once each, never p again


def test_a_shared_copy_that_frees_later_than_a_restore_is_not_waited_for():
    """The same, but y runs 5 s (GPU 0 frees at 8.0, later than a restore started at 3.5 ends):
    z is restored onto the free GPU 1 and runs at once."""
    s = shared_gpu(q_run_s=5.0)
    assert kinds(submit(s, "z", "p", 3.5)) == [("Load", "p", 1), ("Invoke", "z", 1)]


def test_without_prewake_a_shared_copy_is_not_counted():
    s = shared_gpu(q_run_s=1.0, prewake=False)
    assert kinds(submit(s, "z", "p", 3.5)) == [("Load", "p", 1), ("Invoke", "z", 1)]
