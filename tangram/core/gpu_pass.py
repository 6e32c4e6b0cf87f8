"""The GPU pass of the scheduler (Algorithm 1 over the GPU queue, chunk sizes by Algorithm 4).

Plain functions over the ``Scheduler``'s state (``sched``); ``run`` is the pass, called by
``Scheduler._schedule``. It takes the FCFS prefix whose minimum chunks fit, may wait for a
busy chunk that already holds the service (``_wait_for_resident``), sizes each node's
candidates with ``DPTable`` and ``ChunkOperator`` plus greedy eviction (``_sizes``), and
starts calls with ``Evict``/``Load``/``Invoke`` (``_start_call``). Under the tangram policy the
restore-or-wait choice weighs what a restore costs the calls behind (``_wait_for_resident``), and
a restore prefers a chunk whose eviction no call in the window wants (``GpuManager.choose``).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.actions import ActionSpec, Kind
from tangram.core.approx import greedy_eviction
from tangram.core.dp import DPTable
from tangram.core.gpu import ChunkOperator, root_chunks
from tangram.core.managers.gpu import SIZES, GpuNode, Instance, Placement, chunk_size
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
    wants: dict[str, frozenset[tuple[str, int]]] = {}  # per grouped call: what the calls behind it want
    blocked = False
    behind: list[Waiting] = []
    soon: Soon = {}
    queue = list(sched.queues[GPU].values())
    aware = sched.config.policy == TANGRAM and sched.config.cache_aware
    window = _Window(queue, sched.config.behind_limit) if aware else None
    for i, w in enumerate(queue):
        if blocked:
            if len(behind) >= sched.config.behind_limit:
                break
            behind.append(w)
            continue
        size = chunk_size(w.spec.key_demand.min)
        wanted: dict[tuple[str, int], int] = {}
        if window is not None:
            window.advance(i)
            wanted = window.count
        pl = sched.gpu.choose(w.spec.service, size, busy, set(), wanted=wanted)
        if pl is None:
            blocked = True
            free = sum(n.count - busy[name].bit_count() for name, n in sched.gpu.nodes.items())
            total = sum(n.count for n in sched.gpu.nodes.values())
            w.status = wait(Shortfall(GPU, size, free, total, "a free aligned chunk"))
            behind.append(w)
            continue
        if not pl.resident and window is not None and _wait_for_resident(
            sched, w, size, pl, window, soon, busy
        ):
            continue
        busy[pl.node] |= sched.gpu.nodes[pl.node].chunk_mask(pl.start, pl.size)
        groups.setdefault(pl.node, []).append(w)
        if wanted:
            wants[w.spec.action_id] = frozenset(wanted)
    for node in sorted(groups):
        _start_group(sched, node, groups[node], behind, wants, out)


class _Window:
    """The calls right behind queue position ``i`` (at most ``size``, ApproxACTs' ``rest``):
    how many of them want each (service, minimum chunk) instance (``count``) and in all
    (``total``). A sliding multiset: positions only grow within a pass, and keys are read
    only as the window reaches them."""

    def __init__(self, queue: list[Waiting], size: int) -> None:
        self._queue = queue
        self._size = size
        self._at = -1
        self._end = 1  # the window is queue[_at + 1: _end]
        self.count: dict[tuple[str, int], int] = {}
        self.total = 0

    def advance(self, i: int) -> None:
        while self._at < i:
            self._at += 1
            if self._at >= 1:
                self._drop(_key(self._queue[self._at]))
        end = min(len(self._queue), i + 1 + self._size)
        while self._end < end:
            k = _key(self._queue[self._end])
            self.count[k] = self.count.get(k, 0) + 1
            self.total += 1
            self._end += 1

    def _drop(self, k: tuple[str, int]) -> None:
        left = self.count[k] - 1
        if left > 0:
            self.count[k] = left
        else:
            del self.count[k]
        self.total -= 1


def _key(w: Waiting) -> tuple[str, int]:
    return (w.spec.service, chunk_size(w.spec.key_demand.min))


Soon = dict[tuple[str, int], list[float]]


def _frees(sched: Scheduler, soon: Soon, service: str, size: int) -> list[float]:
    """When each busy resident copy of (service, size) frees, counting the calls already
    waiting for it in this pass (a heap, kept in ``soon``)."""
    key = (service, size)
    if key not in soon:
        soon[key] = sorted(
            r.est_end for r in sched.running.values()
            if r.spec.kind is Kind.CALL and r.spec.service == service and r.chunk[1] == size
        )
    return soon[key]


def _wait_for_resident(sched: Scheduler, w: Waiting, size: int, pl: Placement, window: _Window,
                       soon: Soon, busy: dict[str, int]) -> bool:
    """Cache awareness beyond the paper's tie-break: rather than restore a service onto the
    free chunk ``pl``, wait for a busy chunk that already holds it when that chunk frees
    (after the calls already waiting for it) sooner than the restore costs in summed
    completion time. The restore costs

    * its own time ``load_s`` (this call starts that much later than on a resident chunk);
    * the ``load_s`` GPU-seconds it takes from the calls behind: of the ``n`` calls in the
      window (ApproxACTs' ``rest``) that find no free GPU now, about ``n / G`` would run on
      this chunk of a pool of ``G`` GPUs, each ``load_s`` later (nothing while GPUs are
      free, much when the pool is overloaded, which is when restores waste the capacity
      everyone waits for);
    * for each evicted instance that a call in the window wants (and no other free chunk
      holds), that call's extra wait: for its service's next busy copy, else for this call
      and a restore of its own (a pairwise exchange of the two calls).

    With an idle pool and no wanted victim this is the plain "sooner than a restore" rule.
    Only a call with a busy resident copy waits, so the wait is bounded by that copy's turn."""
    spec = w.spec
    frees = _frees(sched, soon, spec.service, size)
    if not frees:
        return False
    load_s = sched.gpu.services[spec.service].load(size)
    mine = sched._estimate(spec, size)
    gpus = free = 0
    for name, gn in sched.gpu.nodes.items():
        gpus += gn.count
        free += gn.count - busy[name].bit_count()
    queued = max(0, window.total - (free - pl.size))  # the calls behind that find no free GPU
    cost = load_s * (1.0 + queued / gpus)
    for victim in pl.evict:
        service, _, vsize = victim
        if (service, vsize) not in window.count or _free_copy(sched, victim, pl.node, busy):
            continue
        later = load_s + mine + sched.gpu.services[service].load(vsize)  # after this call, restored again
        vf = _frees(sched, soon, service, vsize)
        cost += min(vf[0] - sched.now, later) if vf else later
    if frees[0] - sched.now >= cost:
        return False
    heapq.heapreplace(frees, frees[0] + mine)
    w.status = wait(
        message=f"waiting for a busy GPU that holds {spec.service}: sooner than a {load_s:g} s restore costs"
    )
    return True


def _free_copy(sched: Scheduler, victim: Instance, node: str, busy: dict[str, int]) -> bool:
    """Whether a chunk other than the victim's, free in this pass, holds its (service, size)."""
    service, start, size = victim
    for name, gn in sched.gpu.nodes.items():
        for v, s, z in gn.resident:
            if v == service and z == size and (name, s) != (node, start) and gn.is_free(s, z, busy[name]):
                return True
    return False


def _start_group(sched: Scheduler, node: str, group: list[Waiting], behind: list[Waiting],
                 wants: dict[str, frozenset[tuple[str, int]]], out: list[cmd.Command]) -> None:
    gnode = sched.gpu.nodes[node]
    sizes = _sizes(sched, gnode, group, behind)
    for w, size in zip(group, sizes):
        if size == 0:
            w.status = wait(message="held back: starting it now would raise the summed completion time")
            continue
        wanted = wants.get(w.spec.action_id, frozenset())
        pl = sched.gpu.choose(w.spec.service, size, {}, set(), only=node, wanted=wanted)
        if pl is None and size != chunk_size(w.spec.key_demand.min):
            pl = sched.gpu.choose(w.spec.service, chunk_size(w.spec.key_demand.min), {}, set(), only=node,
                                  wanted=wanted)
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
    running = [(r.est_end - sched.now, r.units) for r in sched.running.on(gnode.name).values()
               if r.spec.kind is Kind.CALL]
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
        node.add_resident(inst, svc.mem(pl.size), float(sched._seq))
        load_s = svc.load(pl.size)
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

