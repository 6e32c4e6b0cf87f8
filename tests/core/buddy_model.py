"""A reference buddy allocator for the tests: free chunks and handed-out chunks of one node,
keyed by start GPU, split from the smallest free chunk that holds a request and merged back
with free buddies (rules 1 and 4 of ``tangram/core/gpu.py``).

The scheduler keeps a node's chunks as busy masks (``GpuNode``, ``managers/gpu.py``), whose
free blocks are always the fully merged ones; this model is what those masks, the
``packable`` check and the chunk-wise operator are checked against.

1. ``allocate(k)`` hands out one chunk of ``chunk_size(k)`` GPUs, cut from the smallest free
   chunk that can hold it; ``prefer`` picks among the equal candidates of that level. It
   raises ``NoChunk`` and changes nothing when no chunk fits.
2. ``free(start)`` returns the chunk starting at ``start`` and merges free buddies upward; an
   unknown start (or a double free) raises ``UnknownChunk`` and changes nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from tangram.core.gpu import Chunk, chunk_size, packable, root_chunks

Prefer = Callable[[Chunk], bool] | Collection[int] | None
"""A predicate on candidate chunks, or the set of preferred start GPUs."""


class ChunkError(ValueError):
    """Base of the chunk allocator's errors."""


class NoChunk(ChunkError):
    """No free chunk can hold the request (or the request is outside ``1..num_gpus``)."""


class UnknownChunk(ChunkError):
    """``free`` got a start that is not an allocated chunk (never allocated, or already freed)."""




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
