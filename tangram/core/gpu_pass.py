"""The GPU pass of the scheduler (Algorithm 1 over the GPU queue, chunk sizes by Algorithm 4).

Plain functions over a ``PassContext`` (``ctx``, ``context.py``); ``run`` is the pass, called by
``Scheduler._schedule``. It takes the FCFS prefix whose minimum chunks fit, may wait for a
busy chunk that already holds the service (``_wait_for_resident``), sizes each node's
candidates with ``DPTable`` and ``ChunkOperator`` plus greedy eviction (``_sizes``), and
starts calls with ``Evict``/``Load``/``Invoke`` (``_start_call``). Under the tangram policy the
restore-or-wait choice weighs what a restore costs the calls behind (``_wait_for_resident``), and
a restore prefers a chunk whose eviction no call in the window wants (``GpuManager.choose``).
With pre-wake on (``CoreConfig.prewake``, ``prewake.py``), a call takes a free resident copy at
any of its sizes first, elastic sizes carry their restore, a copy being restored counts as one
that frees when its restore ends, and after the starts idle chunks are warmed for the calls
still waiting.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core import jobs, prewake
from tangram.core.actions import ActionSpec, Kind
from tangram.core.approx import greedy_eviction
from tangram.core.dp import DPTable
from tangram.core.gpu import ChunkOperator
from tangram.core.managers.gpu import FreeView, GpuNode, Instance, Placement, chunk_size
from tangram.core.queues import Lane
from tangram.core.resources import GPU
from tangram.core.state import FIXED, MAX, MIN, TANGRAM, Running, Waiting
from tangram.core.status import Shortfall, wait

if TYPE_CHECKING:
    from tangram.core.context import PassContext


def run(ctx: PassContext, out: list[cmd.Command]) -> None:
    """Algorithm 1 over the GPU queue: the FCFS prefix whose minimum chunks fit (with the
    tentative busy masks of this pass), grouped per node; elastic calls get their chunk
    sizes from DPArrange with the chunk-wise operator (Algorithm 4). With several RL jobs
    the queue is read in fair order and a job at its GPU cap is passed over (``jobs.py``)."""
    busy = {n: node.busy for n, node in ctx.gpu.nodes.items()}
    groups: dict[str, list[Waiting]] = {}
    wants: dict[str, frozenset[tuple[str, int]]] = {}  # per grouped call: what the calls behind it want
    blocked = False
    behind: list[Waiting] = []
    soon: Soon = {}
    fair, lane = jobs.ordered(ctx.jobs, ctx.pending.lanes(GPU), GPU)
    queue = _Prefix(lane, 2 * ctx.config.behind_limit + 2)
    aware = ctx.config.policy == TANGRAM and ctx.config.cache_aware
    window = _Window(queue, ctx.config.behind_limit) if aware else None
    wake = prewake.enabled(ctx)
    for i, w in enumerate(queue):
        if blocked:
            if len(behind) >= ctx.config.behind_limit:
                break
            behind.append(w)
            continue
        size = chunk_size(w.spec.key_demand.min)
        if fair.over_cap(w, size):  # its job is passed over for the rest of the pass
            continue
        wanted: dict[tuple[str, int], int] = {}
        if window is not None:
            window.advance(i)
            wanted = window.count
        pl = prewake.resident(ctx, w, busy) if wake else None
        pl = pl or ctx.gpu.choose(w.spec.service, size, busy, set(), wanted=wanted)
        if pl is None:
            blocked = True
            free = sum(n.count - busy[name].bit_count() for name, n in ctx.gpu.nodes.items())
            total = sum(n.count for n in ctx.gpu.nodes.values())
            w.status = wait(Shortfall(GPU, size, free, total, "a free aligned chunk"))
            behind.append(w)
            continue
        if not pl.resident and window is not None and _wait_for_resident(
            ctx, w, size, pl, window, soon, busy
        ):
            continue
        busy[pl.node] |= ctx.gpu.nodes[pl.node].chunk_mask(pl.start, pl.size)
        groups.setdefault(pl.node, []).append(w)
        fair.take(w.job, size)
        if wanted:
            wants[w.spec.action_id] = frozenset(wanted)
    ctx.examined(GPU, queue.seen)  # a cost meter
    capped = ctx.jobs.capped(GPU)
    for node in sorted(groups):
        _start_group(ctx, node, groups[node], behind, wants, out, fair if capped else None)
    if wake:
        prewake.run(ctx, queue.read(), out)


class _Prefix:
    """The GPU queue as a list that is read from the lane only as far as it is indexed
    (at most twice that far: reads double, starting at ``first``)."""

    def __init__(self, lane: Lane | jobs.FairLane, first: int) -> None:
        self._len = len(lane)
        self._it = iter(lane)
        self._read: list[Waiting] = list(islice(self._it, first))
        self.seen = 0  # how far the pass looked

    def __len__(self) -> int:
        return self._len

    def read(self) -> list[Waiting]:
        """The calls read so far (some may have started since), in FCFS order."""
        return self._read[: self.seen]

    def __getitem__(self, i: int) -> Waiting:
        read = self._read
        if i >= self.seen:
            self.seen = i + 1
        if i >= len(read):
            read.extend(islice(self._it, max(i + 1 - len(read), len(read))))
        return read[i]

    def __iter__(self) -> Iterator[Waiting]:
        for i in range(self._len):
            yield self[i]


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


def _frees(ctx: PassContext, soon: Soon, service: str, size: int) -> list[float]:
    """When each busy resident copy of (service, size) frees, counting the calls already
    waiting for it in this pass (a heap, kept in ``soon``)."""
    key = (service, size)
    if key not in soon:
        ends = sorted(
            [r.est_end for name in ctx.gpu.nodes for r in ctx.running.on(name, Kind.CALL).values()
             if r.spec.service == service and r.chunk[1] == size]
            + ctx.warming.ready_times(service, size)  # copies restored ahead free when ready
        )
        soon[key] = ends if ends or not prewake.enabled(ctx) else prewake.shared_copies(ctx, service, size)
    return soon[key]


def _wait_for_resident(ctx: PassContext, w: Waiting, size: int, pl: Placement, window: _Window,
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
    Only a call with a busy resident copy waits, so the wait is bounded by that copy's turn.
    With pre-wake on, the busy copies at every size the call accepts count (a copy being
    restored ahead counts from its restore's end), and the call waits for the one it would
    finish on first when that beats the restore."""
    spec = w.spec
    sizes = prewake.sizes_of(w, ctx) if prewake.enabled(ctx) else (size,)
    copy = _first_copy(ctx, soon, spec, sizes)
    if copy is None:
        return False
    frees, theirs = copy  # in excess of running the call on ``pl`` (0.0 at the same size: exact)
    restore = _restore_cost(ctx, w, sizes, pl, window, soon, busy)
    if frees[0] + (theirs - ctx.estimate(spec, size)) - ctx.now >= restore:
        return False
    heapq.heapreplace(frees, frees[0] + theirs)
    load_s = ctx.gpu.services[spec.service].load(size)
    w.status = wait(
        message=f"waiting for a busy GPU that holds {spec.service}: sooner than a {load_s:g} s restore costs"
    )
    return True


def _restore_cost(ctx: PassContext, w: Waiting, sizes: tuple[int, ...], pl: Placement, window: _Window,
                  soon: Soon, busy: dict[str, int]) -> float:
    """What restoring for ``w`` now costs in summed completion time, beyond running it on
    ``pl`` right away: its restore (and, at another size, the difference in run time), the
    restore's GPU-seconds taken from the calls behind, and the waits of wanted victims
    (``_wait_for_resident``). Over ``sizes``, the cheapest size a free chunk has room for
    (the victims are those of ``pl``, the smallest size's chunk)."""
    svc = ctx.gpu.services[w.spec.service]
    gpus = free = 0
    for name, gn in ctx.gpu.nodes.items():
        gpus += gn.count
        free += gn.count - busy[name].bit_count()
    queued = max(0, window.total - (free - pl.size))  # the calls behind that find no free GPU
    per_gpu = prewake.enabled(ctx)  # a restore on u GPUs takes u x its time from the calls behind
    load_s, mine = svc.load(pl.size), ctx.estimate(w.spec, pl.size)
    cost = min(
        svc.load(u) * (1.0 + (u if per_gpu else 1) * queued / gpus) + (ctx.estimate(w.spec, u) - mine)
        for u in sizes if u == pl.size or _free_chunk(ctx, u, busy)
    )
    for victim in pl.evict:
        service, _, vsize = victim
        if (service, vsize) not in window.count or _free_copy(ctx, victim, pl.node, busy):
            continue
        later = load_s + mine + ctx.gpu.services[service].load(vsize)  # after this call, restored again
        vf = _frees(ctx, soon, service, vsize)
        cost += min(vf[0] - ctx.now, later) if vf else later
    return cost


def _free_chunk(ctx: PassContext, size: int, busy: dict[str, int]) -> bool:
    """Whether some node has a free aligned chunk of ``size`` GPUs in this pass."""
    for name, gn in ctx.gpu.nodes.items():
        b = busy[name]
        if any(gn.is_free(start, size, b) for start in range(0, gn.count - size + 1, size)):
            return True
    return False


def _first_copy(
    ctx: PassContext, soon: Soon, spec: ActionSpec, sizes: tuple[int, ...]
) -> tuple[list[float], float] | None:
    """Over the busy copies of the call's service at ``sizes``, the one the call would finish
    on first: that size's heap in ``soon`` (its first entry is the copy) and the call's run there."""
    best: tuple[float, list[float], float] | None = None
    for u in sizes:
        frees = _frees(ctx, soon, spec.service, u)
        if frees:
            run_s = ctx.estimate(spec, u)
            if best is None or frees[0] + run_s < best[0]:
                best = (frees[0] + run_s, frees, run_s)
    return None if best is None else best[1:]


def _free_copy(ctx: PassContext, victim: Instance, node: str, busy: dict[str, int]) -> bool:
    """Whether a chunk other than the victim's, free in this pass, holds its (service, size)."""
    service, start, size = victim
    for name, gn in ctx.gpu.nodes.items():
        for v, s, z in gn.resident:
            if v == service and z == size and (name, s) != (node, start) and gn.is_free(s, z, busy[name]):
                return True
    return False


def _start_group(ctx: PassContext, node: str, group: list[Waiting], behind: list[Waiting],
                 wants: dict[str, frozenset[tuple[str, int]]], out: list[cmd.Command],
                 fair: jobs.Fair | None = None) -> None:
    gnode = ctx.gpu.nodes[node]
    sizes = _sizes(ctx, gnode, group, behind)
    for w, size in zip(group, sizes, strict=False):
        if size == 0:
            w.status = wait(message="held back: starting it now would raise the summed completion time")
            continue
        if fair is not None:  # a larger chunk stops at the job's GPU cap
            size = fair.clamp(w, size, w.spec.key_demand)
        wanted = wants.get(w.spec.action_id, frozenset())
        pl = ctx.gpu.choose(w.spec.service, size, {}, set(), only=node, wanted=wanted)
        if pl is None and size != chunk_size(w.spec.key_demand.min):
            pl = ctx.gpu.choose(w.spec.service, chunk_size(w.spec.key_demand.min), {}, set(), only=node,
                                  wanted=wanted)
        if pl is None:
            w.status = wait(message=f"no aligned chunk free on {node} after fragmentation")
            continue
        ctx.dequeue(w.spec.action_id)
        _start_call(ctx, w, pl, out)


def _sizes(ctx: PassContext, gnode: GpuNode, group: list[Waiting], behind: list[Waiting]) -> list[int]:
    """Chunk size per candidate on one node (0: held back)."""
    mins = [chunk_size(w.spec.key_demand.min) for w in group]
    free = gnode.count - gnode.busy.bit_count()
    options = [_options(ctx, w.spec, free) for w in group]
    if prewake.enabled(ctx):
        options = [prewake.sized(ctx, gnode, w, o) for w, o in zip(group, options, strict=True)]
    if all(len(o) == 1 for o in options):
        return [next(iter(o)) for o in options]
    table = DPTable(options, _operator(ctx, gnode.free_chunks()))
    n = len(group)
    if not table.feasible(n):
        return mins
    if ctx.config.policy != TANGRAM or not ctx.config.eviction:
        return list(table.best(n)[1])
    running = [(r.est_end - ctx.now, r.units) for r in ctx.running.on(gnode.name, Kind.CALL).values()]
    cand_behind = [ctx.behind(w) for w in group]
    rest = [ctx.behind(w) for w in behind[: ctx.config.behind_limit]]
    return greedy_eviction(table, options, running, cand_behind, rest, free, ctx.config.depth)


def _options(ctx: PassContext, spec: ActionSpec, free: int) -> dict[int, float]:
    d = spec.key_demand
    fitting = {chunk_size(u) for u in d.options() if chunk_size(u) <= max(free, 1)}
    sizes = sorted(fitting) or [chunk_size(d.min)]
    base = chunk_size(d.min)
    policy = ctx.config.policy
    if not d.elastic or policy == MIN:
        return {base: ctx.estimate(spec, base)}
    if policy == FIXED and ctx.config.fixed_dop:
        k = chunk_size(min(max(ctx.config.fixed_dop, d.min), d.max))
        return {k: ctx.estimate(spec, k)} if k in sizes else {base: ctx.estimate(spec, base)}
    if policy == MAX:
        return {sizes[-1]: ctx.estimate(spec, sizes[-1])}
    if ctx.t_ori(spec) is None or spec.elasticity is None:
        return {base: ctx.estimate(spec, base)}
    return {s: ctx.estimate(spec, s) for s in sizes}


def _start_call(ctx: PassContext, w: Waiting, pl: Placement, out: list[cmd.Command]) -> None:
    spec = w.spec
    node = ctx.gpu.nodes[pl.node]
    svc = ctx.gpu.services[spec.service]
    inst = (spec.service, pl.start, pl.size)
    for victim in pl.evict:
        node.drop_resident(victim)
        out.append(cmd.Evict(pl.node, victim[0], victim[1], victim[1] + victim[2]))
    stamp = float(ctx.stamp())
    load_s = 0.0
    if not pl.resident:
        node.add_resident(inst, svc.mem(pl.size), stamp)
        load_s = svc.load(pl.size)
        out.append(cmd.Load(pl.node, spec.service, pl.start, pl.start + pl.size, load_s))
    node.take(inst, stamp)
    est = load_s + ctx.estimate(spec, pl.size)
    r = Running(spec, pl.node, pl.size, ctx.now, ctx.now + est, chunk=(pl.start, pl.size), load_s=load_s,
                deadline=w.deadline)
    ctx.start(r)
    ctx.count("loads", 0 if pl.resident else 1)
    out.append(cmd.Invoke(spec.action_id, pl.node, spec.service, pl.start, pl.start + pl.size, est))


def _operator(ctx: PassContext, view: FreeView) -> ChunkOperator:
    """The chunk DP operator for a free-chunk layout; built once per distinct layout (its
    states' packability check is the costly part) and kept on the scheduler."""
    key = (view.max_chunk, tuple(sorted(view.free_sizes().items())))
    op = ctx.chunk_operators.get(key)
    if op is None:
        op = ctx.chunk_operators[key] = ChunkOperator(view)
    return op
