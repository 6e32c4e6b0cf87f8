"""GPU pre-wake: restore a service before the call that needs it can run (issue 14, item 2).

Without pre-wake a restore starts only when a call is chosen to run, so all of it lies on
that call's path. After the GPU pass has started what it could, ``run`` looks at the calls
still queued in the look-ahead window (the first ``behind_limit``, in FCFS order) and, for
each, at the copies of its service that will serve it: free resident copies (now), busy
ones (when their call ends, after the calls of the window already counted for them) and
copies being restored (when the restore ends), at every chunk size the call accepts. When a
restore started now on an idle chunk would let the call finish sooner than any of those
copies, the chunk is *warmed*: ``Evict`` (LRU victims) and ``Load`` now, no ``Invoke``. The
chunk is held until the restore's estimated end (a deadline of the scheduler); the call
then finds the service resident and runs with no restore on its path.

Rules:

1. Only idle chunks are warmed (free after this pass's starts): a warm never preempts and
   never takes units a call could start on now.
2. A warm never evicts an instance a call in the window could run on, and never holds the
   GPUs of such an instance (that call would wait behind the restore).
3. A warm ends at ``ready`` (its estimated end) or when its node reports the service gone
   (a failed load); the chunk is then free and the instance resident (or dropped). A chunk
   whose warm failed is not warmed again while its node stays (no retry loop). A live
   restore that runs longer than estimated only delays the call on that chunk, whose
   ``Invoke`` the node runs after the ``Load``.
4. For the warmed copies to be used, a pass with pre-wake on places a call on a free
   resident copy at any of its sizes first (``resident``), and sizes elastic calls with
   each non-resident size's restore added to its duration (``with_restores``).
5. Pure, like the rest of the core: times come from ``ctx.now`` and the services' restore
   estimates; ties go by node name and chunk start.
6. A copy that sits idle in the memory of GPUs that run another service's call counts as a
   copy that frees when that call ends (``shared_copies``), for the restore-or-wait choice
   of the GPU pass and for the supply here alike, when its service has no busy or warming
   copy of the size and it frees within one restore: the call waits for it instead of
   restoring a copy elsewhere, and no restore ahead is started for it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.actions import Kind
from tangram.core.managers.gpu import GpuNode, Instance, Placement, chunk_size
from tangram.core.state import TANGRAM, Waiting

if TYPE_CHECKING:
    from tangram.core.context import PassContext

Key = tuple[str, int]  # (service, chunk size)


@dataclass
class Warm:
    """A chunk being restored ahead of its call: held until ``ready``."""

    gnode: GpuNode
    inst: Instance
    ready: float


class Warming:
    """The chunks being warmed, by (node, start): one owner, kept on the ``PassContext``."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[str, int], Warm] = {}
        self.failed: dict[tuple[str, int], GpuNode] = {}  # chunks whose warm failed, on that node
        self.started = 0  # warms begun (a counter for tests and metrics)

    def __len__(self) -> int:
        return len(self.chunks)

    def begin(self, gnode: GpuNode, inst: Instance, mem: int, ready: float, stamp: float) -> None:
        gnode.add_resident(inst, mem, stamp)
        gnode.take(inst, stamp)
        self.chunks[(gnode.name, inst[1])] = Warm(gnode, inst, ready)
        self.started += 1

    def ready_times(self, service: str, size: int) -> list[float]:
        return [w.ready for w in self.chunks.values() if w.inst[0] == service and w.inst[2] == size]

    def deadlines(self) -> list[float]:
        return [w.ready for w in self.chunks.values()]

    def finish_due(self, now: float, live: dict[str, GpuNode], stamp: float) -> bool:
        """End every warm whose restore is due by ``now``; whether any ended."""
        due = sorted(k for k, w in self.chunks.items() if w.ready <= now)
        for k in due:
            self._end(self.chunks.pop(k), live, stamp, keep=True)
        return bool(due)

    def cancel(self, node: str, service: str, start: int, live: dict[str, GpuNode], stamp: float) -> bool:
        """The node reports ``service`` gone from ``start`` (a failed load): end that warm now
        and drop the instance. Whether there was one."""
        w = self.chunks.get((node, start))
        if w is None or w.inst[0] != service:
            return False
        del self.chunks[(node, start)]
        self.failed[(node, start)] = w.gnode
        self._end(w, live, stamp, keep=False)
        return True

    def usable(self, gnode: GpuNode, start: int) -> bool:
        """Whether a warm may use the chunk at ``start`` (rule 3: not after a failed one)."""
        return self.failed.get((gnode.name, start)) is not gnode

    @staticmethod
    def _end(w: Warm, live: dict[str, GpuNode], stamp: float, keep: bool) -> None:
        if live.get(w.gnode.name) is not w.gnode:
            return  # the node left (or came back as a new one): nothing of it to give back
        w.gnode.give(w.inst, stamp)
        if not keep:
            w.gnode.drop_resident(w.inst)


def enabled(ctx: PassContext) -> bool:
    c = ctx.config
    return c.prewake and c.cache_aware and c.policy == TANGRAM


def sizes_of(w: Waiting, ctx: PassContext) -> tuple[int, ...]:
    """The chunk sizes a queued call may be given, smallest first: every size it accepts
    (that its service defines) when its duration is known to shrink with more GPUs, else
    its minimum (as the GPU pass sizes it: unknown elasticity gets the minimum)."""
    svc = ctx.gpu.services[w.spec.service]
    d = w.spec.key_demand
    least = chunk_size(d.min)
    if not d.elastic or w.spec.elasticity is None or ctx.t_ori(w.spec) is None:
        return (least,)
    return tuple(sorted({s for u in d.options() if (s := chunk_size(u)) in svc.chunk_sizes or s == least}))


def resident(ctx: PassContext, w: Waiting, busy: dict[str, int]) -> Placement | None:
    """A free chunk that holds the call's service at one of its sizes (the largest such
    size first), given the pass's tentative busy masks; None if there is none (rule 4)."""
    service = w.spec.service
    for size in reversed(sizes_of(w, ctx)):
        for name in sorted(ctx.gpu.nodes):
            gn = ctx.gpu.nodes[name]
            b = busy.get(name, gn.busy)
            starts = sorted(
                s for v, s, z in gn.resident if v == service and z == size and gn.is_free(s, z, b)
            )
            if starts:
                return Placement(name, starts[0], size, (), True)
    return None


def sized(ctx: PassContext, gnode: GpuNode, w: Waiting, options: dict[int, float]) -> dict[int, float]:
    """A call's duration per chunk size on ``gnode`` (rule 4): with the restore added to
    every size that no free chunk of the node holds."""
    if len(options) == 1:
        return options
    svc = ctx.gpu.services[w.spec.service]
    free_res = {z for v, s, z in gnode.resident if v == w.spec.service and gnode.is_free(s, z)}
    return {u: t + (0.0 if u in free_res else svc.load(u)) for u, t in options.items()}


def run(ctx: PassContext, read: Iterable[Waiting], out: list[cmd.Command]) -> None:
    """Warm idle chunks for the calls still queued in the window: the first ``behind_limit``
    of the calls the pass ``read`` that did not start (see the module rules). Reads nothing
    more of the queue."""
    window = list(islice((w for w in read if w.spec.action_id in ctx.pending), ctx.config.behind_limit))
    if not window or not _any_idle(ctx):
        return
    wanted = {(w.spec.service, z) for w in window for z in sizes_of(w, ctx)}
    supply = _Supply(ctx)
    for w in window:
        sizes = sizes_of(w, ctx)
        wait_end, wait_key = supply.earliest(w, sizes)
        warm = _best_warm(ctx, w, sizes, wanted, wait_end)
        if warm is not None:
            ready = _begin(ctx, w.spec.service, warm, out)
            supply.push((w.spec.service, warm.size), ready + ctx.estimate(w.spec, warm.size))
        elif wait_key is not None:
            supply.take(wait_key, wait_end)


def shared_copies(ctx: PassContext, service: str, size: int) -> list[float]:
    """When the idle copies of (service, size) whose GPUs run a call of another service (a GPU
    holds several instances in memory but runs one call at a time) free: when what runs on
    those GPUs ends (rule 6). Counted by ``gpu_pass._frees`` and ``_Supply`` only for a
    service with no busy or warming copy of that size, and only the copies that free within
    one restore of that size: waiting longer for GPUs that other services' calls want too is
    no surer than the restore. Of the idle copies on the same GPUs only the most recently used
    counts (those GPUs serve one of them next, not each)."""
    limit = ctx.now + ctx.gpu.services[service].load(size)
    out: list[float] = []
    for name, gn in ctx.gpu.nodes.items():
        if not gn.busy:
            continue
        idle = [(i, stamp) for i, stamp in gn.resident.items() if i not in gn.in_use]
        ends: dict[int, float] | None = None
        for inst, stamp in idle:
            _, start, z = inst
            if inst[0] != service or z != size or not gn.busy & gn.chunk_mask(start, z):
                continue  # a free copy is taken as a resident one by the pass itself
            if any(o[1] < start + z and start < o[1] + o[2] and t > stamp for o, t in idle if o != inst):
                continue
            if ends is None:
                ends = _gpu_ends(ctx, name)
            t = max(ends.get(g, ctx.now) for g in range(start, start + z))
            if t <= limit:
                out.append(t)
    return sorted(out)


def _gpu_ends(ctx: PassContext, node: str) -> dict[int, float]:
    """When each busy GPU of ``node`` frees: the estimated end of the call running on it, or
    of the restore ahead that holds it."""
    ends: dict[int, float] = {}
    spans = [(r.chunk, r.est_end) for r in ctx.running.on(node, Kind.CALL).values()]
    spans += [((w.inst[1], w.inst[2]), w.ready) for w in ctx.warming.chunks.values() if w.gnode.name == node]
    for (start, z), end in spans:
        for g in range(start, start + z):
            ends[g] = max(ends.get(g, 0.0), end)
    return ends


def _any_idle(ctx: PassContext) -> bool:
    return any(gn.busy != (1 << gn.count) - 1 for gn in ctx.gpu.nodes.values())


class _Supply:
    """When each copy of a (service, size) can next take a call: a heap of times per key,
    built when first asked: free resident copies now, busy ones when their call ends,
    warming ones when their restore ends."""

    def __init__(self, ctx: PassContext) -> None:
        self._ctx = ctx
        self._heaps: dict[Key, list[float]] = {}

    def heap(self, key: Key) -> list[float]:
        h = self._heaps.get(key)
        if h is None:
            h = self._heaps[key] = self._build(key)
        return h

    def _build(self, key: Key) -> list[float]:
        ctx, (service, size) = self._ctx, key
        now = ctx.now
        times = list(ctx.warming.ready_times(service, size))
        for name in sorted(ctx.gpu.nodes):
            gn = ctx.gpu.nodes[name]
            times.extend(now for v, s, z in gn.resident if v == service and z == size and gn.is_free(s, z))
            times.extend(
                max(now, r.est_end)
                for r in ctx.running.on(name, Kind.CALL).values()
                if r.spec.service == service and r.chunk[1] == size
            )
        if not times:
            times = shared_copies(ctx, service, size)
        heapq.heapify(times)
        return times

    def earliest(self, w: Waiting, sizes: Iterable[int]) -> tuple[float, Key | None]:
        """When the call would finish on the first copy free for it, and that copy's key."""
        best, key = math.inf, None
        for size in sizes:
            h = self.heap((w.spec.service, size))
            if h:
                end = max(self._ctx.now, h[0]) + self._ctx.estimate(w.spec, size)
                if end < best:
                    best, key = end, (w.spec.service, size)
        return best, key

    def take(self, key: Key, end: float) -> None:
        """The call was counted for the first copy of ``key``: that copy is free again at ``end``."""
        heapq.heapreplace(self.heap(key), end)

    def push(self, key: Key, at: float) -> None:
        heapq.heappush(self.heap(key), at)


def _best_warm(
    ctx: PassContext, w: Waiting, sizes: tuple[int, ...], wanted: set[Key], wait_end: float
) -> Placement | None:
    """The idle chunk whose restore, started now, lets ``w`` finish soonest, if that beats
    ``wait_end`` (its finish on the copies it would otherwise wait for)."""
    svc = ctx.gpu.services[w.spec.service]
    best: tuple[float, Placement] | None = None
    for size in sizes:
        end = ctx.now + svc.load(size) + ctx.estimate(w.spec, size)
        if end >= wait_end or (best is not None and end >= best[0]):
            continue
        pl = _idle_chunk(ctx, w.spec.service, size, wanted)
        if pl is not None:
            best = (end, pl)
    return None if best is None else best[1]


def _idle_chunk(ctx: PassContext, service: str, size: int, wanted: set[Key]) -> Placement | None:
    """A free chunk of ``size`` GPUs where ``service`` fits, evicting only instances no call
    in the window could use, on GPUs that hold no such instance (rule 2): fewest evictions,
    then the smallest enclosing free block, then node name and start."""
    svc = ctx.gpu.services[service]
    best: tuple[tuple[int, int, str, int], Placement] | None = None
    for name in sorted(ctx.gpu.nodes):
        gn = ctx.gpu.nodes[name]
        if size > gn.count or svc.mem(size) > gn.mem_mib:
            continue
        for start in range(0, gn.count - size + 1, size):
            if not gn.is_free(start, size) or _holds_wanted(gn, start, size, wanted):
                continue
            if not ctx.warming.usable(gn, start):
                continue
            evict = gn.evictions_for(svc, start, size)
            if evict is None:
                continue
            key = (len(evict), gn.enclosing_free_block(start, size, gn.busy), name, start)
            if best is None or key < best[0]:
                best = (key, Placement(name, start, size, evict, False))
    return None if best is None else best[1]


def _holds_wanted(gn: GpuNode, start: int, size: int, wanted: set[Key]) -> bool:
    end = start + size
    return any((v, z) in wanted and s < end and start < s + z for v, s, z in gn.resident)


def _begin(ctx: PassContext, service: str, pl: Placement, out: list[cmd.Command]) -> float:
    """Evict and load now; the chunk is held until the restore's estimated end."""
    gn = ctx.gpu.nodes[pl.node]
    svc = ctx.gpu.services[service]
    for victim in pl.evict:
        gn.drop_resident(victim)
        out.append(cmd.Evict(pl.node, victim[0], victim[1], victim[1] + victim[2]))
    load_s = svc.load(pl.size)
    ready = ctx.now + load_s
    ctx.warming.begin(gn, (service, pl.start, pl.size), svc.mem(pl.size), ready, float(ctx.stamp()))
    ctx.count("prewakes")
    out.append(cmd.Load(pl.node, service, pl.start, pl.start + pl.size, load_s))
    return ready
