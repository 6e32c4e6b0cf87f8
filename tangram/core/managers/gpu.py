"""GPU manager: evict-on-execution over buddy chunks of 1/2/4/8 GPUs (docs/scheduler.md, docs/gpu.md).

Contract:
1. A chunk ``[start, start + size)`` has a power-of-two size and ``start % size == 0``
   (HiveD-style cells); choosing the chunk inside the smallest free aligned block is buddy
   allocation with merging for free, since freeness is read from the per-GPU busy mask.
2. At most one action runs on a GPU at a time.
3. A service instance is (service, start, size): each chunk size (DoP) of a service is a
   service of its own. An instance is resident until evicted; per-GPU resident memory never
   exceeds the GPU's capacity; eviction takes least-recently-used instances first and never
   one in use.
4. Among equal chunks, one that already holds the service wins; then (when the caller names
   the instances waiting calls want) the one whose restore evicts the fewest of those; then
   the smallest enclosing free block; then the fewest evictions; then the lowest start.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from tangram.core.gpu import chunk_size, root_chunks

__all__ = ["SIZES", "FreeView", "GpuManager", "GpuNode", "Instance", "Placement", "ServiceInfo", "chunk_size"]

SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ServiceInfo:
    name: str
    gpu_mem_mib: int
    chunk_sizes: tuple[int, ...]
    load_s: float
    t_ori: float | None
    per_size: tuple[tuple[int, int, float], ...] = ()  # (size, gpu_mem_mib, load_s) overrides

    def mem(self, size: int) -> int:
        """Memory per GPU of an instance on ``size`` GPUs."""
        return self._on(size)[1]

    def load(self, size: int) -> float:
        """Restore time of an instance on ``size`` GPUs."""
        return self._on(size)[2]

    def _on(self, size: int) -> tuple[int, int, float]:
        """(size, memory per GPU, restore time): the override for ``size`` or the defaults."""
        return next((o for o in self.per_size if o[0] == size), (size, self.gpu_mem_mib, self.load_s))


Instance = tuple[str, int, int]  # (service, start, size)


@dataclass
class Placement:
    node: str
    start: int
    size: int
    evict: tuple[Instance, ...]
    resident: bool


@dataclass
class GpuNode:
    name: str
    count: int
    mem_mib: int  # per GPU
    busy: int = 0  # bitmask of GPUs running an action
    used_mem: list[int] = field(default_factory=list)
    resident: dict[Instance, float] = field(default_factory=dict)  # -> last use (LRU key)
    in_use: dict[Instance, int] = field(default_factory=dict)
    resident_mem: dict[Instance, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.used_mem:
            self.used_mem = [0] * self.count

    @staticmethod
    def chunk_mask(start: int, size: int) -> int:
        return ((1 << size) - 1) << start

    def is_free(self, start: int, size: int, busy: int | None = None) -> bool:
        b = self.busy if busy is None else busy
        return not (b & self.chunk_mask(start, size))

    def enclosing_free_block(self, start: int, size: int, busy: int) -> int:
        """Size of the largest aligned all-free block containing the chunk."""
        best = size
        s = size * 2
        while s <= self.count:
            base = (start // s) * s
            if busy & self.chunk_mask(base, s):
                break
            best = s
            s *= 2
        return best

    def evictions_for(self, svc: ServiceInfo, start: int, size: int) -> tuple[Instance, ...] | None:
        """LRU instances to drop so ``svc`` fits on ``[start, start+size)``; None if impossible."""
        gpus = range(start, start + size)
        need = {g: self.used_mem[g] + svc.mem(size) - self.mem_mib for g in gpus}
        if all(v <= 0 for v in need.values()):
            return ()
        victims: list[Instance] = []
        for inst, _ in sorted(self.resident.items(), key=lambda kv: (kv[1], kv[0])):
            if inst in self.in_use:
                continue
            _, s, z = inst
            overlap = [g for g in range(s, s + z) if g in need and need[g] > 0]
            if not overlap:
                continue
            victims.append(inst)
            mem = self._mem_of(inst)
            for g in range(s, s + z):
                if g in need:
                    need[g] -= mem
            if all(v <= 0 for v in need.values()):
                return tuple(victims)
        return None

    def _mem_of(self, inst: Instance) -> int:
        return self.resident_mem.get(inst, 0)

    def take(self, inst: Instance, stamp: float) -> None:
        """A call starts on the resident instance ``inst``: its chunk is busy, the instance in
        use (never evicted) and the most recently used. Its GPUs must be free."""
        _, start, size = inst
        mask = self.chunk_mask(start, size)
        if self.busy & mask or inst not in self.resident:
            raise ValueError(f"{self.name}: chunk [{start}, {start + size}) is busy or not holding {inst[0]}")
        self.resident[inst] = stamp
        self.in_use[inst] = self.in_use.get(inst, 0) + 1
        self.busy |= mask

    def give(self, inst: Instance, stamp: float) -> None:
        """The call on ``inst`` ended: its GPUs are free again and the instance, still
        resident unless it was dropped, was last used at ``stamp``. The exact inverse of
        ``take`` (a chunk that is not busy is an error in the caller)."""
        _, start, size = inst
        mask = self.chunk_mask(start, size)
        if self.busy & mask != mask:
            raise ValueError(f"{self.name}: chunk [{start}, {start + size}) was not taken")
        self.busy &= ~mask
        left = self.in_use.get(inst, 1) - 1
        if left > 0:
            self.in_use[inst] = left
        else:
            self.in_use.pop(inst, None)
        if inst in self.resident:
            self.resident[inst] = stamp

    def free_chunks(self) -> FreeView:
        """The free GPUs as maximal aligned free blocks (what buddy allocation with merging
        would hold), for the chunk DP operator (``tangram.core.gpu.ChunkOperator``)."""
        return FreeView(self)

    def add_resident(self, inst: Instance, mem: int, stamp: float) -> None:
        _, s, z = inst
        for g in range(s, s + z):
            self.used_mem[g] += mem
        self.resident[inst] = stamp
        self.resident_mem[inst] = mem

    def drop_resident(self, inst: Instance) -> None:
        if inst not in self.resident:
            return
        mem = self.resident_mem.pop(inst)
        del self.resident[inst]
        _, s, z = inst
        for g in range(s, s + z):
            self.used_mem[g] -= mem


class FreeView:
    """A node's free GPUs as maximal aligned free blocks, read from its busy mask."""

    def __init__(self, node: GpuNode) -> None:
        self.max_chunk = max(s for s in SIZES if s <= node.count)
        self._sizes: dict[int, int] = {}
        for start, end in root_chunks(node.count):
            self._scan(node, start, end - start, node.count)

    def _scan(self, node: GpuNode, start: int, size: int, count: int) -> None:
        if start >= count:
            return
        if start + size <= count and node.is_free(start, size):
            self._sizes[size] = self._sizes.get(size, 0) + 1
            return
        if size == 1:
            return
        self._scan(node, start, size // 2, count)
        self._scan(node, start + size // 2, size // 2, count)

    def free_sizes(self) -> dict[int, int]:
        return dict(self._sizes)


class GpuManager:
    def __init__(self, cache_aware: bool = True) -> None:
        self.cache_aware = cache_aware  # False: residency does not steer the choice of chunk
        self.nodes: dict[str, GpuNode] = {}
        self.services: dict[str, ServiceInfo] = {}

    def add_node(self, name: str, count: int, mem_mib: int) -> None:
        if count > 0:
            self.nodes[name] = GpuNode(name, count, mem_mib)

    def remove_node(self, name: str) -> None:
        self.nodes.pop(name, None)

    def frontier_shrinks(self, name: str) -> bool:
        """Whether losing node ``name`` could make a call that fits now never fit: no other
        node has at least its GPUs and its memory per GPU."""
        node = self.nodes.get(name)
        if node is None:
            return False
        return not any(
            other is not node and other.count >= node.count and other.mem_mib >= node.mem_mib
            for other in self.nodes.values()
        )

    def define(self, info: ServiceInfo) -> None:
        self.services[info.name] = info

    def never_fits(self, service: str, size: int) -> str | None:
        """Why no node could ever run ``service`` on ``size`` GPUs, or None."""
        svc = self.services.get(service)
        if svc is None:
            return f"unknown service {service!r}"
        if not self.nodes:
            return "no GPU node has joined"
        for node in self.nodes.values():
            if node.count >= size and node.mem_mib >= svc.mem(size):
                return None
        return f"no node has {size} GPUs with {svc.mem(size)} MiB each"

    def choose(
        self, service: str, size: int, busy: dict[str, int], blocked: set[str], only: str | None = None,
        wanted: Container[tuple[str, int]] = (),
    ) -> Placement | None:
        """The best chunk of ``size`` GPUs for ``service`` over all nodes, given the tentative
        ``busy`` masks of this pass; None if no node has one free now. ``wanted``: the
        (service, size) instances that waiting calls could run on; a chunk whose restore would
        evict fewer of them wins over the other non-resident chunks (rule 4, before the block)."""
        svc = self.services[service]
        best: tuple[tuple[int, int, int, int, str, int], Placement] | None = None
        for name in sorted(self.nodes):
            node = self.nodes[name]
            if (only is not None and name != only) or name in blocked or size > node.count:
                continue
            if svc.mem(size) > node.mem_mib:
                continue
            b = busy.get(name, node.busy)
            for start in range(0, node.count - size + 1, size):
                if not node.is_free(start, size, b):
                    continue
                resident = (service, start, size) in node.resident
                evict = () if resident else node.evictions_for(svc, start, size)
                if evict is None:
                    continue
                block = node.enclosing_free_block(start, size, b)
                hits = sum(1 for v in evict if (v[0], v[2]) in wanted) if wanted else 0
                key = (0 if resident and self.cache_aware else 1, hits, block, len(evict), name, start)
                if best is None or key < best[0]:
                    best = (key, Placement(name, start, size, evict, resident))
        return None if best is None else best[1]
