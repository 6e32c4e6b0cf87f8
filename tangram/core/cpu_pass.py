"""The CPU pass of the scheduler (Algorithm 1 per node) and the reserved-sandbox baseline.

Plain functions over a ``PassContext`` (``ctx``, ``context.py``); ``run`` is the pass, called by
``Scheduler._schedule``, and ``exec_reserved`` admits an exec into a reserved sandbox. The
per-node FCFS queues are merged in submission order, a new trajectory is placed on a node,
and each node's candidates get their units from DPArrange with greedy eviction
(``_allocate``); cores are picked on one NUMA domain by ``CpuNode.pick``.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core import staging
from tangram.core.actions import ActionSpec, Kind, duration
from tangram.core.approx import greedy_eviction
from tangram.core.dp import Curve, arrange_table, convex_curve
from tangram.core.jobs import Fair
from tangram.core.resources import CPU
from tangram.core.state import FIXED, MAX, MIN, TANGRAM, Running, Sandbox, Waiting, expected_left
from tangram.core.status import Shortfall, Status, never, wait

if TYPE_CHECKING:
    from tangram.core.context import PassContext


HELD = wait(message="held back: starting it now would raise the summed completion time")


def run(ctx: PassContext, out: list[cmd.Command]) -> None:
    """Algorithm 1 per node: FCFS prefixes whose minimums fit, then elastic DP.

    The CPU queue is kept per node (plus one queue of trajectories without a node yet);
    the pass merges them in submission order and stops reading a queue at its first
    action that does not fit, so a pass costs O(started + nodes), not O(queued). The
    actions behind a blocked head (ApproxACTs' queue) are read only for a node that has
    candidates. With several RL jobs each keeps its own queues, and the merge reads next
    from the job furthest below its weighted share (``jobs.py``; one job: plain FCFS)."""
    iters, heads = _open_queues(ctx)
    jobs_waiting = len(heads)
    nodes = ctx.cpu.nodes.values()
    fair = Fair(ctx.jobs, CPU, sum(n.total for n in nodes) if len(heads) > 1 else 0, heads,
                sum(n.mem_total for n in nodes) if len(heads) > 1 else 0)
    p = _Merge(ctx, fair)
    _merge(p, fair, iters, heads)
    # every node's units are decided before anything moves: a node's decision depends on
    # nothing that another node's starts, a binding or a rejection changes, and the queue
    # behind a blocked head is read (lazily, only if the decision needs it) while it is intact
    limited = fair if fair.limits() else None  # several jobs want cores, or one has a cap
    units = {node: _allocate(ctx, p.cands[node], partial(p.waiting, node), ctx.cpu.nodes[node].free, node,
                             limited)
             for node in sorted(p.cands)}
    if limited is not None:  # elastic grants stop at a job's share or cap, all its candidates together
        for node in sorted(p.cands):
            units[node] = [fair.clamp(w, u, w.spec.key_demand) if u else 0
                           for w, u in zip(p.cands[node], units[node], strict=True)]
    # what staging may start is read now too, while the queues are intact (a lane read after a
    # start or a binding is not): the blocked nodes whose head could be staged
    staged_queues = {node: p.waiting(node) for node in sorted(p.blocked)
                     if all(units.get(node, ())) and staging.worth(ctx, node, p.behind[node][0])
                     } if p.blocked and staging.allowed(ctx, jobs_waiting, limited is not None) else {}
    ctx.examined(CPU, sum(it.read for it in iters.values()))  # a cost meter
    for w, node, total in p.doomed:
        st = never(Shortfall(CPU, w.spec.key_demand.min, total, total, node),
                   message="its sandbox's node is too small")
        ctx.reject(CPU, w.spec.action_id, out, "NO_CAPACITY", st.message, st.reasons)
    for spec_sb, node in p.tentative.items():
        _bind_sandbox(ctx, spec_sb, node, out)
    for node in sorted(p.cands):
        _start_group(ctx, node, p.cands[node], units[node], out)
    for node, queue in staged_queues.items():  # not behind a candidate held back on it (FCFS)
        staging.stage(ctx, ctx.stages, node, queue, out)


def _merge(p: _Merge, fair: Fair, iters: dict[Key, _Peek], heads: dict[str, list[tuple[int, Key]]]) -> None:
    """Read the per-node queues into ``p``: the next action from the job furthest below its
    share (one job: the earliest head), each queue until its first action that does not fit.
    Several jobs' new trajectories are read in dominant-share order (``_next_read``)."""
    while heads:
        job, past_new = _next_read(p, fair, iters, heads) if len(heads) > 1 else (next(iter(heads)), False)
        heap = heads[job]
        new = heapq.heappop(heap) if past_new else None  # not its turn: read what comes after it
        _, key = heapq.heappop(heap)
        if new is not None:
            heapq.heappush(heap, new)
        src = iters[key]
        w = src.pop()
        if fair.over_cap(w, w.need):  # its job is passed over for the rest of the pass
            del heads[job]
            continue
        if p.step(key[0], w, src) and src.has_next():
            heapq.heappush(heap, (src.peek_seq(), key))
        if not heap:
            del heads[job]


def _next_read(p: _Merge, fair: Fair, iters: dict[Key, _Peek],
               heads: dict[str, list[tuple[int, Key]]]) -> tuple[str, bool]:
    """The job to read next from (``Fair.pick``, by cores), and whether its next action, a
    new trajectory, is passed for now: while several jobs have new trajectories to place,
    only those of the job furthest below its share of cores and memory are read
    (``Fair.pick_new``, weighted dominant-resource fairness); the others' come after them in
    this pass, and their jobs' actions in placed sandboxes are read meanwhile."""
    new = {j: seq for j, h in heads.items() for seq, key in h if not key[0] and p.is_new(iters[key].peek())}
    turn = fair.pick_new(new) if len(new) > 1 and p.placing is None else None
    seqs: dict[str, int] = {}
    passed: set[str] = set()
    for j, h in heads.items():
        if turn is None or j == turn or j not in new or h[0][1][0]:
            seqs[j] = h[0][0]
        elif len(h) > 1:  # its new trajectories come first in it: read the queue after them
            seqs[j] = min(h[1:3])[0]
            passed.add(j)
    job = fair.pick(seqs)
    return job, job in passed


class _Merge:
    """The state of one CPU pass while it merges the per-node queues."""

    def __init__(self, ctx: PassContext, fair: Fair) -> None:
        self.ctx = ctx
        self.fair = fair
        self.free = {n: node.free for n, node in ctx.cpu.nodes.items()}
        self.mem_free = {n: node.mem_free for n, node in ctx.cpu.nodes.items()}  # less this pass's placements
        self.cands: dict[str, list[Waiting]] = {}
        self.behind: dict[str, list[Waiting]] = {}
        # blocked node -> (where in behind, its reader) per queue of it (one per job)
        self.rest: dict[str, list[tuple[int, _Peek]]] = {}
        self.tentative: dict[str, str] = {}  # sandbox -> node chosen earlier in this pass
        self.blocked: set[str] = set()
        self.placing: Waiting | None = None  # a new trajectory that found no node: the others wait behind it
        self.doomed: list[tuple[Waiting, str, int]] = []  # heads their sandbox's node can never hold

    def waiting(self, node: str) -> list[Waiting]:
        """The actions behind ``node``'s candidates (at most ``behind_limit``), in FCFS order;
        the rest of its queue behind its blocked head is read on the first call."""
        behind = self.behind.setdefault(node, [])
        if node in self.rest:
            for at, src in reversed(self.rest.pop(node)):  # the last first: earlier places stay put
                behind[at:at] = src.take(self.ctx.config.behind_limit)
        return behind[: self.ctx.config.behind_limit]

    def _take(self, w: Waiting, node: str) -> None:
        self.cands.setdefault(node, []).append(w)
        self.free[node] -= w.need
        self.fair.take(w.job, w.need)

    def is_new(self, w: Waiting) -> bool:
        """Whether ``w``, read from the queue of trajectories without a node, is a new one (its
        sandbox was not placed earlier in this pass)."""
        return w.spec.sandbox not in self.tentative

    def step(self, key: str, w: Waiting, src: _Peek) -> bool:
        """Take ``w`` from queue ``key``; False when that queue is not read further."""
        node = key or self.tentative.get(w.spec.sandbox, "")
        if not node:
            return self._place(w)
        free = self.free.get(node, 0)
        if node not in self.blocked and free >= w.need:
            self._take(w, node)
            return True
        if node not in self.blocked:
            total = self.ctx.cpu.nodes[node].total
            if w.spec.key_demand.min > total:  # rejected after the merge; FCFS goes on without it
                self.doomed.append((w, node, total))
                return True
            self.blocked.add(node)
            w.status = wait(Shortfall(CPU, w.need, free, total, node))
        behind = self.behind.setdefault(node, [])
        behind.append(w)
        if key:  # the rest of this node's queue waits behind it
            self.rest.setdefault(node, []).append((len(behind), src))
            return False
        return True

    def _place(self, w: Waiting) -> bool:
        ctx = self.ctx
        if self.placing is not None:  # another job's new trajectory found no node first: FCFS behind it
            w.status = wait(message=f"behind {self.placing.spec.action_id}, a new trajectory that waits")
            return False
        sb = ctx.sandboxes.get(w.spec.sandbox)
        mem = sb.mem_mib if sb is not None else w.spec.mem_mib
        target = ctx.cpu.place(w.need, mem, self.free, self.blocked, self.mem_free)
        if target is None:
            w.status = _placement_shortfall(ctx, w.need, mem, self.free, self.mem_free)
            self.placing = w
            return False  # new trajectories queue FCFS behind this one
        self.tentative[w.spec.sandbox] = target
        self._take(w, target)
        self.mem_free[target] -= mem
        self.fair.take_mem(w.job, mem)
        return True


Key = tuple[str, str]  # a CPU queue: (node or "" for none yet, job)


def _open_queues(ctx: PassContext) -> tuple[dict[Key, _Peek], dict[str, list[tuple[int, Key]]]]:
    """A reader per non-empty per-node CPU queue, and per job a heap of (head's seq, queue key)."""
    iters: dict[Key, _Peek] = {}
    heads: dict[str, list[tuple[int, Key]]] = {}
    for key in ctx.pending.cpu_lanes():
        it = ctx.pending.cpu_queue(*key)
        first = next(it)
        heads.setdefault(key[1], []).append((first.seq, key))
        iters[key] = _Peek(first, it)
    for heap in heads.values():
        heapq.heapify(heap)
    return iters, heads


def _placement_shortfall(ctx: PassContext, need: int, mem: int, free: dict[str, int],
                         mem_free: dict[str, int]) -> Status:
    best_cores = max(free.values(), default=0)
    best_mem = max(mem_free.values(), default=0)
    total = max((n.total for n in ctx.cpu.nodes.values()), default=0)
    mem_total = max((n.mem_total for n in ctx.cpu.nodes.values()), default=0)
    reasons = []
    if best_cores < need:
        reasons.append(Shortfall(CPU, need, best_cores, total, "any node"))
    if best_mem < mem:
        reasons.append(Shortfall("mem", mem, best_mem, mem_total, "any node"))
    return wait(*reasons, message="no node has the cores and the trajectory's memory free together")


def _bind_sandbox(ctx: PassContext, sandbox: str, node: str, out: list[cmd.Command]) -> None:
    sb = ctx.sandboxes.get(sandbox)
    if sb is None or sb.node is not None:
        return
    sb.node = node
    ctx.cpu.bind(sb.sandbox, node, sb.mem_mib)
    out.append(cmd.CreateSandbox(node, sb.sandbox, sb.mem_mib, sb.image))
    ctx.bind(sb.sandbox, node)  # its queued actions follow it to the node's queue


def _start_group(ctx: PassContext, node: str, group: list[Waiting], units: list[int],
                 out: list[cmd.Command]) -> None:
    cpu_node = ctx.cpu.nodes[node]
    if group and not any(units):  # the head waits for more cores; FCFS keeps the rest behind it
        head = group[0]
        head.status = wait(Shortfall(CPU, head.spec.key_demand.max, cpu_node.free, cpu_node.total, node),
                           message=f"waiting for more cores: a run on the {cpu_node.free} free now would end later")
        behind_head = wait(message=f"behind {head.spec.action_id}, which waits for more cores on {node}")
        for w in group[1:]:
            w.status = behind_head
        return
    for w, u in zip(group, units, strict=True):
        if u == 0:
            w.status = HELD
            continue
        ctx.dequeue(w.spec.action_id)
        cores = cpu_node.pick(u)
        cpu_node.take(cores)
        est = ctx.estimate(w.spec, u)
        r = Running(w.spec, node, u, ctx.now, ctx.now + est, cores=cores, deadline=w.deadline)
        ctx.start(r)
        if w.spec.kind is Kind.OPEN:
            sb = ctx.sandboxes[w.spec.sandbox]
            sb.cores = cores
            out.append(cmd.Reserve(w.spec.action_id, node, sb.sandbox, cores))
            for held in sb.held:
                ctx.unhold(held.action_id)
                _spawn_reserved(ctx, sb, held, out)
            sb.held.clear()
        else:
            out.append(cmd.Spawn(w.spec.action_id, node, w.spec.sandbox, cores, u, est))


def _running_on(ctx: PassContext, node: str) -> list[tuple[float, int]]:
    """(expected time left, units) of the node's running execs. One past its estimate is
    expected to need its estimated duration again (memoryless), not to end this instant:
    otherwise a plan that waits for its cores looks free. A run with staged followers
    (``staging.py``) gives its units back only when they have ended too."""
    now, stages = ctx.now, ctx.stages
    return [
        (expected_left(r, now) + (stages.chain_s(r.spec.action_id) if stages else 0.0), r.units)
        for r in ctx.running.on(node, Kind.EXEC).values()
        if r.units
    ]


def _options(ctx: PassContext, spec: ActionSpec, spare: int) -> dict[int, float]:
    """Feasible units -> estimated duration, under the configured policy."""
    d = spec.key_demand
    t_ori = ctx.t_ori(spec)
    policy = ctx.config.policy
    if spec.kind is Kind.OPEN or not d.elastic:
        return {d.min: ctx.estimate(spec, d.min)}
    if policy == FIXED and ctx.config.fixed_dop > 0:
        k = ctx.min_units(spec)
        return {k: ctx.estimate(spec, k)}
    if policy == MIN or t_ori is None or spec.elasticity is None:
        return {d.min: ctx.estimate(spec, d.min)}
    useful = spec.elasticity.max_useful()
    cap = d.min + spare if useful is None else min(d.min + spare, max(useful, d.min))
    return {u: duration(t_ori, spec.elasticity, u) for u in d.clamp_max(cap).options()}


def _allocate(ctx: PassContext, group: list[Waiting], read_waiting: Callable[[], list[Waiting]],
              free_units: int, node: str, fair: Fair | None = None) -> list[int]:
    """Units per candidate (0: held back), via DPArrange and greedy eviction.
    ``read_waiting()``: the actions behind the candidates (ApproxACTs' queue), read only
    when the decision needs them. ``fair``: a candidate's units beyond its minimum stop at
    what its job's share or cap leaves (``jobs.Fair.limit``).

    Beyond the paper's loop (which never evicts the last candidate), the whole prefix may
    be held back when its head could use more units than are free now and ApproxACTs
    says that waiting for them finishes sooner: otherwise a long elastic run that meets one
    free core starts on it and keeps that DoP for its whole life."""
    if ctx.config.policy == MAX:
        return _greedy_max(group, free_units - sum(w.need for w in group))
    # a node that held its whole prefix is re-decided once something on it changes
    held = ctx.held.get(node)
    waiting = read_waiting() if held is not None else None
    if held is not None and held[0] == _held_key(ctx, node, free_units, group, waiting) and ctx.now < held[1]:
        return [0] * len(group)
    # each candidate may use what its predecessors' minimums leave: the units of the ones
    # behind it are its to take when greedy eviction holds those back
    options, curves, before = [], [], 0
    limits = [fair.limit(w.job) if fair is not None else None for w in group]
    for w, lim in zip(group, limits, strict=True):
        spare = free_units - before - w.need
        opts, curve = _memo_options(ctx, w, spare if lim is None else max(0, min(spare, lim)))
        options.append(opts)
        curves.append(curve)
        before += w.need
    table = arrange_table(options, free_units, curves)
    n = len(group)
    if ctx.config.policy != TANGRAM or not ctx.config.eviction or n == 0:
        return list(table.best(n)[1]) if n else []
    cand_behind = [ctx.behind(w) for w in group]
    grow = any(b.options[-1][0] > max(o) for b, o in zip(cand_behind, options, strict=True))  # wants more
    if not grow and (n == 1 or all(len(o) == 1 for o in options)):
        return list(table.best(n)[1])  # nothing to evict, or nothing elastic: minimums
    running = _running_on(ctx, node)
    waiting = read_waiting() if waiting is None else waiting
    behind = [ctx.behind(w) for w in waiting]
    # only the head may hold the prefix for more units (as a fixed DoP would wait at the
    # head): a later candidate that wants more is what tail eviction is for
    head_grows = cand_behind[0].options[-1][0] > max(options[0]) and (
        limits[0] is None or max(options[0]) < group[0].need + limits[0])  # not when its job's limit binds
    units = greedy_eviction(table, options, running, cand_behind, behind, free_units, ctx.config.depth,
                            hold_all=bool(running) and head_grows)
    if any(units):
        ctx.held.pop(node, None)
    else:  # re-decided when the node changes, or once the plan's first release is due
        due = ctx.now + min(t for t, _ in running)
        ctx.held[node] = (_held_key(ctx, node, free_units, group, waiting), due)
    return units


def _held_key(ctx: PassContext, node: str, free_units: int, group: list[Waiting],
              waiting: list[Waiting] | None) -> tuple[object, ...]:
    """What a held node's decision depended on: free units, starts and ends on it, the
    candidates and the queue behind them."""
    return (free_units, ctx.running.changes(node), [w.seq for w in group], [w.seq for w in waiting or ()])


def _memo_options(ctx: PassContext, w: Waiting, spare: int) -> tuple[dict[int, float], Curve | None]:
    """``_options`` of a waiting action and their convex curve (``dp.convex_curve``),
    memoised in ``w.memo`` until its T_ori changes (at most one entry per spare count)."""
    t = ctx.t_ori(w.spec)
    memo = w.memo
    if memo.get("t_ori", -1.0) != t:
        memo.clear()
        memo["t_ori"] = t
    key = ("options", spare if w.spec.key_demand.elastic else 0)
    o = memo.get(key)
    if o is None:
        opts = _options(ctx, w.spec, spare)
        o = memo[key] = (opts, convex_curve(opts))
    return o  # type: ignore[return-value]


def _greedy_max(group: list[Waiting], spare: int) -> list[int]:
    """Always-maximum baseline: in FCFS order each takes all it can of what is left."""
    units = []
    for w in group:
        d = w.spec.key_demand
        top = d.clamp_max(d.min + spare).max if d.elastic and w.spec.kind is Kind.EXEC else d.min
        spare -= top - d.min
        units.append(top)
    return units


def exec_reserved(ctx: PassContext, sb: Sandbox, spec: ActionSpec, out: list[cmd.Command]) -> None:
    if not sb.cores:
        ctx.hold(spec, sb.sandbox)
        return
    _spawn_reserved(ctx, sb, spec, out)


def _spawn_reserved(ctx: PassContext, sb: Sandbox, spec: ActionSpec, out: list[cmd.Command]) -> None:
    dop = max(1, min(len(sb.cores), spec.key_demand.max))
    est = ctx.estimate(spec, dop)
    deadline = ctx.now + spec.timeout_s if spec.timeout_s > 0 else None
    assert sb.node is not None
    ctx.start(Running(spec, sb.node, 0, ctx.now, ctx.now + est, deadline=deadline), counted=False)
    if deadline is not None:
        ctx.add_deadline(deadline, spec.action_id)
    out.append(cmd.Spawn(spec.action_id, sb.node, sb.sandbox, sb.cores, dop, est))


class _Peek:
    """An iterator over waiting actions with one item of look-ahead, read only when asked
    for (a queue whose head blocks costs one read)."""

    def __init__(self, first: Waiting, rest: Iterator[Waiting]) -> None:
        self._next: Waiting | None = first
        self._rest = rest
        self.read = 1  # actions read from the queue so far

    def pop(self) -> Waiting:
        w = self._next
        if w is None:
            w = next(self._rest)
            self.read += 1
        self._next = None
        return w

    def has_next(self) -> bool:
        if self._next is None:
            self._next = next(self._rest, None)
            self.read += self._next is not None
        return self._next is not None

    def peek(self, what: str = "peek") -> Waiting:
        if not self.has_next():
            raise IndexError(f"{what} on an exhausted queue")
        assert self._next is not None
        return self._next

    def peek_seq(self) -> int:
        return self.peek("peek_seq").seq

    def take(self, n: int) -> list[Waiting]:
        out = []
        while len(out) < n and self.has_next():
            out.append(self.pop())
        return out

