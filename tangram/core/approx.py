"""ApproxACTs (paper Algorithm 2, reconstructed): the summed completion time of a plan.

Candidates start now with their DP allocation; every waiting action behind them starts, in
FCFS order, as soon as enough units have been released by the completions in a heap
(running actions and earlier starts); the first ``depth`` of them that have a choice may
instead try each of a few feasible allocations and keep the one that finishes first. A
running action is expected to end at its estimate (callers pass time left). Times are
relative to now.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tangram.core.dp import PrefixTable


@dataclass(frozen=True)
class Behind:
    """A waiting action behind the candidates: (units, duration) options, minimum first."""

    options: tuple[tuple[int, float], ...]


def _start_when(heap: list[tuple[float, int]], free: int, need: int, clock: float) -> tuple[float, int]:
    """Pop completions until ``need`` units are free; returns (start, free)."""
    while free < need and heap:
        t, u = heapq.heappop(heap)
        clock = max(clock, t)
        free += u
    return clock, free


def approx_acts(
    cand_total: float,
    cand_plan: Sequence[tuple[int, float]],
    running: Sequence[tuple[float, int]],
    behind: Sequence[Behind],
    capacity_free: int,
    depth: int = 2,
) -> float:
    """Objective of a plan: ``cand_total`` (sum of the candidates' durations) plus the
    estimated completion times of the ``behind`` actions.

    ``cand_plan``: (units, duration) per candidate; ``running``: (time left, units) of the
    actions already running; ``capacity_free``: units free before the candidates start.
    The first ``depth`` actions of ``behind`` that have more than one option may choose
    among them (the one that finishes first); the others take their first option.
    """
    return _Releases(running).objective(cand_total, cand_plan, behind, capacity_free, depth)


class _Releases:
    """The running actions' releases as a heap, built once and copied per plan."""

    __slots__ = ("heap", "units")

    def __init__(self, running: Sequence[tuple[float, int]]) -> None:
        self.heap = [(t if t > 0.0 else 0.0, u) for t, u in running]
        heapq.heapify(self.heap)
        self.units = sum(u for _, u in running)

    def objective(self, cand_total: float, cand_plan: Sequence[tuple[int, float]],
                  behind: Sequence[Behind], capacity_free: int, depth: int) -> float:
        free = capacity_free
        heap = self.heap.copy()
        for u, d in cand_plan:
            free -= u
            heapq.heappush(heap, (d, u))
        total_units = capacity_free + self.units
        obj, clock, explored = cand_total, 0.0, 0
        push = heapq.heappush
        for b in behind:
            opts = b.options
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
            if free < units:  # most entries start at once: skip the call
                clock, free = _start_when(heap, free, units, clock)
            free -= units
            push(heap, (clock + dur, units))
            obj += clock + dur
        return obj


def _best_option(
    heap: list[tuple[float, int]], free: int, clock: float, options: Sequence[tuple[int, float]]
) -> tuple[int, float]:
    """The (units, duration) option that finishes first (the fewest units on a tie). One
    copy of the heap serves all options: their starts come from one release timeline."""
    releases, best = list(heap), None
    for units, dur in sorted(options, key=lambda o: o[0]):
        clock, free = _start_when(releases, free, units, clock)
        if best is None or clock + dur < best[0]:
            best = (clock + dur, units, dur)
    assert best is not None
    return best[1], best[2]


def greedy_eviction(
    table: PrefixTable,
    options: Sequence[Mapping[int, float]],
    running: Sequence[tuple[float, int]],
    cand_behind: Sequence[Behind],
    behind: Sequence[Behind],
    capacity_free: int,
    depth: int = 2,
    hold_all: bool = False,
) -> list[int]:
    """Algorithm 1's greedy eviction: drop candidates from the tail of the FCFS prefix while
    ApproxACTs (candidates started with DPArrange's units + the queue behind them) improves.
    Returns units per candidate, 0 for those held back (they stay at the head of the queue).
    ``table`` is the prefix table over ``options``; ``cand_behind[i]`` is candidate i as a
    waiting action, used once it is held back. With ``hold_all`` (beyond the paper's loop,
    which keeps at least one candidate) the whole prefix is held when that is lower still:
    the caller allows it only when the head could use more units than are free and
    something running will free some."""
    n = len(options)
    releases = _Releases(running)

    def objective(t: int) -> float:
        total, units = table.best(t)
        plan = [(u, options[i][u]) for i, u in enumerate(units)]
        # held-back candidates keep their choice of units (as in the DP), on top of ``depth``
        return releases.objective(total, plan, [*cand_behind[t:], *behind], capacity_free, depth + n - t)

    t, best = n, objective(n)
    while t > 1 and table.feasible(t - 1):
        obj = objective(t - 1)
        if obj >= best:
            break
        best, t = obj, t - 1
    if hold_all and objective(0) < best:
        return [0] * n
    return list(table.best(t)[1]) + [0] * (n - t)
