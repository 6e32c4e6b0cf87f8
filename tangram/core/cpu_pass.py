"""The CPU pass of the scheduler (Algorithm 1 per node) and the reserved-sandbox baseline.

Plain functions over the ``Scheduler``'s state (``sched``); ``run`` is the pass, called by
``Scheduler._schedule``, and ``exec_reserved`` admits an exec into a reserved sandbox. The
per-node FCFS queues are merged in submission order, a new trajectory is placed on a node,
and each node's candidates get their units from DPArrange with greedy eviction
(``_allocate``); cores are picked on one NUMA domain by ``CpuNode.pick``.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.actions import ActionSpec, Kind, duration
from tangram.core.approx import greedy_eviction
from tangram.core.dp import arrange_table
from tangram.core.resources import CPU
from tangram.core.state import FIXED, MAX, MIN, TANGRAM, Running, Sandbox, Waiting
from tangram.core.status import Shortfall, Status, wait

if TYPE_CHECKING:
    from tangram.core.scheduler import Scheduler


HELD = wait(message="held back: starting it now would raise the summed completion time")


def run(sched: Scheduler, out: list[cmd.Command]) -> None:
    """Algorithm 1 per node: FCFS prefixes whose minimums fit, then elastic DP.

    The CPU queue is kept per node (plus one queue of trajectories without a node yet);
    the pass merges them in submission order and stops reading a queue at its first
    action that does not fit, so a pass costs O(started + nodes), not O(queued)."""
    free = {n: node.free for n, node in sched.cpu.nodes.items()}
    cands: dict[str, list[Waiting]] = {}
    behind: dict[str, list[Waiting]] = {}
    tentative: dict[str, str] = {}  # sandbox -> node chosen earlier in this pass
    iters, heads = _open_queues(sched)
    blocked: set[str] = set()
    while heads:
        _, key = heapq.heappop(heads)
        src = iters[key]
        w = src.pop()
        node = key or tentative.get(w.spec.sandbox, "")
        if node:
            if node in blocked or free.get(node, 0) < w.need:
                if node not in blocked:
                    blocked.add(node)
                    total = sched.cpu.nodes[node].total
                    w.status = wait(Shortfall(CPU, w.need, free.get(node, 0), total, node))
                behind.setdefault(node, []).append(w)
                if key:  # the rest of this node's queue waits behind it
                    behind[node].extend(src.take(sched.config.behind_limit))
                    continue
            else:
                cands.setdefault(node, []).append(w)
                free[node] -= w.need
        else:
            sb = sched.sandboxes.get(w.spec.sandbox)
            mem = sb.mem_mib if sb is not None else w.spec.mem_mib
            target = sched.cpu.place(w.need, mem, free, blocked)
            if target is None:
                w.status = _placement_shortfall(sched, w.need, mem, free)
                continue  # new trajectories queue FCFS behind this one
            tentative[w.spec.sandbox] = target
            cands.setdefault(target, []).append(w)
            free[target] -= w.need
        if src.has_next():
            heapq.heappush(heads, (src.peek_seq(), key))
    for spec_sb, node in tentative.items():
        _bind_sandbox(sched, spec_sb, node, out)
    for node in sorted(cands):
        _start_group(sched, node, cands[node], behind.get(node, []), out)


def _open_queues(sched: Scheduler) -> tuple[dict[str, _Peek], list[tuple[int, str]]]:
    """A reader per non-empty per-node CPU queue, and a heap of (head's seq, queue key)."""
    iters: dict[str, _Peek] = {}
    heads: list[tuple[int, str]] = []
    for key, q in sched._cpu_sub.items():
        if not q:
            continue
        it = iter(q.values())
        first = next(it, None)
        if first is not None:
            heads.append((first.seq, key))
            iters[key] = _Peek(first, it)
    heapq.heapify(heads)
    return iters, heads


def _placement_shortfall(sched: Scheduler, need: int, mem: int, free: dict[str, int]) -> Status:
    best_cores = max(free.values(), default=0)
    best_mem = max((n.mem_free for n in sched.cpu.nodes.values()), default=0)
    total = max((n.total for n in sched.cpu.nodes.values()), default=0)
    mem_total = max((n.mem_total for n in sched.cpu.nodes.values()), default=0)
    reasons = []
    if best_cores < need:
        reasons.append(Shortfall(CPU, need, best_cores, total, "any node"))
    if best_mem < mem:
        reasons.append(Shortfall("mem", mem, best_mem, mem_total, "any node"))
    return wait(*reasons, message="no node has the cores and the trajectory's memory free together")


def _bind_sandbox(sched: Scheduler, sandbox: str, node: str, out: list[cmd.Command]) -> None:
    sb = sched.sandboxes.get(sandbox)
    if sb is None or sb.node is not None:
        return
    sb.node = node
    sched.cpu.bind(sb.sandbox, node, sb.mem_mib)
    out.append(cmd.CreateSandbox(node, sb.sandbox, sb.mem_mib, sb.image))
    loose = sched._cpu_sub.get("", {})
    moved = [w for w in loose.values() if w.spec.sandbox == sb.sandbox]
    if moved:
        target = sched._cpu_sub.setdefault(node, {})
        for w in moved:
            del loose[w.spec.action_id]
        merged = sorted([*target.values(), *moved], key=lambda w: w.seq)
        sched._cpu_sub[node] = {w.spec.action_id: w for w in merged}


def _start_group(sched: Scheduler, node: str, group: list[Waiting], waiting: list[Waiting],
                 out: list[cmd.Command]) -> None:
    cpu_node = sched.cpu.nodes[node]
    units = _allocate(sched, group, waiting, cpu_node.free, node)
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
        sched._dequeue(CPU, w.spec.action_id)
        cores = cpu_node.pick(u)
        cpu_node.take(cores)
        est = sched._estimate(w.spec, u)
        r = Running(w.spec, node, u, sched.now, sched.now + est, cores=cores, deadline=w.deadline)
        sched.running[w.spec.action_id] = r
        sched.counters["started"] = sched.counters.get("started", 0) + 1
        if w.spec.kind is Kind.OPEN:
            sb = sched.sandboxes[w.spec.sandbox]
            sb.cores = cores
            out.append(cmd.Reserve(w.spec.action_id, node, sb.sandbox, cores))
            for held in sb.held:
                _spawn_reserved(sched, sb, held, out)
            sb.held.clear()
        else:
            out.append(cmd.Spawn(w.spec.action_id, node, w.spec.sandbox, cores, u, est))


def _running_on(sched: Scheduler, node: str) -> list[tuple[float, int]]:
    """(expected time left, units) of the node's running execs. One past its estimate is
    expected to need its estimated duration again (memoryless), not to end this instant:
    otherwise a plan that waits for its cores looks free."""
    now = sched.now
    return [
        (r.est_end - now if r.est_end > now else r.est_end - r.started, r.units)
        for r in sched.running.on(node).values()
        if r.spec.kind is Kind.EXEC and r.units
    ]


def _options(sched: Scheduler, spec: ActionSpec, spare: int) -> dict[int, float]:
    """Feasible units -> estimated duration, under the configured policy."""
    d = spec.key_demand
    t_ori = sched._t_ori(spec)
    policy = sched.config.policy
    if spec.kind is Kind.OPEN or not d.elastic:
        return {d.min: sched._estimate(spec, d.min)}
    if policy == FIXED and sched.config.fixed_dop > 0:
        k = sched._min_units(spec)
        return {k: sched._estimate(spec, k)}
    if policy == MIN or t_ori is None or spec.elasticity is None:
        return {d.min: sched._estimate(spec, d.min)}
    useful = spec.elasticity.max_useful()
    cap = d.min + spare if useful is None else min(d.min + spare, max(useful, d.min))
    return {u: duration(t_ori, spec.elasticity, u) for u in d.clamp_max(cap).options()}


def _allocate(sched: Scheduler, group: list[Waiting], waiting: list[Waiting], free_units: int,
              node: str) -> list[int]:
    """Units per candidate (0: held back), via DPArrange and greedy eviction.

    Beyond the paper's loop (which never evicts the last candidate), the whole prefix may
    be held back when its head could use more units than are free now and ApproxACTs
    says that waiting for them finishes sooner: otherwise a long elastic run that meets one
    free core starts on it and keeps that DoP for its whole life."""
    if sched.config.policy == MAX:
        return _greedy_max(group, free_units - sum(w.need for w in group))
    waiting = waiting[: sched.config.behind_limit]
    # a node that held its whole prefix is re-decided once something on it changes
    key = (free_units, sched.running.changes(node), [w.seq for w in group], [w.seq for w in waiting])
    held = sched._cpu_held.get(node)
    if held is not None and held[0] == key and sched.now < held[1]:
        return [0] * len(group)
    # each candidate may use what its predecessors' minimums leave: the units of the ones
    # behind it are its to take when greedy eviction holds those back
    options, before = [], 0
    for w in group:
        options.append(_memo_options(sched, w, free_units - before - w.need))
        before += w.need
    table = arrange_table(options, free_units)
    n = len(group)
    if sched.config.policy != TANGRAM or not sched.config.eviction or n == 0:
        return list(table.best(n)[1]) if n else []
    cand_behind = [sched._behind(w.spec) for w in group]
    grow = any(b.options[-1][0] > max(o) for b, o in zip(cand_behind, options, strict=True))  # wants more
    if not grow and (n == 1 or all(len(o) == 1 for o in options)):
        return list(table.best(n)[1])  # nothing to evict, or nothing elastic: minimums
    running = _running_on(sched, node)
    behind = [sched._behind(w.spec) for w in waiting]
    # only the head may hold the prefix for more units (as a fixed DoP would wait at the
    # head): a later candidate that wants more is what tail eviction is for
    head_grows = cand_behind[0].options[-1][0] > max(options[0])
    units = greedy_eviction(table, options, running, cand_behind, behind, free_units, sched.config.depth,
                            hold_all=bool(running) and head_grows)
    if any(units):
        sched._cpu_held.pop(node, None)
    else:  # re-decided when the node changes, or once the plan's first release is due
        sched._cpu_held[node] = (key, sched.now + min(t for t, _ in running))
    return units


def _memo_options(sched: Scheduler, w: Waiting, spare: int) -> dict[int, float]:
    """``_options`` of a waiting action, memoised in ``w.memo`` until its T_ori changes."""
    t = sched._t_ori(w.spec)
    memo = w.memo
    if memo.get("t_ori", -1.0) != t:
        memo.clear()
        memo["t_ori"] = t
    key = ("options", spare if w.spec.key_demand.elastic else 0)
    o = memo.get(key)
    if o is None:
        o = memo[key] = _options(sched, w.spec, spare)
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


def exec_reserved(sched: Scheduler, sb: Sandbox, spec: ActionSpec, out: list[cmd.Command]) -> None:
    if not sb.cores:
        sb.held.append(spec)
        return
    _spawn_reserved(sched, sb, spec, out)


def _spawn_reserved(sched: Scheduler, sb: Sandbox, spec: ActionSpec, out: list[cmd.Command]) -> None:
    dop = max(1, min(len(sb.cores), spec.key_demand.max))
    est = sched._estimate(spec, dop)
    deadline = sched.now + spec.timeout_s if spec.timeout_s > 0 else None
    assert sb.node is not None
    sched.running[spec.action_id] = Running(spec, sb.node, 0, sched.now, sched.now + est, deadline=deadline)
    if deadline is not None:
        sched._seq += 1
        heapq.heappush(sched._deadlines, (deadline, sched._seq, spec.action_id))
    out.append(cmd.Spawn(spec.action_id, sb.node, sb.sandbox, sb.cores, dop, est))


class _Peek:
    """An iterator over waiting actions with one item of look-ahead."""

    def __init__(self, first: Waiting, rest: object) -> None:
        self._next: Waiting | None = first
        self._rest = rest

    def pop(self) -> Waiting:
        w = self._next
        assert w is not None
        self._next = next(self._rest, None)  # type: ignore[call-overload]
        return w

    def has_next(self) -> bool:
        return self._next is not None

    def peek_seq(self) -> int:
        assert self._next is not None
        return self._next.seq

    def take(self, n: int) -> list[Waiting]:
        out = []
        while self._next is not None and len(out) < n:
            out.append(self.pop())
        return out

