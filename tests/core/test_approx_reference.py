"""ApproxACTs and greedy eviction equal a plain one-heap reference, to the last bit.

``approx.py`` keeps the running actions' releases sorted with unit prefix sums and only the
plan's own starts in a heap, takes runs of releases at once and reuses the walk of the
options it compares: all of it must give exactly the floats (and so the decisions) of
popping one heap of every release. The reference below is that plain algorithm.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_util import approx_acts

from tangram.core.approx import Behind, greedy_eviction
from tangram.core.dp import GreedyTable, arrange_table


def _start_when(heap: list[tuple[float, int]], free: int, need: int, clock: float) -> tuple[float, int]:
    while free < need and heap:
        t, u = heapq.heappop(heap)
        clock = max(clock, t)
        free += u
    return clock, free


def _best_option(heap: list[tuple[float, int]], free: int, clock: float,
                 options: Sequence[tuple[int, float]]) -> tuple[int, float]:
    releases, best = list(heap), None
    for units, dur in sorted(options, key=lambda o: o[0]):
        clock, free = _start_when(releases, free, units, clock)
        if best is None or clock + dur < best[0]:
            best = (clock + dur, units, dur)
    assert best is not None
    return best[1], best[2]


def reference_acts(cand_total: float, cand_plan: Sequence[tuple[int, float]],
                   running: Sequence[tuple[float, int]],
                   behind: Sequence[Sequence[tuple[int, float]]], capacity_free: int, depth: int) -> float:
    heap = [(t if t > 0.0 else 0.0, u) for t, u in running]  # noqa: FURB136 (as approx.py writes it)
    heapq.heapify(heap)
    free = capacity_free
    for u, d in cand_plan:
        free -= u
        heapq.heappush(heap, (d, u))
    total_units = capacity_free + sum(u for _, u in running)
    obj, clock, explored = cand_total, 0.0, 0
    for opts in behind:
        if len(opts) > 1 and explored < depth:
            explored += 1
            options = [o for o in opts if o[0] <= total_units]
            if not options:
                continue
            units, dur = options[0] if len(options) == 1 else _best_option(heap, free, clock, options)
        else:
            units, dur = opts[0]
            if units > total_units:
                continue
        clock, free = _start_when(heap, free, units, clock)
        free -= units
        heapq.heappush(heap, (clock + dur, units))
        obj += clock + dur
    return obj


def reference_eviction(options, running, cand_behind, behind, capacity_free, depth, hold_all):  # type: ignore[no-untyped-def]
    table = arrange_table(options, capacity_free)
    n = len(options)

    def objective(t: int) -> float:
        total, units = table.best(t)
        plan = [(u, options[i][u]) for i, u in enumerate(units)]
        return reference_acts(total, plan, running, [*cand_behind[t:], *behind], capacity_free, depth + n - t)

    t, best = n, objective(n)
    while t > 1 and table.feasible(t - 1):
        obj = objective(t - 1)
        if obj >= best:
            break
        best, t = obj, t - 1
    if hold_all and objective(0) < best:
        return [0] * n
    return list(table.best(t)[1]) + [0] * (n - t)


durations = st.floats(0.0, 50.0, allow_nan=False).map(lambda x: round(x, 3))
release = st.tuples(st.floats(-2.0, 30.0, allow_nan=False), st.integers(1, 8))


@st.composite
def behind_options(draw: st.DrawFn) -> tuple[tuple[int, float], ...]:
    units = draw(st.lists(st.integers(1, 20), min_size=1, max_size=5, unique=True))
    some = durations if draw(st.integers(0, 9)) else st.floats(-5.0, 50.0, allow_nan=False)  # at times < 0
    return tuple((u, draw(some)) for u in units)  # any order: the minimum need not come first


@settings(max_examples=300, deadline=None)
@given(st.lists(release, max_size=40), st.lists(st.tuples(st.integers(1, 6), durations), max_size=5),
       st.lists(behind_options(), max_size=30), st.integers(0, 24), st.integers(0, 4))
def test_approx_acts_equals_the_one_heap_reference(running, plan, behind, free, depth) -> None:  # type: ignore[no-untyped-def]
    cand_total = sum(d for _, d in plan)
    got = approx_acts(cand_total, plan, running, [Behind(b) for b in behind], free, depth)
    assert got == reference_acts(cand_total, plan, running, behind, free, depth)


@st.composite
def eviction_case(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    n = draw(st.integers(1, 7))
    options = []
    for _ in range(n):
        lo = draw(st.integers(1, 3))
        hi = draw(st.integers(lo, lo + 6))
        t_ori = draw(st.floats(0.5, 40.0))
        serial = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
        options.append({u: t_ori * (serial + (1 - serial) / u) for u in range(lo, hi + 1)})
    free = sum(min(o) for o in options) + draw(st.integers(0, 12))
    cand_behind = [tuple(sorted(o.items())) for o in options]
    behind = draw(st.lists(behind_options(), max_size=20))
    running = draw(st.lists(release, max_size=30))
    return options, running, cand_behind, behind, free, draw(st.integers(0, 3)), draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(eviction_case())
def test_greedy_eviction_equals_the_one_heap_reference(case) -> None:  # type: ignore[no-untyped-def]
    options, running, cand_behind, behind, free, depth, hold_all = case
    table = arrange_table(options, free)
    got = greedy_eviction(table, options, running, [Behind(b) for b in cand_behind],
                          [Behind(b) for b in behind], free, depth, hold_all=hold_all)
    assert got == reference_eviction(options, running, cand_behind, behind, free, depth, hold_all)


@settings(max_examples=200, deadline=None)
@given(eviction_case())
def test_greedy_table_small_path_equals_its_numpy_path(case) -> None:  # type: ignore[no-untyped-def]
    options, *_, free, _depth, _hold = case
    small = GreedyTable(options, free)
    try:
        GreedyTable.SMALL_GAINS = -1  # type: ignore[misc]
        big = GreedyTable(options, free)
    finally:
        GreedyTable.SMALL_GAINS = 512  # type: ignore[misc]
    assert small._owners is not None and big._owners is None
    for t in range(len(options) + 1):
        assert small.feasible(t) == big.feasible(t)
        if small.feasible(t):
            assert small.best(t) == big.best(t)
