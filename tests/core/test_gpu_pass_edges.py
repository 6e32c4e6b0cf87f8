"""The GPU pass's bookkeeping, pinned where the mutation run of docs/testing.md found it
unchecked: the look-ahead window of the cache-aware choice, how far a pass reads its queue,
the reason a blocked head gives, and the fallback when a chosen chunk size cannot be placed."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from sched_util import call_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core import gpu_pass
from tangram.core.resources import GPU
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.state import Waiting
from tangram.core.status import Shortfall, wait


def _waiting(i: int, service: str, size: int) -> Waiting:
    return Waiting(call_spec(f"w{i}", service, (size,)), i, 0.0, None)


@pytest.mark.parametrize("seed", range(6))
def test_the_window_counts_the_calls_right_behind_each_position(seed):
    rng = random.Random(seed)
    keys = [(rng.choice("ab"), rng.choice((1, 2))) for _ in range(rng.randint(1, 12))]
    queue = [_waiting(i, svc, size) for i, (svc, size) in enumerate(keys)]
    size = rng.randint(1, 4)
    window = gpu_pass._Window(queue, size)
    i = -1
    while i < len(queue) - 1:
        # from the head on, positions only grow, by at most the window's size (the pass
        # moves one at a time; a longer jump would drop calls the window never held)
        i = 0 if i < 0 else min(len(queue) - 1, i + rng.randint(1, size))
        window.advance(i)
        behind = keys[i + 1 : i + 1 + size]
        assert window.count == Counter(behind), (keys, size, i)
        assert window.total == len(behind)


def test_the_window_at_the_head_holds_the_next_calls():
    queue = [_waiting(i, "a", 1) for i in range(5)]
    window = gpu_pass._Window(queue, 3)
    assert (window.count, window.total) == ({}, 0)
    window.advance(0)
    assert (window.count, window.total) == ({("a", 1): 3}, 3)
    window.advance(3)
    assert (window.count, window.total) == ({("a", 1): 1}, 1)
    window.advance(4)
    assert (window.count, window.total) == ({}, 0)


def _busy_cluster(**cfg) -> Scheduler:
    """n1: 2 GPUs, both busy with a 2-GPU call; n2: 4 GPUs, one busy."""
    s = Scheduler(CoreConfig(**cfg))
    s.handle(node("n1", 1, gpus=2), 0.0)
    s.handle(node("n2", 1, gpus=4), 0.0)
    s.handle(ev.ServiceDefined("rm", 10_000, (1, 2, 4), load_s=0.0, t_ori=5.0), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("big", "rm", (2,))), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("one", "rm", (1,))), 0.0)
    assert {aid: (r.node, r.chunk) for aid, r in s.running.items()} == {
        "big": ("n1", (0, 2)),
        "one": ("n2", (0, 1)),
    }
    return s


def test_a_blocked_gpu_head_names_the_free_and_total_gpus_of_the_pool():
    s = _busy_cluster()
    assert s.handle(ev.ActionSubmitted(call_spec("four", "rm", (4,))), 1.0) == []
    st = s.status_of("four")
    assert st is not None and st.reasons == (Shortfall(GPU, 4, 3, 6, "a free aligned chunk"),)


@pytest.mark.parametrize("aware", [False, True])
def test_a_gpu_pass_reads_the_blocked_head_and_at_most_behind_limit_calls_behind_it(aware):
    s = _busy_cluster(behind_limit=2, cache_aware=aware)
    s.handle(ev.ActionSubmitted(call_spec("four", "rm", (4,))), 1.0)
    for i in range(4):
        s.handle(ev.ActionSubmitted(call_spec(f"t{i}", "rm", (1,))), 1.0)
    before = s.examined["gpu"]
    assert s.handle(ev.ActionSubmitted(call_spec("last", "rm", (1,))), 2.0) == []
    assert s.examined["gpu"] - before == 3  # the head and the two behind it


# -- chunk sizes per policy ---------------------------------------------------------------------
def _gpu8(**cfg) -> Scheduler:
    s = Scheduler(CoreConfig(**cfg))
    s.handle(node("n1", 1, gpus=8), 0.0)
    s.handle(ev.ServiceDefined("t", 10_000, (1, 2, 4, 8), load_s=0.0, t_ori=8.0), 0.0)
    return s


def _chunk(s: Scheduler, aid: str, sizes=(1, 2, 4, 8), serial: float | None = 0.0, now: float = 0.0) -> int:
    out = s.handle(ev.ActionSubmitted(call_spec(aid, "t", sizes, serial=serial)), now)
    (inv,) = [c for c in out if isinstance(c, cmd.Invoke)]
    return inv.end - inv.start


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        ({"policy": "min"}, 1),
        ({"policy": "max"}, 8),
        ({"policy": "fixed", "fixed_dop": 2}, 2),
        ({"policy": "fixed", "fixed_dop": 3}, 4),  # the chunk that holds K
        ({"policy": "fixed", "fixed_dop": 16}, 8),  # at most the demand's maximum
        ({"policy": "fixed", "fixed_dop": 0}, 8),  # no K: elastic, as under tangram
        ({"policy": "tangram", "fixed_dop": 2}, 8),  # fixed_dop only counts under fixed
    ],
)
def test_an_elastic_call_gets_the_chunk_its_policy_says(cfg, want):
    assert _chunk(_gpu8(**cfg), "x") == want


def test_fixed_and_max_policies_fit_the_chunk_to_what_is_free():
    s = _gpu8(policy="fixed", fixed_dop=4)
    assert _chunk(s, "a", sizes=(4,)) == 4
    assert _chunk(s, "b", sizes=(1,)) == 1  # a fixed call keeps its size
    assert _chunk(s, "c") == 1  # K = 4 does not fit in the 3 GPUs left: the minimum
    s = _gpu8(policy="max")
    assert _chunk(s, "a", sizes=(4,)) == 4
    assert _chunk(s, "b", sizes=(1, 2)) == 2
    assert _chunk(s, "c", sizes=(1, 2, 4)) == 2  # the largest of what is free
    assert s.running["c"].est_end == 4.0


def test_a_min_policy_call_is_estimated_at_its_minimum():
    s = _gpu8(policy="min")
    assert _chunk(s, "x", sizes=(2, 4, 8), serial=0.5) == 2
    assert s.running["x"].est_end == pytest.approx(8.0 / (1.0 / (0.5 * 2 + 0.5) * 2))


# -- starting a call ------------------------------------------------------------------------------
def test_a_restore_evicts_exactly_the_chunk_it_needs_and_the_call_carries_its_load_time():
    s = Scheduler()
    s.handle(node("n1", 1, gpus=4, gpu_mem=80_000), 0.0)
    s.handle(ev.ServiceDefined("a", 50_000, (2,), load_s=1.0, t_ori=1.0), 0.0)
    s.handle(ev.ServiceDefined("b", 50_000, (2,), load_s=3.0, t_ori=2.0), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("a1", "a", (2,))), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("a2", "a", (2,))), 0.0)
    s.handle(ev.ActionFinished("a1"), 1.0)
    s.handle(ev.ActionFinished("a2"), 2.0)  # a on [0, 2) (older) and [2, 4)
    spec = replace(call_spec("b1", "b", (2,)), timeout_s=10.0)
    out = s.handle(ev.ActionSubmitted(spec), 5.0)
    assert out == [
        cmd.Evict("n1", "a", 0, 2),
        cmd.Load("n1", "b", 0, 2, 3.0),
        cmd.Invoke("b1", "n1", "b", 0, 2, 5.0),
    ]
    r = s.running["b1"]
    assert (r.units, r.chunk, r.load_s, r.started, r.est_end, r.deadline) == (2, (0, 2), 3.0, 5.0, 10.0, 15.0)
    assert s.handle(ev.Tick(), 15.0) == [cmd.Kill("b1", "n1", "timeout")]


def _chosen(monkeypatch, sizes: list[int]) -> tuple[Scheduler, list[cmd.Command]]:
    """GPUs 0-3 busy; "x" (1-8 GPUs) and "y" (1 GPU) reach the start step with ``sizes``
    from the sizes step (monkeypatched: more than the layout can place)."""
    s = _gpu8(policy="min")
    for i in range(4):
        s.handle(ev.ActionSubmitted(call_spec(f"f{i}", "t", (1,))), 0.0)
    monkeypatch.setattr(gpu_pass, "_sizes", lambda ctx, gnode, group, behind: sizes[: len(group)])
    s.handle(ev.ActionSubmitted(call_spec("x", "t", (1, 2, 4, 8))), 1.0, decide=False)
    s.handle(ev.ActionSubmitted(call_spec("y", "t", (1,))), 1.0, decide=False)
    out = s.decide(1.0)
    return s, [(c.action_id, c.start, c.end) for c in out if isinstance(c, cmd.Invoke)]


def test_a_chosen_size_that_cannot_be_placed_falls_back_to_the_minimum(monkeypatch):
    _, invoked = _chosen(monkeypatch, [8, 1])
    assert invoked == [("x", 4, 5), ("y", 5, 6)]


def test_a_minimum_that_cannot_be_placed_after_the_others_waits_with_the_reason(monkeypatch):
    s, invoked = _chosen(monkeypatch, [4, 1])
    assert invoked == [("x", 4, 8)]
    assert str(s.status_of("y")) == "unschedulable; no aligned chunk free on n1 after fragmentation"
    assert list(s.queues["gpu"]) == ["y"]


# -- greedy eviction on a GPU node ----------------------------------------------------------------
def _short_calls_behind_a_long_one(ny: int, **cfg) -> tuple[Scheduler, list[cmd.Command]]:
    """4 GPUs, two busy for 0.2 s; a long perfectly parallel call "X" and ``ny`` short ones."""
    s = Scheduler(CoreConfig(**cfg))
    s.handle(node("n1", 1, gpus=4), 0.0)
    s.handle(ev.ServiceDefined("x", 1000, (1, 2, 4, 8), load_s=0.0, t_ori=10.0), 0.0)
    s.handle(ev.ServiceDefined("y", 1000, (1,), load_s=0.0, t_ori=0.1), 0.0)
    s.handle(ev.ServiceDefined("r", 1000, (1,), load_s=0.0, t_ori=0.2), 0.0)
    for i in range(2):
        s.handle(ev.ActionSubmitted(call_spec(f"r{i}", "r", (1,))), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("X", "x", (1, 2, 4, 8), serial=0.0)), 0.1, decide=False)
    for j in range(ny):
        s.handle(ev.ActionSubmitted(call_spec(f"Y{j}", "y", (1,))), 0.1, decide=False)
    return s, s.decide(0.1)


def _invoked(out: list[cmd.Command]) -> list[tuple[str, int]]:
    return [(c.action_id, c.end - c.start) for c in out if isinstance(c, cmd.Invoke)]


def test_greedy_eviction_holds_a_short_call_back_so_the_long_one_gets_two_gpus():
    s, out = _short_calls_behind_a_long_one(3)
    assert _invoked(out) == [("X", 2)]
    assert s.status_of("Y0") == wait(
        message="held back: starting it now would raise the summed completion time"
    )
    assert s.status_of("Y1") == wait(Shortfall(GPU, 1, 0, 4, "a free aligned chunk"))


def test_without_eviction_every_candidate_starts_at_the_dp_sizes():
    _, out = _short_calls_behind_a_long_one(3, eviction=False)
    assert _invoked(out) == [("X", 1), ("Y0", 1)]


def test_a_free_copy_is_another_idle_chunk_of_the_same_service_and_size():
    s = Scheduler()
    s.handle(node("n1", 1, gpus=4), 0.0)
    s.handle(node("n2", 1, gpus=2), 0.0)
    gnode, other = s.gpu.nodes["n1"], s.gpu.nodes["n2"]
    for inst in (("a", 0, 1), ("a", 1, 1), ("a", 2, 2)):
        gnode.add_resident(inst, 100, 1.0)
    other.add_resident(("b", 0, 1), 100, 1.0)
    busy = {"n1": 0b0010, "n2": 0}
    free_copy = gpu_pass._free_copy
    assert not free_copy(s._ctx, ("a", 0, 1), "n1", busy)  # the other 1-GPU copy is busy (in this pass)
    assert free_copy(s._ctx, ("a", 0, 1), "n1", {"n1": 0, "n2": 0})
    assert not free_copy(s._ctx, ("a", 2, 2), "n1", busy)  # no other 2-GPU copy of a
    assert not free_copy(s._ctx, ("b", 0, 1), "n2", busy)  # itself does not count
    assert free_copy(s._ctx, ("b", 1, 1), "n1", busy)  # n2's copy, free
    gnode.busy = 0b0001  # the node's own mask is not this pass's
    assert free_copy(s._ctx, ("a", 1, 1), "n1", {"n1": 0, "n2": 0})


# -- how a pass reads and books the queue ---------------------------------------------------------
def test_a_pass_books_each_candidates_chunk_on_top_of_the_busy_ones():
    s = Scheduler()
    s.handle(node("n1", 1, gpus=2), 0.0)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=0.0, t_ori=5.0), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("run", "rm")), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("a", "rm")), 1.0, decide=False)
    s.handle(ev.ActionSubmitted(call_spec("b", "rm")), 1.0, decide=False)
    assert _invoked(s.decide(1.0)) == [("a", 1)]
    assert s.status_of("b") == wait(Shortfall(GPU, 1, 0, 2, "a free aligned chunk"))


def test_a_pass_reads_past_its_first_batch_of_the_queue():
    s = Scheduler(CoreConfig(behind_limit=2))  # the first read is 2 * 2 + 2 calls
    s.handle(node("n1", 1, gpus=8), 0.0)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=0.0, t_ori=5.0), 0.0)
    for i in range(11):
        s.handle(ev.ActionSubmitted(call_spec(f"c{i:02}", "rm")), 0.0, decide=False)
    out = s.decide(0.0)
    assert [aid for aid, _ in _invoked(out)] == [f"c{i:02}" for i in range(8)]
    assert s.examined["gpu"] == 11  # the 8, the blocked head, the 2 behind it


def test_the_fallback_to_the_minimum_stays_on_the_candidates_node(monkeypatch):
    s = _gpu8(policy="min")
    s.handle(node("n2", 1, gpus=1), 0.0)  # a 1-GPU block: the best chunk of all for 1 GPU
    s.handle(ev.ActionSubmitted(call_spec("n2-busy", "t", (1,))), 0.0)
    assert s.running["n2-busy"].node == "n2"
    for i in range(4):
        s.handle(ev.ActionSubmitted(call_spec(f"f{i}", "t", (1,))), 0.0)
    s.handle(ev.ActionFinished("n2-busy"), 0.5)
    monkeypatch.setattr(gpu_pass, "_sizes", lambda ctx, gnode, group, behind: [8] * len(group))
    s.handle(ev.ActionSubmitted(call_spec("x", "t", (1, 2, 4, 8))), 1.0, decide=False)
    s.handle(ev.ActionSubmitted(call_spec("y", "t", (1, 2, 4, 8))), 1.0, decide=False)
    out = s.decide(1.0)
    # x was booked on n2 (its 1-GPU block is the best fit), y on n1: each falls back there
    assert [(c.action_id, c.node, c.start) for c in out if isinstance(c, cmd.Invoke)] == [
        ("y", "n1", 4),
        ("x", "n2", 0),
    ]


def test_a_call_that_cannot_be_placed_does_not_stop_the_ones_after_it(monkeypatch):
    s = _gpu8(policy="min")
    for i in range(4):
        s.handle(ev.ActionSubmitted(call_spec(f"f{i}", "t", (1,))), 0.0)
    monkeypatch.setattr(gpu_pass, "_sizes", lambda ctx, gnode, group, behind: [2, 4, 1][: len(group)])
    for aid, sizes in (("x", (1, 2)), ("y", (1, 4)), ("z", (1,))):
        s.handle(ev.ActionSubmitted(call_spec(aid, "t", sizes)), 1.0, decide=False)
    out = s.decide(1.0)
    assert _invoked(out) == [("x", 2), ("y", 1), ("z", 1)]


def test_max_takes_the_only_chunk_size_that_fits():
    s = _gpu8(policy="max")
    for i in range(7):
        s.handle(ev.ActionSubmitted(call_spec(f"f{i}", "t", (1,))), 0.0)
    assert _chunk(s, "x", sizes=(1, 2, 4)) == 1
    assert s.running["x"].est_end == 8.0


def test_a_resident_call_costs_no_restore_time():
    s = _gpu8(policy="min")
    s.handle(ev.ServiceDefined("slow", 10_000, (1,), load_s=3.0, t_ori=2.0), 0.0)
    out = s.handle(ev.ActionSubmitted(call_spec("a", "slow")), 0.0)
    assert out[-1] == cmd.Invoke("a", "n1", "slow", 0, 1, 5.0)
    s.handle(ev.ActionFinished("a"), 5.0)
    assert s.handle(ev.ActionSubmitted(call_spec("b", "slow")), 6.0) == [
        cmd.Invoke("b", "n1", "slow", 0, 1, 2.0)
    ]
    assert s.running["b"].load_s == 0.0


def test_the_chunk_sizes_follow_the_free_layout_of_each_pass():
    s = _gpu8()
    assert _chunk(s, "x") == 8
    s.handle(ev.ActionFinished("x"), 1.0)
    assert _chunk(s, "four", sizes=(4,), now=2.0) == 4
    assert _chunk(s, "y", now=2.0) == 4  # the other half, not the whole node of the first pass
    s.handle(ev.ActionFinished("four"), 3.0)
    s.handle(ev.ActionFinished("y"), 3.0)
    for i in range(4):  # four 2-GPU calls, then two of them end: [0, 2) and [4, 6) are free
        s.handle(ev.ActionSubmitted(call_spec(f"p{i}", "t", (2,))), 4.0)
    s.handle(ev.ActionFinished("p0"), 5.0)
    s.handle(ev.ActionFinished("p2"), 5.0)
    assert _chunk(s, "z", now=6.0) == 2  # 4 GPUs are free, but no aligned 4-GPU block
