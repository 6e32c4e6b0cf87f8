"""GPU chunks: HiveD-style buddy cells of one node and the chunk-wise DP operator (paper Algorithm 4).

Contract:

1. A chunk is ``(start, end)`` with ``end - start = 2**a`` and ``start % 2**a == 0``. A node of ``num_gpus``
   GPUs starts as its maximal aligned power-of-two chunks (``8 -> (0, 8)``; ``6 -> (0, 4), (4, 6)``); buddies
   merge only inside one of these roots.
2. ``allocate(k)`` hands out one chunk of ``chunk_size(k)`` GPUs (the smallest power of two ``>= k``), cut
   from the smallest free chunk that can hold it; ``prefer`` picks among the equal candidates of that level.
   It raises :class:`NoChunk` and changes nothing when no chunk fits.
3. ``free(start)`` returns the chunk starting at ``start`` and merges free buddies upward; an unknown start
   (or a double free) raises :class:`UnknownChunk` and changes nothing.
4. Whether a multiset of requests fits depends only on the multiset of free chunk sizes, and the
   largest-first greedy decides it exactly (:func:`packable`); which equal chunk ``prefer`` takes does not
   change that.
5. :class:`ChunkOperator` snapshots an allocator: its states count the chunks of each size handed out so far
   and stay valid while the allocator is not changed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from math import prod
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tangram.core.dp import Arrangement, DPTable, Options

__all__ = [
    "Chunk",
    "ChunkAllocator",
    "ChunkError",
    "ChunkOperator",
    "FreeChunks",
    "NoChunk",
    "Prefer",
    "UnknownChunk",
    "chunk_size",
    "gpu_arrange",
    "packable",
    "root_chunks",
]

Chunk = tuple[int, int]
Prefer = Callable[[Chunk], bool] | Collection[int] | None
"""A predicate on candidate chunks, or the set of preferred start GPUs."""
IntArray = npt.NDArray[np.int64]


class ChunkError(ValueError):
    """Base of the chunk allocator's errors."""


class NoChunk(ChunkError):
    """No free chunk can hold the request (or the request is outside ``1..num_gpus``)."""


class UnknownChunk(ChunkError):
    """``free`` got a start that is not an allocated chunk (never allocated, or already freed)."""


def chunk_size(k: int) -> int:
    """The smallest power of two ``>= k`` (``k >= 1``)."""
    if k < 1:
        raise ValueError(f"`k` must be >= 1, got {k}")
    return 1 << (k - 1).bit_length()


def root_chunks(num_gpus: int) -> list[Chunk]:
    """The maximal aligned power-of-two chunks that tile ``[0, num_gpus)``, largest first."""
    if num_gpus < 1:
        raise ValueError(f"`num_gpus` must be >= 1, got {num_gpus}")
    roots, start = [], 0
    for bit in reversed(range(num_gpus.bit_length())):
        size = 1 << bit
        if num_gpus & size:
            roots.append((start, start + size))
            start += size
    return roots


def packable(free_sizes: Mapping[int, int], requests: Iterable[int]) -> bool:
    """Whether the requests (GPU counts, rounded up to chunks) fit at once into free chunks of these sizes.

    ``free_sizes`` maps a chunk size to how many free chunks of that size exist. Largest request first, each
    cut from the smallest free chunk that holds it: exact for power-of-two sizes (contract rule 4).
    """
    counts = {size: n for size, n in free_sizes.items() if n > 0}
    for need in sorted((chunk_size(k) for k in requests), reverse=True):
        level = min((size for size in counts if size >= need), default=0)
        if level == 0:
            return False
        _take(counts, level)
        while level > need:
            level //= 2
            counts[level] = counts.get(level, 0) + 1
    return True


def _take(counts: dict[int, int], size: int) -> None:
    """Remove one chunk of ``size`` from a count map, dropping empty entries."""
    counts[size] -= 1
    if counts[size] == 0:
        del counts[size]


class ChunkAllocator:
    """The buddy cells of one node: free chunks and handed-out chunks, both keyed by start GPU."""

    __slots__ = ("_free", "_num_gpus", "_root_of", "_used")

    def __init__(self, num_gpus: int) -> None:
        roots = root_chunks(num_gpus)
        self._num_gpus = num_gpus
        self._root_of = [0] * num_gpus  # size of the root chunk holding each GPU
        for start, end in roots:
            self._root_of[start:end] = [end - start] * (end - start)
        self._free: dict[int, int] = {start: end - start for start, end in roots}
        self._used: dict[int, int] = {}

    @property
    def num_gpus(self) -> int:
        """GPUs of the node."""
        return self._num_gpus

    @property
    def max_chunk(self) -> int:
        """The largest chunk the node can ever hand out."""
        return self._root_of[0]

    def clone(self) -> ChunkAllocator:
        """An independent copy for what-if planning."""
        twin = ChunkAllocator.__new__(ChunkAllocator)
        twin._num_gpus, twin._root_of = self._num_gpus, self._root_of
        twin._free, twin._used = dict(self._free), dict(self._used)
        return twin

    def free_chunks(self) -> list[Chunk]:
        """Free chunks, sorted."""
        return sorted((s, s + n) for s, n in self._free.items())

    def used_chunks(self) -> list[Chunk]:
        """Handed-out chunks, sorted."""
        return sorted((s, s + n) for s, n in self._used.items())

    def free_sizes(self) -> dict[int, int]:
        """How many free chunks of each size exist."""
        counts: dict[int, int] = {}
        for size in self._free.values():
            counts[size] = counts.get(size, 0) + 1
        return counts

    def free_gpus(self) -> int:
        """Free GPUs in total."""
        return sum(self._free.values())

    def can_allocate(self, sizes: Iterable[int]) -> bool:
        """Whether all these requests (GPU counts ``>= 1``) would fit at once; changes nothing."""
        return packable(self.free_sizes(), sizes)

    def allocate(self, k: int, prefer: Prefer = None) -> Chunk:
        """One chunk of ``chunk_size(k)`` GPUs per contract rule 2; :class:`NoChunk` if none fits."""
        need = self._need(k)
        level = min((size for size in self._free.values() if size >= need), default=0)
        if level == 0:
            raise NoChunk(f"no free chunk holds {need} GPUs (free: {self.free_chunks()})")
        target = _pick(self._candidates(level, need), prefer)
        self._split_to(target, level, need)
        self._used[target[0]] = need
        return target

    def allocate_many(self, ks: Sequence[int]) -> list[Chunk]:
        """Chunks for all requests (largest first), in request order; all or nothing (:class:`NoChunk`)."""
        for k in ks:
            self._need(k)
        if not self.can_allocate(ks):
            raise NoChunk(f"requests {list(ks)} do not fit together (free: {self.free_chunks()})")
        order = sorted(range(len(ks)), key=lambda i: (-chunk_size(ks[i]), i))
        out: list[Chunk] = [(0, 0)] * len(ks)
        for i in order:
            out[i] = self.allocate(ks[i])
        return out

    def free(self, start: int) -> Chunk:
        """Return the chunk starting at ``start`` and merge free buddies; :class:`UnknownChunk` if none."""
        size = self._used.pop(start, 0)
        if size == 0:
            raise UnknownChunk(f"no allocated chunk starts at GPU {start}")
        freed = (start, start + size)
        root = self._root_of[start]
        while size < root and self._free.get(start ^ size) == size:
            del self._free[start ^ size]
            start, size = min(start, start ^ size), size * 2
        self._free[start] = size
        return freed

    def _need(self, k: int) -> int:
        """The chunk size for ``k`` GPUs, or :class:`NoChunk` when the node can never hold it."""
        if not 1 <= k <= self._num_gpus or chunk_size(k) > self.max_chunk:
            raise NoChunk(f"`k` must be in 1..{self._num_gpus} and fit one chunk of this node, got {k}")
        return chunk_size(k)

    def _candidates(self, level: int, need: int) -> list[Chunk]:
        """Every aligned ``need``-sized chunk inside the free chunks of size ``level``, sorted."""
        parents = sorted(s for s, size in self._free.items() if size == level)
        return [(c, c + need) for p in parents for c in range(p, p + level, need)]

    def _split_to(self, target: Chunk, level: int, need: int) -> None:
        """Split the free ``level`` chunk holding ``target`` down to it, freeing the halves left over."""
        start = target[0] - target[0] % level
        del self._free[start]
        size = level
        while size > need:
            size //= 2
            if target[0] >= start + size:
                self._free[start] = size
                start += size
            else:
                self._free[start + size] = size


def _pick(candidates: Sequence[Chunk], prefer: Prefer) -> Chunk:
    """The first preferred candidate, else the first one."""
    if prefer is None:
        return candidates[0]
    if callable(prefer):
        return next((c for c in candidates if prefer(c)), candidates[0])
    return next((c for c in candidates if c[0] in prefer), candidates[0])


class FreeChunks(Protocol):
    """What :class:`ChunkOperator` reads: a :class:`ChunkAllocator` or any view of a node's free chunks."""

    @property
    def max_chunk(self) -> int: ...

    def free_sizes(self) -> Mapping[int, int]: ...


class ChunkOperator:
    """Algorithm 4: DP states are the counts of chunks of each size handed out so far, in mixed radix.

    The radix of size ``s`` is ``c_s + 1`` where ``c_s`` is how many ``s``-chunks the free chunks could yield
    at most. ``prev(state, k)`` takes back one chunk of ``chunk_size(k)`` (``k = 0``: no chunk), ``-1`` when
    that size has no chunk in ``state``. ``valid(state)`` says the multiset is packable into the free chunks
    of the allocator as it was when the operator was built.
    """

    __slots__ = ("_digits", "_radix", "_sizes", "_stride", "_valid")

    def __init__(self, allocator: FreeChunks) -> None:
        free = dict(allocator.free_sizes())
        self._sizes = [1 << b for b in range(allocator.max_chunk.bit_length())]
        self._radix = [1 + sum(n * (f // s) for f, n in free.items()) for s in self._sizes]
        self._stride = [prod(self._radix[:i]) for i in range(len(self._sizes))]
        states = np.arange(prod(self._radix), dtype=np.int64)
        self._digits = np.stack(
            [(states // st) % r for st, r in zip(self._stride, self._radix, strict=True)], axis=1
        )
        self._valid = [packable(free, self._requests(row)) for row in self._digits.tolist()]

    def _requests(self, digits: Sequence[int]) -> list[int]:
        """The chunk sizes a state hands out, one entry per chunk."""
        return [s for s, n in zip(self._sizes, digits, strict=True) for _ in range(n)]

    @property
    def num_states(self) -> int:
        """Product of the radices."""
        return len(self._valid)

    @property
    def start(self) -> int:
        """No chunk handed out."""
        return 0

    def counts(self, state: int) -> dict[int, int]:
        """Chunks per size in ``state``."""
        return dict(zip(self._sizes, (int(d) for d in self._digits[state]), strict=True))

    def prev(self, state: int, units: int) -> int:
        """``state`` less one chunk of ``chunk_size(units)``; ``state`` itself for 0; ``-1`` if invalid."""
        if not 0 <= state < self.num_states or units < 0:
            return -1
        if units == 0:
            return state
        idx = chunk_size(units).bit_length() - 1
        if idx >= len(self._sizes) or self._digits[state, idx] == 0:
            return -1
        return state - self._stride[idx]

    def valid(self, state: int) -> bool:
        """The state's chunks fit together into the allocator's free chunks."""
        return 0 <= state < self.num_states and self._valid[state]

    def units_of(self, state: int) -> int:
        """GPUs handed out in ``state``."""
        return sum(s * int(d) for s, d in zip(self._sizes, self._digits[state], strict=True))

    def prev_matrix(self, units: Sequence[int]) -> IntArray:
        """``prev`` for every (unit count, state) pair."""
        rows = [self._prev_row(u) for u in units]
        return np.array(rows, dtype=np.int64).reshape(len(units), self.num_states)

    def _prev_row(self, units: int) -> IntArray:
        """``prev(s, units)`` for every state ``s``."""
        states = np.arange(self.num_states, dtype=np.int64)
        if units <= 0:
            return states if units == 0 else np.full_like(states, -1)
        idx = chunk_size(units).bit_length() - 1
        if idx >= len(self._sizes):
            return np.full_like(states, -1)
        return np.where(self._digits[:, idx] > 0, states - self._stride[idx], -1)


def gpu_arrange(options: Options, allocator: FreeChunks) -> Arrangement:
    """The optimum chunk per GPU task over every packable multiset, like ``dp_arrange`` for plain units.

    ``options[i]`` maps GPU counts (rounded up to chunks) to durations. Raises ``Infeasible`` when even the
    smallest options do not fit the allocator's free chunks together.
    """
    if not options:
        return 0.0, []
    return DPTable(options, ChunkOperator(allocator)).best()
