"""CPU manager: exclusive cores per node, NUMA packing, trajectory placement (docs/scheduler.md).

Contract:
1. A core belongs to at most one running action (or one reserved sandbox) at a time.
2. A sandbox's memory is reserved on its node from its first placed action until it
   closes; every later action of the sandbox runs on that node.
3. ``take`` and ``give`` are exact inverses; ``give`` of cores that are free is an error in
   the caller, so it raises ``ValueError`` (the scheduler never does it).
4. ``on_bind`` and ``on_unbind`` (set by the scheduler) hear of every sandbox whose memory is
   reserved and released, a lost node's sandboxes included (the jobs' memory, ``jobs.py``).
Core sets are Python ints used as bitmasks, so picking and freeing cores is cheap.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tangram.core.resources import CPU, MEM
from tangram.core.status import Shortfall


def mask_of(cores: tuple[int, ...] | list[int]) -> int:
    m = 0
    for c in cores:
        m |= 1 << c
    return m


def cores_of(mask: int) -> tuple[int, ...]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return tuple(out)


def lowest(mask: int, n: int) -> int:
    """The ``n`` lowest set bits of ``mask``."""
    out = 0
    for _ in range(n):
        low = mask & -mask
        out |= low
        mask ^= low
    return out


@dataclass
class CpuNode:
    name: str
    all_mask: int
    numa_masks: tuple[int, ...]
    mem_total: int
    free_mask: int = 0
    mem_reserved: int = 0
    sandboxes: dict[str, int] = field(default_factory=dict)  # sandbox -> reserved MiB

    @property
    def total(self) -> int:
        return self.all_mask.bit_count()

    @property
    def free(self) -> int:
        return self.free_mask.bit_count()

    @property
    def mem_free(self) -> int:
        return self.mem_total - self.mem_reserved

    def pick(self, n: int) -> tuple[int, ...]:
        """``n`` free cores: from one NUMA domain when one can hold them (best fit), else
        from the domains with the most free cores first."""
        if n > self.free:
            raise ValueError(f"{self.name}: {n} cores asked, {self.free} free")
        domains = [(d & self.free_mask) for d in self.numa_masks]
        fitting = [(m.bit_count(), i) for i, m in enumerate(domains) if m.bit_count() >= n]
        if fitting:
            _, i = min(fitting)
            return cores_of(lowest(domains[i], n))
        picked, need = 0, n
        for m in sorted(domains, key=lambda m: (-m.bit_count(), m & -m)):
            take = min(need, m.bit_count())
            picked |= lowest(m, take)
            need -= take
            if need == 0:
                break
        return cores_of(picked)

    def take(self, cores: tuple[int, ...]) -> None:
        m = mask_of(cores)
        if m & ~self.free_mask:
            raise ValueError(f"{self.name}: cores {cores_of(m & ~self.free_mask)} are not free")
        self.free_mask &= ~m

    def give(self, cores: tuple[int, ...]) -> None:
        m = mask_of(cores)
        if m & self.free_mask or m & ~self.all_mask:
            raise ValueError(f"{self.name}: cores {cores} were not taken")
        self.free_mask |= m


class CpuManager:
    """Nodes' cores and sandboxes' memory."""

    def __init__(self) -> None:
        self.nodes: dict[str, CpuNode] = {}
        self.sandbox_node: dict[str, str] = {}
        self.on_bind: Callable[[str, int], None] | None = None  # (sandbox, MiB reserved)
        self.on_unbind: Callable[[str], None] | None = None  # (sandbox)

    def add_node(self, name: str, cpus: tuple[int, ...], numa: tuple[tuple[int, ...], ...], mem_mib: int) -> None:
        domains = tuple(mask_of(d) for d in numa if d) or (mask_of(cpus),)
        allm = mask_of(cpus)
        domains = tuple(d & allm for d in domains if d & allm)
        self.nodes[name] = CpuNode(name, allm, domains, mem_mib, free_mask=allm)

    def remove_node(self, name: str) -> list[str]:
        """Forget a node; returns the sandboxes that lived there."""
        node = self.nodes.pop(name, None)
        if node is None:
            return []
        lost = sorted(node.sandboxes)
        for s in lost:
            self.sandbox_node.pop(s, None)
            if self.on_unbind is not None:
                self.on_unbind(s)
        return lost

    def frontier_shrinks(self, name: str) -> bool:
        """Whether losing node ``name`` could make a demand that fits now never fit: no
        other node has at least its cores and its memory."""
        node = self.nodes.get(name)
        if node is None:
            return False
        return not any(
            other is not node and other.total >= node.total and other.mem_total >= node.mem_total
            for other in self.nodes.values()
        )

    # -- admission -----------------------------------------------------------------------
    def never_fits(self, min_cores: int, mem_mib: int) -> Shortfall | None:
        """A shortfall if no node could ever hold ``min_cores`` and ``mem_mib`` at once."""
        if any(n.total >= min_cores and n.mem_total >= mem_mib for n in self.nodes.values()):
            return None
        best_cores = max((n.total for n in self.nodes.values()), default=0)
        best_mem = max((n.mem_total for n in self.nodes.values()), default=0)
        if best_cores < min_cores:
            return Shortfall(CPU, min_cores, best_cores, best_cores, "largest node")
        return Shortfall(MEM, mem_mib, best_mem, best_mem, "largest node")

    def place(
        self, min_cores: int, mem_mib: int, free: dict[str, int], blocked: set[str], mem_free: dict[str, int]
    ) -> str | None:
        """Pick a node for a new trajectory: ``free[node]`` cores and ``mem_free[node]`` MiB left
        for this pass (memory for the whole trajectory), the most memory left after this pass's
        earlier placements first (memory balance, also within one pass), then name."""
        best: tuple[int, str] | None = None
        for name in self.nodes:
            if name in blocked or free[name] < min_cores or mem_free[name] < mem_mib:
                continue
            cand = (-mem_free[name], name)
            if best is None or cand < best:
                best = cand
        return None if best is None else best[1]

    def bind(self, sandbox: str, node: str, mem_mib: int) -> None:
        n = self.nodes[node]
        n.sandboxes[sandbox] = mem_mib
        n.mem_reserved += mem_mib
        self.sandbox_node[sandbox] = node
        if self.on_bind is not None:
            self.on_bind(sandbox, mem_mib)

    def unbind(self, sandbox: str) -> str | None:
        """Release a sandbox's memory (idempotent); returns its node."""
        node = self.sandbox_node.pop(sandbox, None)
        if node is not None and self.on_unbind is not None:
            self.on_unbind(sandbox)
        if node is None or node not in self.nodes:
            return node
        n = self.nodes[node]
        n.mem_reserved -= n.sandboxes.pop(sandbox, 0)
        return node
