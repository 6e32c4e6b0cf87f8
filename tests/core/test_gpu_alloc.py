"""Buddy GPU chunks and the chunk-wise DP operator (Algorithm 4), checked against brute-force placement;
the scheduler's busy-mask view of a node (``GpuNode.free_chunks``) against the buddy model."""

from __future__ import annotations

from itertools import product

import pytest
from buddy_model import ChunkAllocator, NoChunk, UnknownChunk
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.core.dp import Arrangement, DPTable, Infeasible, Options, scalar_prev_matrix
from tangram.core.gpu import Chunk, ChunkOperator, FreeChunks, chunk_size, packable, root_chunks
from tangram.core.managers.gpu import GpuNode

FAST = settings(max_examples=150, deadline=None)
NODE_SIZES = [1, 2, 4, 8, 3, 5, 6, 7, 12]


def gpu_arrange(options: Options, allocator: FreeChunks) -> Arrangement:
    """The optimum chunk per GPU task over every packable multiset (the chunk-wise DP of one node, as the
    GPU pass runs it); ``Infeasible`` when even the smallest options do not fit together."""
    if not options:
        return 0.0, []
    return DPTable(options, ChunkOperator(allocator)).best()


def rounded(k: int) -> int:
    """Chunk GPUs of a request; 0 stays 0 (no chunk)."""
    return chunk_size(k) if k else 0


def free_gpus(alloc: ChunkAllocator) -> set[int]:
    return {g for s, e in alloc.free_chunks() for g in range(s, e)}


def fits_brute(n: int, free: set[int], ks: list[int]) -> bool:
    """Whether aligned power-of-two blocks for every request can be placed on free GPUs without overlap."""
    sizes = sorted((chunk_size(k) for k in ks), reverse=True)

    def place(i: int, avail: frozenset[int], first: int) -> bool:
        if i == len(sizes):
            return True
        s = sizes[i]
        for start in range(first, n, s):
            block = frozenset(range(start, start + s))
            nxt = start + s if i + 1 < len(sizes) and sizes[i + 1] == s else 0  # equal blocks in order
            if block <= avail and place(i + 1, avail - block, nxt):
                return True
        return False

    return sum(sizes) <= len(free) and place(0, frozenset(free), 0)


def check_invariants(alloc: ChunkAllocator, n: int) -> None:
    """Aligned, disjoint, tiling [0, n), inside one root each, and no two free buddies left unmerged."""
    roots = root_chunks(n)
    chunks = alloc.free_chunks() + alloc.used_chunks()
    covered = sorted(g for s, e in chunks for g in range(s, e))
    assert covered == list(range(n))
    for s, e in chunks:
        size = e - s
        assert size & (size - 1) == 0
        assert s % size == 0
        assert any(rs <= s and e <= re for rs, re in roots)
    free = dict(alloc.free_chunks())
    for s, e in free.items():
        size = e - s
        buddy = s ^ size
        merged = (min(s, buddy), min(s, buddy) + 2 * size)
        inside = any(rs <= merged[0] and merged[1] <= re for rs, re in roots)
        assert not (inside and free.get(buddy) == buddy + size), f"free buddies {s} and {buddy} not merged"


ops_st = st.lists(st.tuples(st.sampled_from("af"), st.integers(0, 63)), max_size=30)


def build(n: int, ops: list[tuple[str, int]]) -> tuple[ChunkAllocator, list[Chunk]]:
    """Apply allocate/free operations, checking each step; returns the allocator and the held chunks."""
    alloc, held = ChunkAllocator(n), []
    for kind, x in ops:
        if kind == "a":
            k = 1 + x % n
            need = chunk_size(k)
            before_free, before_used = alloc.free_chunks(), alloc.used_chunks()
            if fits_brute(n, free_gpus(alloc), [k]):
                level = min(e - s for s, e in before_free if e - s >= need)
                got = alloc.allocate(k)
                assert got[1] - got[0] == need
                assert got[0] % need == 0
                parent = next(c for c in before_free if c[0] <= got[0] and got[1] <= c[1])
                assert parent[1] - parent[0] == level  # cut from the smallest chunk that holds it
                held.append(got)
            else:
                with pytest.raises(NoChunk):
                    alloc.allocate(k)
                assert (alloc.free_chunks(), alloc.used_chunks()) == (before_free, before_used)
        elif held:
            chunk = held.pop(x % len(held))
            assert alloc.free(chunk[0]) == chunk
        check_invariants(alloc, n)
    return alloc, held


@FAST
@given(st.sampled_from(NODE_SIZES), ops_st)
def test_random_allocate_free_keeps_invariants_and_merges_back(n: int, ops: list[tuple[str, int]]) -> None:
    alloc, held = build(n, ops)
    used = alloc.used_chunks()
    assert sorted(held) == used
    for s, e in used:
        for t, f in used:
            assert (s, e) == (t, f) or e <= t or f <= s
    for chunk in held:
        alloc.free(chunk[0])
        check_invariants(alloc, n)
    assert alloc.free_chunks() == root_chunks(n)
    assert alloc.used_chunks() == []


def test_roots_and_sizes() -> None:
    assert root_chunks(8) == [(0, 8)]
    assert root_chunks(6) == [(0, 4), (4, 6)]
    assert root_chunks(7) == [(0, 4), (4, 6), (6, 7)]
    assert root_chunks(12) == [(0, 8), (8, 12)]
    assert [chunk_size(k) for k in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    with pytest.raises(ValueError, match="`k` must be >= 1"):
        chunk_size(0)
    with pytest.raises(ValueError, match="`num_gpus` must be >= 1"):
        root_chunks(0)


def test_buddy_split_and_merge() -> None:
    a = ChunkAllocator(8)
    assert a.allocate(1) == (0, 1)
    assert a.free_chunks() == [(1, 2), (2, 4), (4, 8)]
    assert a.allocate(2) == (2, 4)  # the free 2-chunk, not a split of (4, 8)
    assert a.allocate(3) == (4, 8)
    assert a.free_chunks() == [(1, 2)]
    a.free(2)
    a.free(0)
    assert a.free_chunks() == [(0, 4)]
    a.free(4)
    assert a.free_chunks() == [(0, 8)]


def test_errors_change_nothing() -> None:
    a = ChunkAllocator(6)
    for k in (0, -1, 7, 5):  # 5 needs an 8-chunk, which a 6-GPU node never has
        with pytest.raises(NoChunk, match=r"`k` must be in 1\.\.6"):
            a.allocate(k)
    a.allocate(4)
    with pytest.raises(NoChunk, match="no free chunk holds 4 GPUs"):
        a.allocate(3)
    with pytest.raises(UnknownChunk, match="no allocated chunk starts at GPU 4"):
        a.free(4)
    a.free(0)
    with pytest.raises(UnknownChunk):
        a.free(0)  # double free
    assert a.free_chunks() == [(0, 4), (4, 6)]


@st.composite
def state_and_request(draw: st.DrawFn) -> tuple[ChunkAllocator, int]:
    n = draw(st.sampled_from(NODE_SIZES))
    alloc, _ = build(n, draw(ops_st))
    return alloc, draw(st.integers(1, n))


@FAST
@given(state_and_request(), st.data())
def test_prefer_is_honoured_among_equal_chunks(case: tuple[ChunkAllocator, int], data: st.DataObject) -> None:
    alloc, k = case
    need = chunk_size(k)
    levels = [e - s for s, e in alloc.free_chunks() if e - s >= need]
    if not levels or need > alloc.max_chunk:
        return
    level = min(levels)
    cands = [(c, c + need) for s, e in alloc.free_chunks() if e - s == level for c in range(s, e, need)]
    want = data.draw(st.sampled_from(cands))
    assert alloc.clone().allocate(k, prefer=lambda c: c == want) == want
    assert alloc.clone().allocate(k, prefer={want[0]}) == want
    assert alloc.clone().allocate(k, prefer=set()) == cands[0]  # no match: the lowest candidate
    assert alloc.clone().allocate(k) == cands[0]


def test_prefer_never_beats_a_smaller_level() -> None:
    a = ChunkAllocator(8)
    a.allocate(1)  # free: (1,2) (2,4) (4,8)
    assert a.clone().allocate(2, prefer={4, 6}) == (2, 4)
    assert a.clone().allocate(1, prefer=lambda c: c == (5, 6)) == (1, 2)
    b = ChunkAllocator(8)
    assert b.allocate(2, prefer={6}) == (6, 8)
    assert b.free_chunks() == [(0, 4), (4, 6)]


@FAST
@given(st.sampled_from(NODE_SIZES), ops_st, st.lists(st.integers(1, 12), max_size=6))
def test_can_allocate_equals_brute_force(n: int, ops: list[tuple[str, int]], ks: list[int]) -> None:
    alloc, _ = build(n, ops)
    ks = [1 + (k - 1) % n for k in ks]
    expect = fits_brute(n, free_gpus(alloc), ks)
    before, used = alloc.free_chunks(), alloc.used_chunks()
    assert alloc.can_allocate(ks) is expect
    assert packable(alloc.free_sizes(), ks) is expect
    assert alloc.free_chunks() == before
    if not all(chunk_size(k) <= alloc.max_chunk for k in ks):
        return
    if expect:
        got = alloc.allocate_many(ks)
        assert [e - s for s, e in got] == [chunk_size(k) for k in ks]
        check_invariants(alloc, n)
        assert sorted(got) == sorted(set(alloc.used_chunks()) - set(used))
    else:
        with pytest.raises(NoChunk, match="do not fit together"):
            alloc.allocate_many(ks)
        assert (alloc.free_chunks(), alloc.used_chunks()) == (before, used)


def test_clone_is_independent() -> None:
    a = ChunkAllocator(8)
    a.allocate(2)
    b = a.clone()
    b.allocate(4)
    b.free(0)
    assert a.free_chunks() == [(2, 4), (4, 8)]
    assert a.used_chunks() == [(0, 2)]
    assert b.free_chunks() == [(0, 4)]


# --------------------------------------------------------------------------------------------- operator


@FAST
@given(state_and_request())
def test_chunk_operator_states(case: tuple[ChunkAllocator, int]) -> None:
    alloc, _ = case
    op = ChunkOperator(alloc)
    n, free = alloc.num_gpus, free_gpus(alloc)
    assert op.valid(op.start)
    assert op.units_of(op.start) == 0
    for state in range(op.num_states):
        counts = op.counts(state)
        ks = [s for s, c in counts.items() for _ in range(c)]
        assert op.units_of(state) == sum(ks)
        assert op.valid(state) is fits_brute(n, free, ks)
        for k in (0, 1, 2, 3, 4, 5, 8, 16):
            before = op.prev(state, k)
            size = rounded(k)
            if k == 0:
                assert before == state
            elif counts.get(size, 0) == 0:
                assert before == -1
            else:
                assert op.counts(before) == {**counts, size: counts[size] - 1}
    units = [0, 1, 2, 3, 4, 8, 16, -1]
    assert (op.prev_matrix(units) == scalar_prev_matrix(op, units)).all()
    assert not op.valid(op.num_states)
    assert op.prev(op.num_states, 1) == -1


def test_chunk_operator_radices_follow_free_chunks() -> None:
    a = ChunkAllocator(8)
    a.allocate(1)  # free: 1 + 2 + 4
    op = ChunkOperator(a)
    assert op.num_states == (7 + 1) * (3 + 1) * (1 + 1) * (0 + 1)
    assert not op.valid(op.num_states - 1)  # 7 one-GPU chunks + 3 twos + 1 four: too many
    assert gpu_arrange([{4: 1.0}, {2: 1.0}, {1: 1.0}], a) == (3.0, [4, 2, 1])
    with pytest.raises(Infeasible):
        gpu_arrange([{4: 1.0}, {4: 1.0}], a)


gpu_option = st.builds(
    lambda ks, ds: {k: float(d) for k, d in zip(sorted(ks), ds, strict=False)},
    st.sets(st.sampled_from([0, 1, 2, 3, 4, 8]), min_size=1, max_size=4),
    st.lists(st.integers(0, 12), min_size=4, max_size=4),
)


def brute_gpu(n: int, free: set[int], options: list[dict[int, float]]) -> tuple[float, int] | None:
    """(min total, fewest chunk GPUs among the optima) over packable choices, or None."""
    best: tuple[float, int] | None = None
    for combo in product(*[sorted(o) for o in options]):
        ks = [k for k in combo if k]
        if any(chunk_size(k) > n for k in ks) or not fits_brute(n, free, ks):
            continue
        total = 0.0
        for opt, u in zip(options, combo, strict=True):
            total += opt[u]
        key = (total, sum(rounded(k) for k in combo))
        best = key if best is None or key < best else best
    return best


@FAST
@given(st.sampled_from([1, 2, 4, 8, 6]), ops_st, st.lists(gpu_option, max_size=4))
def test_gpu_arrange_equals_brute_force(
    n: int, ops: list[tuple[str, int]], options: list[dict[int, float]]
) -> None:
    alloc, _ = build(n, ops)
    expect = brute_gpu(n, free_gpus(alloc), options)
    if expect is None:
        with pytest.raises(Infeasible):
            gpu_arrange(options, alloc)
        return
    total, units = gpu_arrange(options, alloc)
    assert (total, sum(rounded(u) for u in units)) == expect
    assert all(u in o for u, o in zip(units, options, strict=True))
    assert alloc.can_allocate([u for u in units if u])
    table = DPTable(options, ChunkOperator(alloc))
    for t in range(len(options) + 1):
        if table.feasible(t):
            assert table.best(t) == gpu_arrange(options[:t], alloc)


def test_gpu_arrange_leaves_gpus_idle_when_bigger_chunks_do_not_help() -> None:
    a = ChunkAllocator(8)
    assert gpu_arrange([{1: 2.0, 2: 2.0, 4: 2.0}], a) == (2.0, [1])
    assert gpu_arrange([{1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0}, {1: 8.0, 2: 4.0, 4: 2.0}], a) == (4.0, [4, 4])
    assert gpu_arrange([], a) == (0.0, [])


@FAST
@given(st.sampled_from(NODE_SIZES), ops_st)
def test_a_gpu_nodes_free_view_is_the_buddy_models_free_chunks(n: int, ops: list[tuple[str, int]]) -> None:
    alloc, held = build(n, ops)
    node = GpuNode("g", n, 80_000)
    for start, end in held:  # the same chunks busy on the scheduler's node
        node.busy |= node.chunk_mask(start, end - start)
    view = node.free_chunks()
    assert view.free_sizes() == alloc.free_sizes()
    assert view.max_chunk == alloc.max_chunk
    assert ChunkOperator(view).num_states == ChunkOperator(alloc).num_states
