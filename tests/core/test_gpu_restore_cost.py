"""Scenario tests for the GPU pass's restore-or-wait choice (``gpu_pass._wait_for_resident``) and
the restore's choice of chunk (``GpuManager.choose(wanted=...)``): a restore is weighed against
what it costs the calls behind, not only against the waiting call's own wait.

Every service here takes 50 of a GPU's 80 GB, so a GPU holds one service at a time and a restore
evicts whatever the GPU held."""
from __future__ import annotations

from dataclasses import replace

from sched_util import call_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import CoreConfig, Scheduler

MEM = 50_000


def make(gpus: int, services: dict[str, float], sizes: tuple[int, ...] = (1,), **cfg) -> Scheduler:
    """One node of ``gpus`` GPUs; ``services``: name -> T_ori, each restored in 1 s."""
    s = Scheduler(CoreConfig(**cfg))
    s.handle(node("n1", 1, gpus=gpus, gpu_mem=80_000), 0.0)
    for name, t_ori in services.items():
        s.handle(ev.ServiceDefined(name, MEM, sizes, load_s=1.0, t_ori=t_ori), 0.0)
    return s


def submit(s: Scheduler, aid: str, service: str, now: float,
           sizes: tuple[int, ...] = (1,)) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(call_spec(aid, service, sizes)), now)


def invoked(out: list[cmd.Command]) -> dict[str, int]:
    return {c.action_id: c.start for c in out if isinstance(c, cmd.Invoke)}


def loaded(out: list[cmd.Command]) -> list[tuple[str, int]]:
    return [(c.service, c.start) for c in out if isinstance(c, cmd.Load)]


def test_restore_does_not_evict_the_service_the_next_call_wants_when_another_chunk_is_free():
    # GPU 0 holds b, GPU 1 holds a, both free when the pass sees [c1, b1]: c1's restore goes to
    # GPU 1 (a, wanted by nobody), so b1 runs on its resident copy: one restore, not two.
    # (Without pre-wake: with it, c's restore starts at 2.0, while H still blocks the queue; see
    # test_prewake.py.)
    for policy, want in (("tangram", {"c1": 1, "b1": 0}), ("min", {"c1": 0, "b1": 1})):
        s = make(4, {"a": 1.0, "b": 1.0, "c": 1.0, "e": 10.0}, sizes=(1, 2, 4), policy=policy, prewake=False)
        submit(s, "x", "b", 0.0)  # b restored on GPU 0
        submit(s, "y", "a", 0.0)  # a restored on GPU 1
        assert invoked(submit(s, "z", "e", 0.0, (2,))) == {"z": 2}  # GPUs 2-3 busy for 11 s
        for aid, svc, sizes in (("H", "e", (4,)), ("c1", "c", (1,)), ("b1", "b", (1,))):
            assert invoked(submit(s, aid, svc, 0.1, sizes)) == {}  # H needs all 4 GPUs: FCFS blocks
        s.handle(ev.ActionFinished("x"), 2.0)
        s.handle(ev.ActionFinished("y"), 2.0)
        out = s.handle(ev.ActionCancelled("H", "gone"), 2.5)  # the pass now sees [c1, b1]
        assert invoked(out) == want, policy
        if policy == "tangram":
            assert loaded(out) == [("c", 1)]
            assert [(c.service, c.start) for c in out if isinstance(c, cmd.Evict)] == [("a", 1)]
        else:  # without the window: c1 takes the lowest free GPU, and b must be restored again
            assert sorted(loaded(out)) == [("b", 1), ("c", 0)]


def test_call_waits_for_its_busy_copy_rather_than_evict_the_service_the_call_behind_needs():
    # GPU 0 runs a until ~6 s, GPU 1 holds b and frees at 2 s with [a1, b1] queued. The plain
    # "sooner than a restore" rule restores a onto GPU 1 (a 4 s wait > a 1 s restore), evicting
    # b, which b1 then has to restore again. Counting b1's extra wait, a1 waits and b1 runs.
    s = make(2, {"a": 5.0, "b": 1.0})
    submit(s, "x", "a", 0.0)  # GPU 0, est. end 0 + 1 (restore) + 5
    submit(s, "y", "b", 0.0)  # GPU 1
    assert invoked(submit(s, "a1", "a", 0.5)) == {}
    assert invoked(submit(s, "b1", "b", 0.5)) == {}
    out = s.handle(ev.ActionFinished("y"), 2.0)
    assert invoked(out) == {"b1": 1}
    assert loaded(out) == []
    assert "busy GPU that holds a" in str(s.status_of("a1"))
    out = s.handle(ev.ActionFinished("x"), 6.0)
    assert invoked(out) == {"a1": 0}
    assert loaded(out) == []  # its own copy, no restore


def test_call_restores_when_the_evicted_service_has_another_copy_soon():
    # As above, but b has a second copy (GPU 2) that frees at 4 s and a's copy is busy until
    # 30 s: b1 loses only 2 s by the eviction, a1 would wait 28 s, so a1 restores onto GPU 1.
    s = make(3, {"a": 29.0, "b": 1.0})
    submit(s, "x", "a", 0.0)  # GPU 0, est. end 30
    submit(s, "y", "b", 0.0)  # GPU 1, est. end 2
    out = s.handle(ev.ActionSubmitted(replace(call_spec("y2", "b"), t_ori=3.0)), 0.0)
    assert invoked(out) == {"y2": 2}  # est. end 4
    submit(s, "a1", "a", 0.5)
    submit(s, "b1", "b", 0.5)
    out = s.handle(ev.ActionFinished("y"), 2.0)
    assert invoked(out) == {"a1": 1}
    assert loaded(out) == [("a", 1)]
    assert invoked(s.handle(ev.ActionFinished("y2"), 4.0)) == {"b1": 2}  # its other copy


def test_a_deep_queue_makes_a_restore_dearer_than_a_short_wait():
    # GPU 0 runs a until 3.5 s; GPU 1 frees at 2 s holding d, which nobody wants. a1 would wait
    # 1.5 s for its copy against a 1 s restore: alone it restores; with four calls behind it on a
    # two-GPU pool the restore's GPU time delays them too, so it waits and c1 takes GPU 1.
    for behind, want in ((0, {"a1": 1}), (4, {"c1": 1})):
        s = make(2, {"a": 2.5, "c": 1.0, "d": 1.0})
        submit(s, "x", "a", 0.0)  # GPU 0, est. end 3.5
        submit(s, "y", "d", 0.0)  # GPU 1, est. end 2
        submit(s, "a1", "a", 0.5)
        for i in range(1, behind + 1):
            submit(s, f"c{i}", "c", 0.5)
        out = s.handle(ev.ActionFinished("y"), 2.0)
        assert invoked(out) == want, behind
        if behind:
            assert "busy GPU that holds a" in str(s.status_of("a1"))
            assert invoked(s.handle(ev.ActionFinished("x"), 3.5)) == {"a1": 0}


def test_serverless_config_keeps_the_plain_eviction_order():
    # cache_aware=False (the serverless baseline) neither waits nor looks at the window.
    s = make(2, {"a": 5.0, "b": 1.0}, cache_aware=False, policy="min")
    submit(s, "x", "a", 0.0)
    submit(s, "y", "b", 0.0)
    submit(s, "a1", "a", 0.5)
    submit(s, "b1", "b", 0.5)
    out = s.handle(ev.ActionFinished("y"), 2.0)
    assert invoked(out) == {"a1": 1}
    assert loaded(out) == [("a", 1)]
