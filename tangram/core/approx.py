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
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tangram.core.dp import PrefixTable


@dataclass(frozen=True, slots=True)
class Behind:
    """A waiting action behind the candidates: (units, duration) options, minimum first.
    ``first`` is the first option; ``choices`` the options by units when there are several
    (None otherwise); ``settled``: no duration is negative, so once an option cannot start
    before the best end so far, no option with more units can end sooner. What ApproxACTs
    reads, prepared once."""

    options: tuple[tuple[int, float], ...]
    first: tuple[int, float] = field(init=False, repr=False, compare=False)
    choices: tuple[tuple[int, float], ...] | None = field(init=False, repr=False, compare=False)
    settled: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "first", self.options[0])
        by_units = tuple(sorted(self.options, key=lambda o: o[0])) if len(self.options) > 1 else None
        object.__setattr__(self, "choices", by_units)
        object.__setattr__(self, "settled", all(d >= 0.0 for _, d in self.options))


Release = tuple[float, int]  # (time, units)
Chosen = tuple[int, float, tuple[float, int, int, int] | None]  # units, duration, where it starts


class Timeline:
    """ApproxACTs over the running actions' releases: ``Timeline(running).objective(cand_total,
    cand_plan, behind, capacity_free, depth)`` is a plan's objective (the module docstring says how).
    The releases are sorted once (with their units' prefix sums) and shared by every plan that
    ``objective`` scores. A plan's own starts go to a small heap;
    the next release is the earlier of that heap's top and the static cursor's, so the
    releases are taken in exactly the order that popping one merged heap would take them."""

    __slots__ = ("prefix", "static", "units")

    def __init__(self, running: Sequence[Release]) -> None:
        self.static = sorted((t if t > 0.0 else 0.0, u) for t, u in running)
        self.prefix = [0]
        for _, u in self.static:
            self.prefix.append(self.prefix[-1] + u)
        self.units = self.prefix[-1]

    def start_when(self, heap: list[Release], p: int, free: int, need: int,
                   clock: float) -> tuple[float, int, int]:
        """Take releases, earliest first, until ``need`` units are free; returns (start,
        free, static cursor). A run of static releases is taken at once by bisecting their
        unit prefix sums, so waiting for many small releases costs O(log R), not O(R)."""
        static, prefix = self.static, self.prefix
        n = len(static)
        while free < need:
            if p < n and (not heap or static[p] <= heap[0]):
                hi = bisect_right(static, heap[0], p) if heap else n
                m = min(bisect_left(prefix, need - free + prefix[p], p + 1), hi)
                t = static[m - 1][0]
                if t > clock:
                    clock = t
                free += prefix[m] - prefix[p]
                p = m
            elif heap:
                t, u = heapq.heappop(heap)
                if t > clock:
                    clock = t
                free += u
            else:
                break
        return clock, free, p

    def objective(self, cand_total: float, cand_plan: Sequence[tuple[int, float]],
                  behind: Sequence[Behind], capacity_free: int, depth: int) -> float:
        """``cand_total`` (the candidates' summed durations) plus the estimated completion time of
        every action in ``behind``. ``cand_plan``: (units, duration) per candidate; ``capacity_free``:
        units free before the candidates start (the releases are ``running``'s (time left, units)).
        The first ``depth`` actions of ``behind`` with more than one option may choose among them
        (the one that finishes first); the others take their first option."""
        free = capacity_free
        heap = []
        for u, d in cand_plan:
            free -= u
            heap.append((d, u))
        heapq.heapify(heap)
        total_units = capacity_free + self.units
        obj, clock, explored, p = cand_total, 0.0, 0, 0
        push, pop = heapq.heappush, heapq.heappop
        static = self.static
        n = len(static)
        for b in behind:
            choices = b.choices
            if choices is not None and explored < depth:
                explored += 1
                chosen = self._choose(choices, b.settled, heap, p, free, clock, total_units)
                if chosen is None:
                    continue
                units, dur, at = chosen
                if at is not None:  # its start is known: take the same releases
                    clock, free, p, pops = at
                    for _ in range(pops):
                        pop(heap)
            else:
                units, dur = b.first
                if units > total_units:
                    continue
            if free < units:  # the common case, one release is enough, inline:
                if heap and (p >= n or heap[0] < static[p]):
                    r = heap[0]
                    if r[1] >= units - free:
                        pop(heap)
                        free += r[1]
                        if r[0] > clock:
                            clock = r[0]
                    else:
                        clock, free, p = self.start_when(heap, p, free, units, clock)
                elif p < n and static[p][1] >= units - free:
                    r = static[p]
                    p += 1
                    free += r[1]
                    if r[0] > clock:
                        clock = r[0]
                else:
                    clock, free, p = self.start_when(heap, p, free, units, clock)
            free -= units
            end = clock + dur
            push(heap, (end, units))
            obj += end
        return obj

    def _choose(self, by_units: tuple[tuple[int, float], ...], settled: bool, heap: list[Release], p: int,
                free: int, clock: float, total_units: int) -> Chosen | None:
        """The option that finishes first (the fewest units on a tie) among those the
        capacity can hold, None if none: (units, duration, where it starts) with where =
        (clock, free, static cursor, pops from ``heap``) once the releases were walked.
        While the heap's top comes after the releases an option waits for, its start is read
        off the static prefix sums (a bisection); otherwise the releases are walked."""
        if by_units[0][0] > total_units:
            return None
        if len(by_units) < 2 or by_units[1][0] > total_units:
            return by_units[0][0], by_units[0][1], None
        static, prefix = self.static, self.prefix
        n = len(static)
        top = heap[0] if heap else None
        best_end, best = 0.0, (0, 0.0, None)
        for i, (units, dur) in enumerate(by_units):
            if units > total_units:
                break
            if free >= units:
                at = (clock, free, p, 0)
            else:
                m = bisect_left(prefix, units - free + prefix[p], p + 1)
                if m > n or (top is not None and top < static[m - 1]):
                    return self._walk(by_units, heap, p, free, clock, total_units)
                t = static[m - 1][0]
                at = (t if t > clock else clock, free + prefix[m] - prefix[p], m, 0)
                if settled and i and at[0] >= best_end:  # starts later only: nothing after can win
                    break
            if i == 0 or at[0] + dur < best_end:
                best_end, best = at[0] + dur, (units, dur, at)
        return best

    def _walk(self, by_units: tuple[tuple[int, float], ...], heap: list[Release], p: int, free: int,
              clock: float, total_units: int) -> Chosen:
        """``_choose`` by walking the releases one at a time (static and heap interleave)."""
        releases = heap.copy()
        static = self.static
        n = len(static)
        pop = heapq.heappop
        pops = 0
        best_end, best = 0.0, (0, 0.0, None)
        for i, (units, dur) in enumerate(by_units):
            if units > total_units:
                break
            while free < units:  # one release at a time: the options are a few units apart
                if releases and (p >= n or releases[0] < static[p]):
                    t, u = pop(releases)
                    pops += 1
                elif p < n:
                    t, u = static[p]
                    p += 1
                else:
                    break
                if t > clock:
                    clock = t
                free += u
            if i == 0 or clock + dur < best_end:
                best_end, best = clock + dur, (units, dur, (clock, free, p, pops))
        return best


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
    releases = Timeline(running)
    arranged: dict[int, list[int]] = {}

    def objective(t: int) -> float:
        total, units = table.best(t)
        arranged[t] = units
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
    return list(arranged[t]) + [0] * (n - t)
