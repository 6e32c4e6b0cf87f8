"""DPArrange (paper Algorithm 3): units per elastic candidate that minimise the summed duration.

Contract:

1. Everything here is pure: inputs are read-only, nothing is cached across calls, no clock, no randomness.
2. ``options[i]`` maps each feasible unit count of candidate ``i`` (an ``int >= 0``) to its duration (a finite
   float). An empty mapping or a negative unit count is :class:`Infeasible`; a non-finite duration is a
   ``ValueError`` (a caller with an unknown duration must not run the DP at all).
3. An arrangement is ``(total, units)``: ``units[i]`` is a key of ``options[i]`` and ``total`` is
   ``sum(options[i][units[i]])``. The optimum is taken over every state the operator allows (for plain unit
   counts: every ``j <= capacity``, not only ``j == capacity``), so units stay idle when more would not help.
4. Ties are broken deterministically: among totals within ``TIE_RTOL`` of the optimum the arrangement using
   the fewest units wins, then the lowest state index; within a DP row the smallest unit count wins.
5. One table serves every prefix: ``table.best(t)`` is the optimum for the first ``t`` candidates, without a
   refill. This is what greedy eviction asks for (``t = n, n-1, ...``).
6. The fast path (:func:`greedy_arrange`, :class:`GreedyTable`) is exact when every candidate's options are a
   contiguous range ``[lo, hi]`` whose durations are convex in the unit count (:func:`is_convex_range`);
   :func:`arrange` and :func:`arrange_table` pick it only then.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from itertools import accumulate
from math import isfinite
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "CONVEX_RTOL",
    "TIE_RTOL",
    "Arrangement",
    "DPOperator",
    "DPTable",
    "GreedyTable",
    "Infeasible",
    "Options",
    "PlainOperator",
    "PrefixTable",
    "arrange",
    "arrange_table",
    "dp_arrange",
    "greedy_arrange",
    "is_convex_range",
    "scalar_prev_matrix",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Options = Sequence[Mapping[int, float]]
Arrangement = tuple[float, list[int]]
Curve = tuple[int, list[float]]  # (lo, [d(lo), .., d(hi)])

TIE_RTOL: Final = 1e-12
"""Totals within this relative distance of the optimum count as ties (then fewer units win)."""
CONVEX_RTOL: Final = 1e-9
"""Second differences down to ``-CONVEX_RTOL * max|duration|`` still count as convex (float noise)."""


class Infeasible(ValueError):
    """Even the minimum units of the candidates do not fit (or a candidate has no feasible option)."""


# --------------------------------------------------------------------------------------------- operators


class DPOperator(Protocol):
    """The topology of one resource for the DP: which states exist and how a grant moves between them.

    States are integers ``0 .. num_states - 1``; ``start`` is the state before any candidate got units.
    ``prev(state, u)`` is the state before granting ``u`` units that leads to ``state``, or ``-1`` when no
    such state exists. ``valid(state)`` says whether the state can be realised on the resource right now.
    ``units_of(state)`` is the number of units handed out in ``state`` (used for the fewer-units tie-break).
    ``prev_matrix(units)`` is ``prev`` vectorised: row ``r`` holds ``prev(s, units[r])`` for each state ``s``.
    """

    @property
    def num_states(self) -> int: ...

    @property
    def start(self) -> int: ...

    def prev(self, state: int, units: int) -> int: ...

    def valid(self, state: int) -> bool: ...

    def units_of(self, state: int) -> int: ...

    def prev_matrix(self, units: Sequence[int]) -> IntArray: ...


def scalar_prev_matrix(operator: DPOperator, units: Sequence[int]) -> IntArray:
    """``operator.prev_matrix`` built from scalar ``prev`` calls, for operators without a vectorised form."""
    states = range(operator.num_states)
    rows = [[operator.prev(s, u) for s in states] for u in units]
    return np.array(rows, dtype=np.int64).reshape(len(units), operator.num_states)


class PlainOperator:
    """Plain unit counts (CPU cores): state ``j`` means ``j`` units handed out, ``0 <= j <= capacity``."""

    __slots__ = ("_capacity",)

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"`capacity` must be >= 0, got {capacity}")
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        """The free units the table may hand out."""
        return self._capacity

    @property
    def num_states(self) -> int:
        """``capacity + 1`` states: ``0 .. capacity`` units used."""
        return self._capacity + 1

    @property
    def start(self) -> int:
        """No unit used yet."""
        return 0

    def prev(self, state: int, units: int) -> int:
        """``state - units`` when both ends are states and ``units >= 0``; ``-1`` otherwise."""
        before = state - units
        ok = 0 <= before <= state <= self._capacity
        return before if ok else -1

    def valid(self, state: int) -> bool:
        """Every count up to the capacity is realisable."""
        return 0 <= state <= self._capacity

    def units_of(self, state: int) -> int:
        """The state is the unit count."""
        return state

    def prev_matrix(self, units: Sequence[int]) -> IntArray:
        """``j - u`` for every (u, j), ``-1`` where negative."""
        u = np.asarray(units, dtype=np.int64).reshape(-1, 1)
        before = np.arange(self.num_states, dtype=np.int64).reshape(1, -1) - u
        bad = (before < 0) | (u < 0)
        return np.where(bad, np.int64(-1), before)


# --------------------------------------------------------------------------------------------- validation


def _checked(options: Options) -> list[dict[int, float]]:
    """Copies of the options after checking contract rule 2."""
    out: list[dict[int, float]] = []
    for i, opt in enumerate(options):
        if not opt:
            raise Infeasible(f"candidate {i} has no feasible unit count")
        if min(opt) < 0:
            raise Infeasible(f"candidate {i} has a negative unit count {min(opt)}")
        if not all(map(isfinite, opt.values())):
            bad = next(u for u, d in opt.items() if not isfinite(d))
            raise ValueError(f"candidate {i} has a non-finite duration for {bad} units")
        out.append(dict(opt))
    return out


def _check_prefix(t: int, n: int) -> None:
    """``0 <= t <= n`` or a ValueError naming the parameter."""
    if not 0 <= t <= n:
        raise ValueError(f"`t` must be in 0..{n}, got {t}")


def _total(options: Sequence[Mapping[int, float]], units: Sequence[int]) -> float:
    """Summed duration of an arrangement, added left to right (the DP's order)."""
    total = 0.0
    for opt, u in zip(options, units, strict=True):
        total += opt[u]
    return total


# --------------------------------------------------------------------------------------------- DP table


class PrefixTable(Protocol):
    """Arrangements for every prefix of one candidate list (a :class:`DPTable` or a :class:`GreedyTable`)."""

    def __len__(self) -> int: ...

    def feasible(self, t: int) -> bool: ...

    def best(self, t: int | None = None) -> Arrangement: ...


class DPTable:
    """Algorithm 3 filled once for a candidate list; ``best(t)`` answers for each prefix without a refill.

    Row ``i`` of the cost table is the optimum per state for the first ``i`` candidates; rows are filled with
    numpy over all states and all unit counts of a candidate at once (O(n * |units| * states) work).
    """

    __slots__ = ("_choice", "_cost", "_op", "_options", "_units_of")

    def __init__(self, options: Options, operator: DPOperator) -> None:
        self._options = _checked(options)
        self._op = operator
        states = operator.num_states
        valid = np.array([operator.valid(s) for s in range(states)], dtype=bool)
        self._units_of = np.array([operator.units_of(s) for s in range(states)], dtype=np.int64)
        n = len(self._options)
        self._cost: FloatArray = np.full((n + 1, states), np.inf)
        self._choice: IntArray = np.full((n + 1, states), -1, dtype=np.int64)
        if valid[operator.start]:
            self._cost[0, operator.start] = 0.0
        self._fill(valid)

    def __len__(self) -> int:
        return len(self._options)

    def _fill(self, valid: npt.NDArray[np.bool_]) -> None:
        """Fill rows 1..n; prev matrices are shared by candidates with the same unit set."""
        cache: dict[tuple[int, ...], tuple[IntArray, IntArray]] = {}
        for i, opt in enumerate(self._options, start=1):
            key = tuple(sorted(opt))
            if key not in cache:
                cache[key] = (np.array(key, dtype=np.int64), self._op.prev_matrix(key))
            units, prev = cache[key]
            durations = np.array([opt[u] for u in key], dtype=np.float64)
            self._fill_row(i, units, prev, durations, valid)

    def _fill_row(
        self, i: int, units: IntArray, prev: IntArray, durations: FloatArray, valid: npt.NDArray[np.bool_]
    ) -> None:
        """Row ``i`` from row ``i - 1``; index -1 lands on the appended ``inf`` (no predecessor)."""
        before = np.append(self._cost[i - 1], np.inf)
        candidates = before[prev] + durations[:, None]
        pick = np.argmin(candidates, axis=0)  # first minimum: the smallest unit count
        row = candidates[pick, np.arange(candidates.shape[1])]
        row[~valid] = np.inf
        self._cost[i] = row
        self._choice[i] = np.where(np.isfinite(row), units[pick], -1)

    def feasible(self, t: int) -> bool:
        """Whether the first ``t`` candidates fit together at their minimums."""
        _check_prefix(t, len(self))
        return bool(np.isfinite(self._cost[t]).any())

    def best(self, t: int | None = None) -> Arrangement:
        """The optimum for the first ``t`` candidates (all if ``None``); :class:`Infeasible` if none fits."""
        t = len(self) if t is None else t
        _check_prefix(t, len(self))
        state = self._best_state(t)
        return float(self._cost[t, state]), self._backtrack(t, state)

    def _best_state(self, t: int) -> int:
        """The final state per contract rule 4."""
        row = self._cost[t]
        finite = np.isfinite(row)
        if not finite.any():
            raise Infeasible(f"the minimum units of the first {t} candidates do not fit")
        low = float(row[finite].min())
        near = np.flatnonzero(row <= low + TIE_RTOL * max(1.0, abs(low)))
        return int(near[np.argmin(self._units_of[near])])

    def _backtrack(self, t: int, state: int) -> list[int]:
        """Units per candidate, walking the choices from row ``t`` back to row 1."""
        units = [0] * t
        for i in range(t, 0, -1):
            u = int(self._choice[i, state])
            units[i - 1] = u
            state = self._op.prev(state, u)
        return units


def dp_arrange(options: Options, capacity: int) -> Arrangement:
    """The optimum over every total ``j <= capacity`` of plain units (Algorithm 3, :class:`PlainOperator`).

    Empty ``options`` gives ``(0.0, [])``; raises :class:`Infeasible` when the minimums exceed ``capacity``.
    """
    checked = _checked(options)
    _check_minimums(checked, capacity)
    return DPTable(checked, PlainOperator(capacity)).best()


def _check_minimums(options: Sequence[Mapping[int, float]], capacity: int) -> None:
    """Raise :class:`Infeasible` (with the shortfall) when the minimums exceed ``capacity``."""
    if capacity < 0:
        raise ValueError(f"`capacity` must be >= 0, got {capacity}")
    need = sum(min(opt) for opt in options)
    if need > capacity:
        raise Infeasible(f"the minimums need {need} units but only {capacity} are free")


# --------------------------------------------------------------------------------------------- greedy path


def _convex_curve(opt: Mapping[int, float]) -> Curve | None:
    """``(lo, [d(lo), .., d(hi)])`` when ``opt`` is a convex contiguous range, else ``None``."""
    if not opt:
        return None
    lo, hi = min(opt), max(opt)
    if lo < 0 or len(opt) != hi - lo + 1:
        return None
    curve = list(map(float, map(opt.__getitem__, range(lo, hi + 1))))
    if not all(map(isfinite, curve)):
        return None
    if 3 <= len(curve) <= 64:  # plain Python: the same float operations, without numpy's per-call cost
        low = min(a - 2.0 * b + c for a, b, c in zip(curve, curve[1:], curve[2:], strict=False))
        if low < -CONVEX_RTOL * max(1.0, max(map(abs, curve))):
            return None
    elif len(curve) > 64:
        d = np.array(curve)
        second = d[:-2] - 2.0 * d[1:-1] + d[2:]
        if float(second.min()) < -CONVEX_RTOL * max(1.0, float(np.abs(d).max())):
            return None
    return lo, curve


def convex_curve(opt: Mapping[int, float]) -> Curve | None:
    """``(lo, [d(lo), .., d(hi)])`` when ``opt`` is a convex contiguous range, else ``None``."""
    return _convex_curve(opt)


def is_convex_range(opt: Mapping[int, float]) -> bool:
    """Whether the unit counts are ``lo..hi`` (no gaps) and the durations are convex in the unit count."""
    return _convex_curve(opt) is not None


def _all_curves(options: Options) -> list[Curve] | None:
    """The curve of every candidate, or ``None`` as soon as one is not a convex range."""
    curves = []
    for opt in options:
        curve = _convex_curve(opt)
        if curve is None:
            return None
        curves.append(curve)
    return curves


def _convex_curves(options: Options) -> list[Curve]:
    """The curves of every candidate, or ValueError when one is not a convex range."""
    curves = _all_curves(options)
    if curves is None:
        i = next(i for i, opt in enumerate(options) if not is_convex_range(opt))
        raise ValueError(f"candidate {i} is not a convex contiguous range; use arrange() or dp_arrange()")
    return curves


def greedy_arrange(options: Options, capacity: int) -> Arrangement:
    """Exact arrangement for convex ranges: everyone at ``lo``, spare units by largest marginal gain.

    O(R log n) for R spare units. Stops when no gain is ``> 0`` (fewest units among optima); equal gains go
    to the lower index. Same errors as :func:`dp_arrange`, plus ValueError for a non-convex candidate.
    """
    checked = _checked(options)
    _check_minimums(checked, capacity)
    curves = _convex_curves(checked)
    steps = _greedy_steps(curves, capacity - sum(lo for lo, _ in curves))
    units = [lo + s for (lo, _), s in zip(curves, steps, strict=True)]
    return _total(checked, units), units


def _greedy_steps(curves: Sequence[Curve], spare: int) -> list[int]:
    """Extra units per candidate handed out one at a time from a max-heap of marginal gains."""
    steps = [0] * len(curves)
    heap = [(c[1] - c[0], i) for i, (_, c) in enumerate(curves) if len(c) > 1 and c[0] - c[1] > 0]
    heapq.heapify(heap)  # (-gain, index): the largest gain first, then the lower index
    while spare > 0 and heap:
        _, i = heapq.heappop(heap)
        steps[i] += 1
        spare -= 1
        curve, s = curves[i][1], steps[i]
        if s + 1 < len(curve) and curve[s] - curve[s + 1] > 0:
            heapq.heappush(heap, (curve[s + 1] - curve[s], i))
    return steps


class GreedyTable:
    """The greedy of :func:`greedy_arrange` for every prefix, with ``best(t)`` in O(P) numpy work.

    Every positive marginal gain of every candidate (at most ``capacity`` per candidate) is sorted once by
    (gain descending, candidate, step). For prefix ``t`` the spare units go to the first gains that belong to
    candidates ``< t``: with convex curves that is exactly the heap greedy's choice. Up to ``SMALL_GAINS``
    gains the work is plain Python (numpy's per-call cost dominates there), beyond it numpy; both give the
    same owners in the same order.
    """

    __slots__ = ("_capacity", "_lo", "_lo_prefix", "_options", "_owners", "_sorted_owner")
    SMALL_GAINS: Final = 512

    def __init__(self, options: Options, capacity: int, *, _curves: Sequence[Curve] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"`capacity` must be >= 0, got {capacity}")
        self._options = _checked(options)
        self._capacity = capacity
        curves = _convex_curves(self._options) if _curves is None else _curves
        self._lo = [lo for lo, _ in curves]
        self._lo_prefix = [0, *accumulate(self._lo)]
        gains = sum(min(len(c), capacity + 1) - 1 for _, c in curves) if capacity >= 1 else 0
        self._owners: list[int] | None = None  # the small case
        self._sorted_owner = np.zeros(0, dtype=np.int64)
        if gains <= self.SMALL_GAINS:
            self._owners = _sorted_gain_owners_small(curves, capacity)
        else:
            self._sorted_owner = _sorted_gain_owners(curves, capacity)

    def __len__(self) -> int:
        return len(self._options)

    def feasible(self, t: int) -> bool:
        """Whether the minimums of the first ``t`` candidates fit in the capacity."""
        _check_prefix(t, len(self))
        return self._lo_prefix[t] <= self._capacity

    def best(self, t: int | None = None) -> Arrangement:
        """The optimum for the first ``t`` candidates (all if ``None``); :class:`Infeasible` if none fits."""
        t = len(self) if t is None else t
        _check_prefix(t, len(self))
        spare = self._capacity - self._lo_prefix[t]
        if spare < 0:
            raise Infeasible(
                f"the minimums of the first {t} candidates need {spare + self._capacity} units "
                f"but only {self._capacity} are free"
            )
        if self._owners is not None:
            extra = _first_owned(self._owners, t, spare)
        else:
            extra = self._extra_units(t, spare).tolist()
        units = [lo + e for lo, e in zip(self._lo[:t], extra, strict=True)]
        return _total(self._options[:t], units), units

    def _extra_units(self, t: int, spare: int) -> IntArray:
        """Extra units per candidate ``< t``: the first ``spare`` sorted gains they own.

        Scans the sorted owners in doubling blocks, so a prefix whose gains come early costs far less than P.
        """
        owners, extra = self._sorted_owner, np.zeros(t, dtype=np.int64)
        start, block = 0, max(1024, 2 * spare)
        while spare > 0 and start < owners.size:
            chunk = owners[start : start + block]
            picked = chunk[chunk < t][:spare]
            extra += np.bincount(picked, minlength=t)
            spare, start, block = spare - picked.size, start + block, block * 2
        return extra


def _first_owned(owners: list[int], t: int, spare: int) -> list[int]:
    """Per candidate ``< t``: how many of the first ``spare`` owners below ``t`` it is."""
    extra = [0] * t
    for o in owners:
        if spare <= 0:
            break
        if o < t:
            extra[o] += 1
            spare -= 1
    return extra


def _sorted_gain_owners_small(curves: Sequence[Curve], capacity: int) -> list[int]:
    """:func:`_sorted_gain_owners` in plain Python (the same float arithmetic, the same stable order)."""
    pool: list[tuple[float, int]] = []
    if capacity < 1:
        return []
    for i, (_, curve) in enumerate(curves):
        d = curve[: capacity + 1]
        for k in range(len(d) - 1):
            g = d[k] - d[k + 1]
            if g <= 0:
                break
            pool.append((-g, i))
    return [i for _, i in sorted(pool, key=lambda e: e[0])]


def _sorted_gain_owners(curves: Sequence[Curve], capacity: int) -> IntArray:
    """Owner (candidate index) of each leading positive gain, in (gain desc, owner, step) order."""
    gains: list[FloatArray] = []
    owners: list[IntArray] = []
    for i, (_, curve) in enumerate(curves):
        if len(curve) < 2 or capacity < 1:
            continue  # a single option has no gain
        d = np.array(curve[: capacity + 1])
        g = d[:-1] - d[1:]
        stop = np.flatnonzero(g <= 0)
        g = g[: int(stop[0])] if stop.size else g
        gains.append(g)
        owners.append(np.full(g.size, i, dtype=np.int64))
    if not gains:
        return np.zeros(0, dtype=np.int64)
    gain, owner = np.concatenate(gains), np.concatenate(owners)
    order = np.argsort(-gain, kind="stable")  # the pool is in (owner, step) order already
    return owner[order]


# --------------------------------------------------------------------------------------------- dispatch


def arrange(options: Options, capacity: int) -> Arrangement:
    """:func:`greedy_arrange` when every candidate is a convex range, :func:`dp_arrange` otherwise."""
    if _all_curves(options) is not None:
        return greedy_arrange(options, capacity)
    return dp_arrange(options, capacity)


def arrange_table(
    options: Options, capacity: int, curves: Sequence[Curve | None] | None = None
) -> PrefixTable:
    """A prefix table over plain units: :class:`GreedyTable` when every candidate is a convex range.
    ``curves``: each candidate's :func:`convex_curve`, when the caller has them already."""
    found = _all_curves(options) if curves is None else (None if None in curves else list(curves))
    if found is not None:
        return GreedyTable(options, capacity, _curves=found)
    return DPTable(options, PlainOperator(capacity))
