"""The GPU pass of the scheduler (Algorithm 1 over the GPU queue, chunk sizes by Algorithm 4).

Plain functions over the ``Scheduler``'s state (``sched``); ``run`` is the pass, called by
``Scheduler._schedule``. It takes the FCFS prefix whose minimum chunks fit, may wait for a
busy chunk that already holds the service (``_wait_for_resident``), sizes each node's
candidates with ``DPTable`` and ``ChunkOperator`` plus greedy eviction (``_sizes``), and
starts calls with ``Evict``/``Load``/``Invoke`` (``_start_call``).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.actions import ActionSpec, Kind
from tangram.core.approx import greedy_eviction
from tangram.core.dp import DPTable
from tangram.core.gpu import ChunkOperator, root_chunks
from tangram.core.managers.gpu import SIZES, GpuNode, Placement, chunk_size
from tangram.core.resources import GPU
from tangram.core.state import FIXED, MAX, MIN, TANGRAM, Running, Waiting
from tangram.core.status import Shortfall, wait

if TYPE_CHECKING:
    from tangram.core.scheduler import Scheduler


def run(sched: Scheduler, out: list[cmd.Command]) -> None:
    """Algorithm 1 over the GPU queue: the FCFS prefix whose minimum chunks fit (with the
    tentative busy masks of this pass), grouped per node; elastic calls get their chunk
    sizes from DPArrange with the chunk-wise operator (Algorithm 4)."""
    busy = {n: node.busy for n, node in sched.gpu.nodes.items()}
    groups: dict[str, list[Waiting]] = {}
    blocked = False
    behind: list[Waiting] = []
    soon: dict[tuple[str, int], list[float]] = {}
    for w in sched.queues[GPU].values():
        if blocked:
            if len(behind) >= sched.config.behind_limit:
                break
            behind.append(w)
            continue
        size = chunk_size(w.spec.key_demand.min)
        pl = sched.gpu.choose(w.spec.service, size, busy, set())
        if pl is None:
            blocked = True
            free = sum(n.count - busy[name].bit_count() for name, n in sched.gpu.nodes.items())
            total = sum(n.count for n in sched.gpu.nodes.values())
            w.status = wait(Shortfall(GPU, size, free, total, "a free aligned chunk"))
            behind.append(w)
            continue
        if not pl.resident and _wait_for_resident(sched, w, size, soon):
            continue
        busy[pl.node] |= sched.gpu.nodes[pl.node].chunk_mask(pl.start, pl.size)
        groups.setdefault(pl.node, []).append(w)
    for node in sorted(groups):
        _start_group(sched, node, groups[node], behind, out)


def _wait_for_resident(sched: Scheduler, w: Waiting, size: int,
                       soon: dict[tuple[str, int], list[float]]) -> bool:
    """Cache awareness beyond the paper's tie-break: rather than restore a service onto a
    free chunk, wait for a busy chunk that already holds it when that chunk frees up
    sooner than a restore would take. ``soon`` tracks, per (service, size), when each busy
    resident copy frees, counting the calls already queued for it in this pass."""
    if sched.config.policy != TANGRAM or not sched.config.cache_aware:
        return False
    spec = w.spec
    key = (spec.service, size)
    if key not in soon:
        soon[key] = sorted(
            r.est_end for r in sched.running.values()
            if r.spec.kind is Kind.CALL and r.spec.service == spec.service and r.chunk[1] == size
        )
    frees = soon[key]
    load_s = sched.gpu.services[spec.service].load_s
    if not frees or frees[0] - sched.now >= load_s:
        return False
    heapq.heapreplace(frees, frees[0] + sched._estimate(spec, size))
    w.status = wait(
        message=f"waiting for a busy GPU that holds {spec.service}: sooner than a {load_s:g} s restore"
    )
    return True


def _start_group(sched: Scheduler, node: str, group: list[Waiting], behind: list[Waiting],
                 out: list[cmd.Command]) -> None:
    gnode = sched.gpu.nodes[node]
    sizes = _sizes(sched, gnode, group, behind)
    for w, size in zip(group, sizes):
        if size == 0:
            w.status = wait(message="held back: starting it now would raise the summed completion time")
            continue
        pl = sched.gpu.choose(w.spec.service, size, {}, set(), only=node)
        if pl is None and size != chunk_size(w.spec.key_demand.min):
            pl = sched.gpu.choose(w.spec.service, chunk_size(w.spec.key_demand.min), {}, set(), only=node)
        if pl is None:
            w.status = wait(message=f"no aligned chunk free on {node} after fragmentation")
            continue
        del sched.queues[GPU][w.spec.action_id]
        _start_call(sched, w, pl, out)


def _sizes(sched: Scheduler, gnode: GpuNode, group: list[Waiting], behind: list[Waiting]) -> list[int]:
    """Chunk size per candidate on one node (0: held back)."""
    mins = [chunk_size(w.spec.key_demand.min) for w in group]
    free = gnode.count - gnode.busy.bit_count()
    options = [_options(sched, w.spec, free) for w in group]
    if all(len(o) == 1 for o in options):
        return [next(iter(o)) for o in options]
    table = DPTable(options, _operator(sched, _FreeView(gnode)))
    n = len(group)
    if not table.feasible(n):
        return mins
    if sched.config.policy != TANGRAM or not sched.config.eviction:
        return list(table.best(n)[1])
    running = [(r.est_end - sched.now, r.units) for r in sched.running.values()
               if r.node == gnode.name and r.spec.kind is Kind.CALL]
    cand_behind = [sched._behind(w.spec) for w in group]
    rest = [sched._behind(w.spec) for w in behind[: sched.config.behind_limit]]
    return greedy_eviction(table, options, running, cand_behind, rest, free, sched.config.depth)


def _options(sched: Scheduler, spec: ActionSpec, free: int) -> dict[int, float]:
    d = spec.key_demand
    fitting = {chunk_size(u) for u in d.options() if chunk_size(u) <= max(free, 1)}
    sizes = sorted(fitting) or [chunk_size(d.min)]
    base = chunk_size(d.min)
    policy = sched.config.policy
    if not d.elastic or policy == MIN:
        return {base: sched._estimate(spec, base)}
    if policy == FIXED and sched.config.fixed_dop:
        k = chunk_size(min(max(sched.config.fixed_dop, d.min), d.max))
        return {k: sched._estimate(spec, k)} if k in sizes else {base: sched._estimate(spec, base)}
    if policy == MAX:
        return {sizes[-1]: sched._estimate(spec, sizes[-1])}
    if sched._t_ori(spec) is None or spec.elasticity is None:
        return {base: sched._estimate(spec, base)}
    return {s: sched._estimate(spec, s) for s in sizes}


def _start_call(sched: Scheduler, w: Waiting, pl: Placement, out: list[cmd.Command]) -> None:
    spec = w.spec
    node = sched.gpu.nodes[pl.node]
    svc = sched.gpu.services[spec.service]
    inst = (spec.service, pl.start, pl.size)
    for victim in pl.evict:
        node.drop_resident(victim)
        out.append(cmd.Evict(pl.node, victim[0], victim[1], victim[1] + victim[2]))
    sched._seq += 1
    load_s = 0.0
    if not pl.resident:
        node.add_resident(inst, svc.gpu_mem_mib, float(sched._seq))
        load_s = svc.load_s
        out.append(cmd.Load(pl.node, spec.service, pl.start, pl.start + pl.size, load_s))
    node.resident[inst] = float(sched._seq)
    node.in_use[inst] = node.in_use.get(inst, 0) + 1
    node.busy |= node.chunk_mask(pl.start, pl.size)
    est = load_s + sched._estimate(spec, pl.size)
    r = Running(spec, pl.node, pl.size, sched.now, sched.now + est, chunk=(pl.start, pl.size), load_s=load_s,
                deadline=w.deadline)
    sched.running[spec.action_id] = r
    sched.counters["started"] = sched.counters.get("started", 0) + 1
    sched.counters["loads"] = sched.counters.get("loads", 0) + (0 if pl.resident else 1)
    out.append(cmd.Invoke(spec.action_id, pl.node, spec.service, pl.start, pl.start + pl.size, est))


def _operator(sched: Scheduler, view: _FreeView) -> ChunkOperator:
    """The chunk DP operator for a free-chunk layout; built once per distinct layout (its
    states' packability check is the costly part) and kept on the scheduler."""
    key = (view.max_chunk, tuple(sorted(view.free_sizes().items())))
    op = sched.chunk_operators.get(key)
    if op is None:
        op = sched.chunk_operators[key] = ChunkOperator(view)
    return op


class _FreeView:
    """A node's free GPUs as maximal aligned free blocks, for the chunk DP operator."""

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

