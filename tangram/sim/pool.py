"""Warm sandbox pools in the simulated cluster: what opening a sandbox costs with a pool
(docs/scheduler.md, "Warm sandbox pools"; the experiment is pool_experiment.py).

The cluster model (cluster.py) hands every ``CreateSandbox`` to `SimPools.create` when its spec has
pools (``pool_max > 0``). Rules of the model:

1. Sizing is the controller's: the same `tangram.core.pool.PoolSizer`, fed the same ``CreateSandbox``
   commands, with each node's memory that no open sandbox holds.
2. A pool starts with ``pool_min`` sandboxes of the first shape opened on its node (it had the time
   before the run to fill). After that a node refills its pools only in the idle time of its
   container-create pipeline (``sandbox_create_per_s``), which cold creates use first: a refill never
   delays a cold create, nor a running action (making a container takes no granted core here).
3. A create of a shape with a ready sandbox on its node is a claim: ready ``sandbox_claim_s`` later.
   Otherwise it is cold, as without pools.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.pool import NodeRoom, PoolPolicy, PoolShape, PoolSizer

if TYPE_CHECKING:  # cluster.py imports this module
    from tangram.sim.cluster import ClusterSpec


def policy_of(spec: ClusterSpec) -> PoolPolicy:
    return PoolPolicy(min=spec.pool_min, max=spec.pool_max, window_s=spec.pool_window_s,
                      history_s=max(spec.pool_history_s, spec.pool_window_s),
                      mem_fraction=spec.pool_mem_fraction, shapes=())


class SimPools:
    """Every node's pools in the simulated cluster (rules in the module doc)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.policy = policy_of(spec)
        self.sizer = PoolSizer(self.policy)
        self.mem_total = int(spec.cpu_mem_gib * 1024)
        self.ready: dict[tuple[str, PoolShape], int] = {}
        self.last: dict[str, float] = {}  # node -> its pipeline's idle time is counted up to here
        self.held: dict[str, tuple[str, int]] = {}  # sandbox -> (node, MiB) of open sandboxes
        self.reserved: dict[str, int] = {}
        self.claims = 0
        self.colds = 0

    def _room(self, node: str) -> NodeRoom:
        return NodeRoom(self.mem_total, self.mem_total - self.reserved.get(node, 0))

    def _refill(self, node: str, now: float, create_free: float) -> None:
        """Rule 2: the refills that fit in the pipeline's idle time since it was last counted."""
        targets = self.sizer.node_targets(node, now, self._room(node))
        begin = max(self.last.get(node, now), create_free)
        slots = int(max(0.0, now - begin) * self.spec.sandbox_create_per_s)
        used = 0
        for gap, shape in sorted((self.ready.get((node, s), 0) - t, s) for s, t in targets.items()):
            take = min(-gap, slots - used)
            if take > 0:
                self.ready[(node, shape)] = self.ready.get((node, shape), 0) + take
                used += take
        self.last[node] = now if used < slots else begin + used / self.spec.sandbox_create_per_s

    def _first_sight(self, node: str, shape: PoolShape, now: float) -> None:
        if (node, shape) in self.ready:
            return
        room = self._room(node)
        fits = room.budget(self.policy.mem_fraction) // shape.mem_mib if shape.mem_mib else self.policy.min
        self.ready[(node, shape)] = min(self.policy.min, fits)
        self.last.setdefault(node, now)

    def create(self, c: cmd.CreateSandbox, now: float, create_free: float) -> float | None:
        """Rule 3: when the sandbox is ready if a pool serves it; None: a cold create."""
        shape = PoolShape(c.image, c.mem_mib)
        self._first_sight(c.node, shape, now)
        self._refill(c.node, now, create_free)
        self.sizer.opened(c.node, shape, now)
        self.held[c.sandbox] = (c.node, c.mem_mib)
        self.reserved[c.node] = self.reserved.get(c.node, 0) + c.mem_mib
        if self.ready[(c.node, shape)] > 0:
            self.ready[(c.node, shape)] -= 1
            self.claims += 1
            return now + self.spec.sandbox_claim_s
        self.colds += 1
        return None

    def destroyed(self, sandbox: str) -> None:
        node, mem = self.held.pop(sandbox, ("", 0))
        if node:
            self.reserved[node] -= mem
