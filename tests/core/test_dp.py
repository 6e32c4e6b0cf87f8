"""DPArrange (Algorithm 3): brute-force equivalence, prefix tables, the convex greedy path and dispatch."""

from __future__ import annotations

import math
from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.core.dp import (
    DPTable,
    GreedyTable,
    Infeasible,
    PlainOperator,
    arrange,
    arrange_table,
    dp_arrange,
    greedy_arrange,
    is_convex_range,
    scalar_prev_matrix,
)

Opts = list[dict[int, float]]
FAST = settings(max_examples=200, deadline=None)


def brute(options: Opts, capacity: int) -> tuple[float, int] | None:
    """(min total, fewest units among the optima) over every allocation within capacity, or None."""
    best: tuple[float, int] | None = None
    for combo in product(*[sorted(o) for o in options]):
        if sum(combo) > capacity:
            continue
        total = 0.0
        for opt, u in zip(options, combo, strict=True):
            total += opt[u]
        key = (total, sum(combo))
        best = key if best is None or key < best else best
    return best


def assert_arrangement(options: Opts, capacity: int, total: float, units: list[int]) -> None:
    """units is one option per task, fits, and sums to total."""
    assert len(units) == len(options)
    assert all(u in opt for u, opt in zip(units, options, strict=True))
    assert sum(units) <= capacity
    assert math.isclose(total, sum(opt[u] for opt, u in zip(options, units, strict=True)), abs_tol=1e-9)


unit_sets = st.one_of(
    st.sets(st.integers(0, 8), min_size=1, max_size=5),
    st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1),
    st.integers(0, 4).flatmap(lambda lo: st.integers(lo, lo + 5).map(lambda hi: set(range(lo, hi + 1)))),
)


@st.composite
def option(draw: st.DrawFn) -> dict[int, float]:
    """Integer-valued durations, so ties are exact and the fewer-units rule is observable."""
    return {u: float(draw(st.integers(0, 20))) for u in sorted(draw(unit_sets))}


options_st = st.lists(option(), max_size=5)


@FAST
@given(options_st, st.integers(0, 12))
def test_dp_arrange_equals_brute_force(options: Opts, capacity: int) -> None:
    expect = brute(options, capacity)
    if expect is None:
        with pytest.raises(Infeasible):
            dp_arrange(options, capacity)
        return
    total, units = dp_arrange(options, capacity)
    assert_arrangement(options, capacity, total, units)
    assert (total, sum(units)) == expect


@FAST
@given(options_st, st.integers(0, 12))
def test_infeasible_exactly_when_minimums_do_not_fit(options: Opts, capacity: int) -> None:
    fits = sum(min(o) for o in options) <= capacity
    if fits:
        dp_arrange(options, capacity)
    else:
        with pytest.raises(Infeasible, match="minimums need"):
            dp_arrange(options, capacity)


@FAST
@given(options_st, st.integers(0, 12))
def test_table_prefixes_equal_dp_arrange_on_each_prefix(options: Opts, capacity: int) -> None:
    table = DPTable(options, PlainOperator(capacity))
    assert len(table) == len(options)
    for t in range(len(options) + 1):
        fits = sum(min(o) for o in options[:t]) <= capacity
        assert table.feasible(t) == fits
        if fits:
            assert table.best(t) == dp_arrange(options[:t], capacity)
        else:
            with pytest.raises(Infeasible):
                table.best(t)


def test_edge_cases() -> None:
    assert dp_arrange([], 0) == (0.0, [])
    assert arrange([], 3) == (0.0, [])
    assert DPTable([], PlainOperator(4)).best() == (0.0, [])
    with pytest.raises(Infeasible, match="no feasible unit count"):
        dp_arrange([{1: 1.0}, {}], 4)
    with pytest.raises(Infeasible, match="negative unit count"):
        dp_arrange([{-1: 1.0}], 4)
    with pytest.raises(ValueError, match="non-finite duration"):
        dp_arrange([{1: math.nan}], 4)
    with pytest.raises(ValueError, match="`capacity` must be >= 0"):
        dp_arrange([{1: 1.0}], -1)
    with pytest.raises(ValueError, match=r"`t` must be in 0\.\.1"):
        DPTable([{1: 1.0}], PlainOperator(2)).best(2)


def test_units_stay_idle_when_more_do_not_help() -> None:
    # the best is at j = 1 < capacity; Algorithm 3 as printed would return dp[n][R] = 4.0
    assert dp_arrange([{1: 3.0, 2: 3.0, 3: 4.0}], 3) == (3.0, [1])
    assert dp_arrange([{1: 5.0, 2: 5.0}, {0: 1.0, 2: 1.0}], 4) == (6.0, [1, 0])


def test_options_above_capacity_are_ignored() -> None:
    assert dp_arrange([{1: 9.0, 16: 1.0}], 8) == (9.0, [1])


# --------------------------------------------------------------------------------------------- operators


@given(st.integers(0, 10), st.lists(st.integers(-2, 12), min_size=1, max_size=6))
def test_plain_prev_matrix_matches_scalar_prev(capacity: int, units: list[int]) -> None:
    op = PlainOperator(capacity)
    assert (op.prev_matrix(units) == scalar_prev_matrix(op, units)).all()
    assert op.prev(capacity + 1, 1) == -1
    assert not op.valid(capacity + 1)


# --------------------------------------------------------------------------------------------- greedy


@st.composite
def amdahl(draw: st.DrawFn) -> dict[int, float]:
    """T(m) = T1 / (m E(m)) with Amdahl efficiency, plus an optional convex per-unit overhead."""
    t1 = draw(st.floats(1.0, 100.0))
    serial = draw(st.sampled_from([0.0, 1.0, draw(st.floats(0.0, 1.0))]))
    overhead = draw(st.sampled_from([0.0, draw(st.floats(0.0, 2.0))]))
    lo = draw(st.integers(1, 4))
    hi = draw(st.integers(lo, lo + 8))
    return {m: t1 * (serial + (1.0 - serial) / m) + overhead * m for m in range(lo, hi + 1)}


@FAST
@given(st.lists(amdahl(), max_size=6), st.integers(0, 24))
def test_greedy_equals_dp_on_convex_ranges(options: Opts, capacity: int) -> None:
    assert all(is_convex_range(o) for o in options)
    if sum(min(o) for o in options) > capacity:
        with pytest.raises(Infeasible):
            greedy_arrange(options, capacity)
        return
    total, units = greedy_arrange(options, capacity)
    assert_arrangement(options, capacity, total, units)
    assert math.isclose(total, dp_arrange(options, capacity)[0], rel_tol=1e-9)
    assert arrange(options, capacity) == (total, units)


@FAST
@given(st.lists(amdahl(), max_size=6), st.integers(0, 24))
def test_greedy_table_prefixes_equal_dp_table(options: Opts, capacity: int) -> None:
    greedy, dp = GreedyTable(options, capacity), DPTable(options, PlainOperator(capacity))
    for t in range(len(options) + 1):
        assert greedy.feasible(t) == dp.feasible(t)
        if not dp.feasible(t):
            with pytest.raises(Infeasible):
                greedy.best(t)
            continue
        total, units = greedy.best(t)
        assert_arrangement(options[:t], capacity, total, units)
        assert math.isclose(total, dp.best(t)[0], rel_tol=1e-9)
        assert math.isclose(total, greedy_arrange(options[:t], capacity)[0], rel_tol=1e-12)


@FAST
@given(st.lists(option(), max_size=5), st.integers(0, 12))
def test_greedy_table_matches_heap_greedy_with_exact_ties(options: Opts, capacity: int) -> None:
    convex = [o for o in options if is_convex_range(o)]
    table = GreedyTable(convex, capacity)
    for t in range(len(convex) + 1):
        if table.feasible(t):
            assert table.best(t) == greedy_arrange(convex[:t], capacity)
            assert table.best(t) == dp_arrange(convex[:t], capacity)


def test_greedy_prefers_lower_index_and_fewer_units() -> None:
    same = {1: 4.0, 2: 2.0, 3: 1.0}
    assert greedy_arrange([same, same], 3) == (6.0, [2, 1])
    assert GreedyTable([same, same], 3).best() == (6.0, [2, 1])
    flat = {1: 2.0, 2: 2.0, 3: 2.0}
    assert greedy_arrange([flat], 3) == (2.0, [1])


@pytest.mark.parametrize(
    ("opt", "convex"),
    [
        ({}, False),
        ({3: 1.0}, True),
        ({1: 3.0, 2: 2.0, 3: 1.5}, True),
        ({1: 3.0, 2: 2.0, 3: 2.5}, True),  # convex, not monotone
        ({1: 1.0, 3: 1.0}, False),  # a gap
        ({1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0}, False),  # discrete set
        ({1: 10.0, 2: 9.0, 3: 1.0}, False),  # concave
        ({-1: 1.0, 0: 1.0}, False),
        ({1: 1.0, 2: math.inf}, False),
    ],
)
def test_is_convex_range(opt: dict[int, float], convex: bool) -> None:
    assert is_convex_range(opt) is convex


def test_dispatcher_uses_dp_when_greedy_is_not_exact() -> None:
    concave = {1: 10.0, 2: 9.0, 3: 1.0}
    # the greedy would stop after one unit of gain 1; the optimum takes the big step to 3 units
    assert arrange([concave], 3) == dp_arrange([concave], 3) == (1.0, [3])
    with pytest.raises(ValueError, match="not a convex contiguous range"):
        greedy_arrange([concave], 3)
    assert isinstance(arrange_table([concave, {1: 2.0, 2: 1.0}], 3), DPTable)
    assert isinstance(arrange_table([{1: 2.0, 2: 1.0}], 3), GreedyTable)
    discrete = {1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0}
    assert arrange([discrete], 7) == (2.0, [4])


@FAST
@given(options_st, st.integers(0, 12))
def test_dispatcher_equals_dp(options: Opts, capacity: int) -> None:
    if brute(options, capacity) is None:
        with pytest.raises(Infeasible):
            arrange(options, capacity)
        return
    total, units = arrange(options, capacity)
    assert_arrangement(options, capacity, total, units)
    assert total == dp_arrange(options, capacity)[0]
    table = arrange_table(options, capacity)
    assert table.best()[0] == total


def test_large_prefix_table_stays_consistent() -> None:
    rng = np.random.default_rng(7)
    options = []
    for _ in range(40):
        t1, serial = float(rng.uniform(1, 50)), float(rng.uniform(0, 0.5))
        options.append({m: t1 * (serial + (1 - serial) / m) for m in range(1, 33)})
    greedy, dp = GreedyTable(options, 64), DPTable(options, PlainOperator(64))
    for t in range(len(options) + 1):
        assert greedy.feasible(t) == dp.feasible(t)
        if dp.feasible(t):
            assert math.isclose(greedy.best(t)[0], dp.best(t)[0], rel_tol=1e-9)
