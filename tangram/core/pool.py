"""Warm sandbox pools: how many created, idle sandboxes each node keeps ready, per shape. Pure.

A *shape* (`PoolShape`) is what a sandbox's container is made from and cannot change once made:
its image and its memory limit, as the open asked for them (image "" and memory 0 stand for the
agent's defaults). Opening a sandbox of a shape whose pool on the chosen node has one ready takes
that one instead of creating a container (docs/scheduler.md, "Warm sandbox pools").

Rules of `PoolSizer`:

1. It sees every sandbox creation the scheduler decides (`opened(node, shape, now)`: one
   `CreateSandbox` command) and nothing else; time is an argument, never read.
2. Target of a (node, shape) pool: the most opens of that shape on that node within any
   `window_s` over the last `history_s` (an RL step opens its batch at once, so the next step finds
   its sandboxes made), clamped to [`min`, `max`]. `min` applies to the configured `shapes` and to
   shapes opened within the history; every other shape gets no pool.
3. Memory, accounted as a trajectory's reservation is: an idle pooled sandbox holds its memory
   limit (its shape's memory, or the node's default for memory 0). Pools use only memory no
   trajectory holds: per node at most `mem_fraction` of its memory and at most what is unreserved.
   Shapes with larger targets are served first (ties by shape), and a shape that does not fit gets
   what fits.
4. Deterministic: the same calls give the same targets (no set or dict order leaks out unsorted).

The controller (`tangram_cli/controller/pools.py`) and the simulator (`tangram/sim/pool.py`) both
drive this class, each with its own clock.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class PoolShape:
    """What a pooled sandbox is made from: the image and the memory limit (MiB) an open asks for."""

    image: str = ""
    mem_mib: int = 0


@dataclass(frozen=True)
class PoolPolicy:
    """Bounds of every pool (per node and shape). `max == 0` turns pools off."""

    min: int = 0
    max: int = 32
    window_s: float = 10.0
    history_s: float = 600.0
    mem_fraction: float = 0.25
    shapes: tuple[PoolShape, ...] = (PoolShape(),)

    @property
    def enabled(self) -> bool:
        return self.max > 0

    def problem(self) -> str | None:
        """What is wrong with these bounds (a sentence naming the field), or None."""
        if self.min < 0 or self.max < 0:
            return "`min` and `max` must be >= 0"
        if self.min > self.max:
            return f"`min` ({self.min}) must not be more than `max` ({self.max})"
        if not 0 < self.window_s <= self.history_s:
            return "`window_s` must be > 0 and at most `history_s`"
        if not 0.0 <= self.mem_fraction <= 1.0:
            return "`mem_fraction` must be in [0, 1]"
        return None


@dataclass(frozen=True)
class NodeRoom:
    """A node's memory as the pools see it (MiB): total, not reserved by trajectories, and the
    memory limit of a sandbox opened without one (its agent's default; 0: unknown)."""

    mem_total_mib: int
    mem_free_mib: int
    default_mem_mib: int = 0

    def budget(self, fraction: float) -> int:
        return max(0, min(int(self.mem_total_mib * fraction), self.mem_free_mib))

    def mem_of(self, shape: PoolShape) -> int:
        return shape.mem_mib or self.default_mem_mib


def peak(times: Iterable[float], window_s: float) -> int:
    """The most of `times` (ascending) within any span of `window_s`."""
    ts = list(times)
    best, lo = 0, 0
    for hi, t in enumerate(ts):
        while t - ts[lo] >= window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


class PoolSizer:
    """Targets of every node's pools from the opens it has seen (rules in the module doc)."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy
        self._opens: dict[tuple[str, PoolShape], deque[float]] = {}
        # (node, shape) -> ((count, first, last) of its opens, their peak): recomputed when they change
        self._peaks: dict[tuple[str, PoolShape], tuple[tuple[int, float, float], int]] = {}

    def opened(self, node: str, shape: PoolShape, now: float) -> None:
        if self.policy.enabled:
            self._opens.setdefault((node, shape), deque()).append(now)

    def node_gone(self, node: str) -> None:
        for key in [k for k in self._opens if k[0] == node]:
            del self._opens[key]
            self._peaks.pop(key, None)

    def _peak(self, node: str, shape: PoolShape, times: deque[float]) -> int:
        if not times:
            self._peaks.pop((node, shape), None)
            return 0
        sig = (len(times), times[0], times[-1])
        cached = self._peaks.get((node, shape))
        if cached is None or cached[0] != sig:
            cached = self._peaks[(node, shape)] = (sig, peak(times, self.policy.window_s))
        return cached[1]

    def _recent(self, node: str, shape: PoolShape, now: float) -> deque[float]:
        times = self._opens.get((node, shape))
        if times is None:
            return deque()
        while times and times[0] < now - self.policy.history_s:
            times.popleft()
        if not times:
            del self._opens[(node, shape)]
        return times

    def wanted(self, node: str, now: float) -> dict[PoolShape, int]:
        """Rule 2 for one node: each shape's target before memory (shapes with none left out)."""
        pol = self.policy
        if not pol.enabled:
            return {}
        shapes = set(pol.shapes) | {s for n, s in self._opens if n == node}
        out: dict[PoolShape, int] = {}
        for shape in sorted(shapes):
            times = self._recent(node, shape, now)
            if not times and shape not in pol.shapes:
                continue
            count = min(pol.max, max(pol.min, self._peak(node, shape, times)))
            if count > 0:
                out[shape] = count
        return out

    def node_targets(self, node: str, now: float, room: NodeRoom) -> dict[PoolShape, int]:
        """Rules 2 and 3 for one node: every shape with a pool, and its size."""
        budget = room.budget(self.policy.mem_fraction)
        out: dict[PoolShape, int] = {}
        for shape, count in sorted(self.wanted(node, now).items(), key=lambda kv: (-kv[1], kv[0])):
            mem = room.mem_of(shape)
            fits = count if mem <= 0 else min(count, budget // mem)
            budget -= fits * max(mem, 0)
            if fits > 0:
                out[shape] = fits
        return out

    def targets(self, now: float, rooms: Mapping[str, NodeRoom]) -> dict[str, dict[PoolShape, int]]:
        """`node_targets` of every node in `rooms`, by node name."""
        return {node: self.node_targets(node, now, rooms[node]) for node in sorted(rooms)}
