"""ApproxACTs (paper Algorithm 2, reconstructed): the summed completion time of a plan.

Candidates start now with their DP allocation; every waiting action behind them starts, in
FCFS order, as soon as enough units have been released by the completions in a heap
(running actions and earlier starts); the first ``depth`` of them may instead try each of a
few feasible allocations and keep the one that finishes first. Times are relative to now.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


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
