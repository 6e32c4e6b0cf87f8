"""GPU chunks: HiveD-style buddy cells of one node and the chunk-wise DP operator (paper Algorithm 4).

Contract:

1. A chunk is ``(start, end)`` with ``end - start = 2**a`` and ``start % 2**a == 0``. A node of ``num_gpus``
   GPUs starts as its maximal aligned power-of-two chunks (``8 -> (0, 8)``; ``6 -> (0, 4), (4, 6)``); buddies
   merge only inside one of these roots. A node's chunks themselves (busy masks, the free blocks, which chunk
   a call gets) are kept in one place, ``managers/gpu.py`` (``GpuNode``); this module holds what does not
   depend on a node's state.
2. Whether a multiset of requests fits depends only on the multiset of free chunk sizes, and the
   largest-first greedy decides it exactly (:func:`packable`).
3. :class:`ChunkOperator` snapshots a node's free chunks (any :class:`FreeChunks`, such as
   ``GpuNode.free_chunks()``): its states count the chunks of each size handed out so far and stay valid
   while the node is not changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from math import prod
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "Chunk",
    "ChunkOperator",
    "FreeChunks",
    "chunk_size",
    "packable",
    "root_chunks",
]

Chunk = tuple[int, int]
IntArray = npt.NDArray[np.int64]


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


class FreeChunks(Protocol):
    """What :class:`ChunkOperator` reads: a view of a node's free chunks (``GpuNode.free_chunks()``)."""

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

