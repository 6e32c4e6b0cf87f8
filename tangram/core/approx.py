"""ApproxACTs (paper Algorithm 2, reconstructed): the summed completion time of a plan.

Candidates start now with their DP allocation; every waiting action behind them starts, in
FCFS order, as soon as enough units have been released by the completions in a heap
(running actions and earlier starts); the first ``depth`` of them may instead try each of a
few feasible allocations and keep the one that finishes first. Times are relative to now.
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
    """
    free = capacity_free - sum(u for u, _ in cand_plan)
    heap = [(max(0.0, t), u) for t, u in running] + [(d, u) for u, d in cand_plan]
    heapq.heapify(heap)
    total_units = capacity_free + sum(u for _, u in running)
    obj, clock = cand_total, 0.0
    for i, b in enumerate(behind):
        options = [o for o in (b.options if i < depth else b.options[:1]) if o[0] <= total_units]
        if not options:
            continue
        units, dur = options[0] if len(options) == 1 else _best_option(heap, free, clock, options)
        clock, free = _start_when(heap, free, units, clock)
        free -= units
        heapq.heappush(heap, (clock + dur, units))
        obj += clock + dur
    return obj


def _best_option(
    heap: list[tuple[float, int]], free: int, clock: float, options: Sequence[tuple[int, float]]
) -> tuple[int, float]:
    """The (units, duration) option that finishes first, each tried on a copy of the heap."""
    best: tuple[float, int, float] | None = None
    for units, dur in options:
        start, _ = _start_when(list(heap), free, units, clock)
        if best is None or start + dur < best[0]:
            best = (start + dur, units, dur)
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
) -> list[int]:
    """Algorithm 1's greedy eviction: drop candidates from the tail of the FCFS prefix while
    ApproxACTs (candidates started with DPArrange's units + the queue behind them) improves.
    Returns units per candidate, 0 for those held back (they stay at the head of the queue).
    ``table`` is the prefix table over ``options``; ``cand_behind[i]`` is candidate i as a
    waiting action, used once it is held back."""
    n = len(options)

    def objective(t: int) -> float:
        total, units = table.best(t)
        plan = [(u, options[i][u]) for i, u in enumerate(units)]
        return approx_acts(total, plan, running, [*cand_behind[t:], *behind], capacity_free, depth)

    t, best = n, objective(n)
    while t > 1 and table.feasible(t - 1):
        obj = objective(t - 1)
        if obj >= best:
            break
        best, t = obj, t - 1
    return list(table.best(t)[1]) + [0] * (n - t)
