"""The scheduler: one pure state machine for every driver (Algorithm 1: docs/scheduler.md).

``Scheduler.handle(event, now)`` applies one event and returns the commands to carry out,
in order; ``next_deadline()`` says when it next needs a ``Tick``. Numbered rules:

1. No I/O, no clock, no global random: ``now`` comes in, commands go out; ties are broken
   by submission order and names, never by hash order, so a trace replays identically.
2. Queues are FCFS *per pool*: CPU per node (a new trajectory's first action goes to the
   node-less queue), GPU, and each API. A waiting action blocks only its own pool, so an
   action waiting on an API quota never blocks CPU work (no cross-pool head-of-line).
3. Each pass takes the longest FCFS prefix whose minimums fit (Algorithm 1), hands spare
   units to elastic candidates with DPArrange (Algorithm 3, or the exact convex greedy),
   and drops candidates from the tail while ApproxACTs (Algorithm 2) improves.
4. A demand no registered node could ever hold is rejected at once (NO_CAPACITY); nothing
   that can fit waits forever, since every pass serves the head of each queue first.
5. Resources are only taken by start commands and only returned by ``ActionFinished``,
   cancellation of a queued action, lease expiry, sandbox close, or node loss.

This module holds the ``Scheduler`` itself: its state, the event handlers, admission,
endings, deadlines and the read-only views. The two resource passes live beside it as plain
functions over a ``PassContext`` (``context.py``, each piece through its one owner):
``cpu_pass.py`` (per-node FCFS merge, placement, greedy eviction, reserved sandboxes) and
``gpu_pass.py`` (FCFS prefix, chunk DP, wait-for-resident). ``queues.py`` owns the queued
actions (``Pending``), ``state.py`` the records and policy names, re-exported here. No event
costs time in proportion to the queues (``docs/scheduler.md``, "Speed").
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from random import Random

from tangram.core import api_pass, cpu_pass, gpu_pass, jobs, staging, views
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, DurationHistory, Kind, duration
from tangram.core.approx import Behind
from tangram.core.context import PassContext
from tangram.core.managers.basic import BasicManager
from tangram.core.managers.cpu import CpuManager
from tangram.core.managers.gpu import SIZES, GpuManager, ServiceInfo, chunk_size
from tangram.core.queues import Pending
from tangram.core.resources import CPU, GPU, Demand, is_api, valid_resource
from tangram.core.state import (
    FIXED,
    MAX,
    MIN,
    TANGRAM,
    QueueRow,
    Running,
    RunningTable,
    Sandbox,
    Snapshot,
    Waiting,
)
from tangram.core.status import ADMITTED, Shortfall, Status, never

__all__ = [
    "FIXED", "MAX", "MIN", "TANGRAM", "CoreConfig", "QueueRow", "Running", "Sandbox", "Scheduler", "Snapshot",
    "Waiting",
]


@dataclass(frozen=True)
class CoreConfig:
    """``policy``: ``tangram`` (elastic, the paper's scheduler), ``min`` (always the
    minimum), ``max`` (always the maximum that is free) or ``fixed`` (``fixed_dop`` units)."""

    depth: int = 2
    policy: str = TANGRAM
    fixed_dop: int = 0
    eviction: bool = True
    lease_ttl_s: float = 300.0
    default_duration_s: float = 1.0
    behind_limit: int = 32
    cache_aware: bool = True  # False: GPU chunks chosen ignoring residency (the serverless baseline)
    prewake: bool = True  # restore GPU services ahead of waiting calls (prewake.py); False: the old results
    stage: bool = False  # decide a blocked node's next execs before their cores free (staging.py)
    stage_within_s: float = 0.05  # ... only behind runs expected to end within this (staging.py)
    stage_depth: int = 2  # ... at most this many staged behind one running exec


class Scheduler:
    def __init__(self, config: CoreConfig | None = None, seed: int = 0) -> None:
        self.config = config or CoreConfig()
        self.random = Random(seed)  # private; tie-breaks that need it stay reproducible
        self.cpu = CpuManager()
        self.gpu = GpuManager(cache_aware=self.config.cache_aware)
        self.basic = BasicManager()
        self.history = DurationHistory(default_s=self.config.default_duration_s)
        self.pending = Pending()  # the queued actions: by pool, per lane in seq order, by sandbox and client
        self.running = RunningTable()
        self.stages = staging.Stages()  # execs decided to start on a running one's cores when it ends
        self.jobs = jobs.JobBook()  # RL jobs: weights, caps, what each holds (fed by the running table)
        self.running.on_start = lambda r: self.jobs.on_start(r, self.now)
        self.running.on_end = lambda r: self.jobs.on_end(r, self.now)
        self.cpu.on_bind = lambda sb, mib: self.jobs.on_bind(sb, self.sandboxes[sb].client, mib)
        self.cpu.on_unbind = self.jobs.on_unbind
        self._behind_memo: dict[tuple[object, ...], Behind] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        self._client_sandboxes: dict[str, dict[str, None]] = {}  # client -> its open sandboxes
        self._held: dict[str, str] = {}  # exec held for its sandbox's reservation -> the sandbox
        self.now = 0.0
        self._seq = 0
        self._deadlines: list[tuple[float, int, str]] = []
        self._dirty: set[str] = set()
        self.counters: dict[str, int] = {}
        # queued actions read by the passes, per pool: a cost meter for tests (a pass over a
        # long queue must read only the part that can start plus a bounded look-ahead)
        self.examined: dict[str, int] = {}
        self._ctx = PassContext(self)  # what the passes see of all this

    @property
    def queues(self) -> dict[str, dict[str, Waiting]]:
        """The queued actions per pool (``cpu``, ``gpu``, ``api:<name>``), in submission
        order: a read-only view (``pending`` owns them)."""
        return self.pending.pools

    # -- public contract -----------------------------------------------------------------
    def handle(self, event: ev.Event, now: float, decide: bool = True) -> list[cmd.Command]:
        """Apply ``event`` at time ``now`` and return the commands to carry out, in order.
        ``decide=False``: apply it only and leave the passes to a later call, so a batch of
        events is decided once, whole (``docs/scheduler.md``, "Batches"). Raises
        ``cmd.DecisionFailed`` (with the commands emitted before the error) if a step raises."""
        self.now = max(self.now, now)
        out: list[cmd.Command] = []
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not an event: {event!r}")
        with cmd.DecisionFailed.keeping(out, self._dirty, self.queues):
            handler(self, event, out)
        if not decide:
            return out
        with cmd.DecisionFailed.keeping(out, self._dirty, self.queues):
            out.extend(self.decide(now))
        return out

    def decide(self, now: float) -> list[cmd.Command]:
        """What ``handle(..., decide=False)`` left: expiries and the passes, at ``now``."""
        self.now = max(self.now, now)
        out: list[cmd.Command] = []
        with cmd.DecisionFailed.keeping(out, self._dirty, self.queues):
            self._expire(out)
            if self._ctx.end_warms():  # GPU chunks restored ahead of their calls (prewake.py)
                self._dirty.add(GPU)
            self._schedule(out)
        return out

    def next_deadline(self) -> float | None:
        """The earliest time at which a ``Tick`` may change something, or None."""
        while self._deadlines:
            t, _, aid = self._deadlines[0]
            if self._deadline_live(aid, t):
                break
            heapq.heappop(self._deadlines)
        times = [self._deadlines[0][0]] if self._deadlines else []
        times.extend(api_pass.deadlines(self))  # quota windows, key windows and cool-downs
        times.extend(self._ctx.pass_deadlines())  # held CPU nodes, GPU warms
        return min(times) if times else None

    # -- events --------------------------------------------------------------------------
    def _on_node_joined(self, e: ev.NodeJoined, out: list[cmd.Command]) -> None:
        if e.cpus:
            self.cpu.add_node(e.node, tuple(sorted(e.cpus)), e.numa, e.mem_mib)
        if e.gpus:
            self.gpu.add_node(e.node, e.gpus, e.gpu_mem_mib)
        self._dirty.update(self.queues)

    def _on_node_lost(self, e: ev.NodeLost, out: list[cmd.Command]) -> None:
        staging.lose_node(self.stages, e.node, e.reason, out, self._ctx.count)
        for aid, r in sorted(self.running.on(e.node).items(), key=lambda kv: kv[1].started):
            sandboxed = r.spec.kind in (Kind.EXEC, Kind.OPEN)
            code = "SANDBOX_LOST" if sandboxed else "NODE_LOST"
            self._finish(aid, ok=False, reason=e.reason, out=out, release=False)
            out.append(cmd.Reject(aid, code, f"{e.node}: {e.reason}"))
        shrinks = self.cpu.frontier_shrinks(e.node) or self.gpu.frontier_shrinks(e.node)
        lost = self.cpu.remove_node(e.node)
        for s in lost:
            self.sandboxes[s].lost = True
        self.gpu.remove_node(e.node)
        if shrinks:  # the largest node of some shape left: every queued action is judged again
            suspects = [w for q in self.queues.values() for w in q.values()]
        else:  # nothing that fitted before stops fitting: only the lost sandboxes' actions go
            suspects = [w for s in lost for w in self.pending.of_sandbox(s)]
            suspects.sort(key=self.pending.walk_order())
        for w in suspects:
            aid, pool = w.spec.action_id, self._pool(w.spec)
            sb = self.sandboxes.get(w.spec.sandbox)
            if sb is not None and sb.lost:
                self._drop(pool, aid, out, "SANDBOX_LOST", f"sandbox {sb.sandbox} was on {e.node}: {e.reason}")
            elif (st := self._never(w.spec)) is not None:
                self._drop(pool, aid, out, "NO_CAPACITY", st.message, st.reasons)
        self._dirty.update(self.queues)

    def _on_service(self, e: ev.ServiceDefined, out: list[cmd.Command]) -> None:
        sizes = tuple(sorted(s for s in e.chunk_sizes if s in SIZES)) or (1,)
        per_size = tuple((int(s), int(m), float(t)) for s, m, t in e.per_size)
        self.gpu.define(ServiceInfo(e.service, e.gpu_mem_mib, sizes, e.load_s, e.t_ori, per_size))

    def _on_api(self, e: ev.ApiDefined, out: list[cmd.Command]) -> None:
        self.basic.define(e.api, e.mode, e.limit, e.period_s, e.keys)
        self._dirty.add(_api_pool(e.api))

    def _on_api_used(self, e: ev.ApiUsed, out: list[cmd.Command]) -> None:
        if (api := self.basic.apis.get(e.api)) is not None:
            api.spent(e.used, self.now - e.window_age_s, self.now)

    def _on_api_reported(self, e: ev.ApiReported, out: list[cmd.Command]) -> None:
        api_pass.report(self, e.action_id, e.tokens, e.limited, e.reset_s)

    def _on_sandbox_opened(self, e: ev.SandboxOpened, out: list[cmd.Command]) -> None:
        if e.sandbox in self.sandboxes:
            return
        self.sandboxes[e.sandbox] = Sandbox(e.sandbox, e.client, e.mem_mib, e.image, e.reserve, e.task)
        self._client_sandboxes.setdefault(e.client, {})[e.sandbox] = None
        if e.reserve > 0:
            spec = ActionSpec(
                action_id=f"open:{e.sandbox}", kind=Kind.OPEN, demand=((CPU, Demand.fixed(e.reserve)),),
                sandbox=e.sandbox, client=e.client, task=e.task, mem_mib=e.mem_mib,
            )
            self._submit(spec, out)

    def _on_sandbox_adopted(self, e: ev.SandboxAdopted, out: list[cmd.Command]) -> None:
        sb = self.sandboxes.get(e.sandbox)
        if sb is None or sb.lost or sb.node is not None or e.node not in self.cpu.nodes:
            return
        sb.node = e.node
        self.cpu.bind(e.sandbox, e.node, sb.mem_mib)
        self.pending.bind(e.sandbox, e.node)
        self._dirty.update(self.queues)

    def _on_sandbox_closed(self, e: ev.SandboxClosed, out: list[cmd.Command]) -> None:
        sb = self.sandboxes.pop(e.sandbox, None)
        if sb is None:
            return
        mine = self._client_sandboxes.get(sb.client, {})
        mine.pop(e.sandbox, None)
        if not mine:
            self._client_sandboxes.pop(sb.client, None)
        for w in self.pending.of_sandbox(e.sandbox):
            self._drop(self._pool(w.spec), w.spec.action_id, out, "CANCELLED", f"sandbox {e.sandbox} closed")
        for spec in sb.held:
            self._held.pop(spec.action_id, None)
            out.append(cmd.Reject(spec.action_id, "CANCELLED", f"sandbox {e.sandbox} closed"))
        for s in self.stages.of_sandbox(e.sandbox):
            self.stages.kill(s.w.spec.action_id, "sandbox closed", out)
        for aid, r in sorted(self.running.of_sandbox(e.sandbox).items(), key=lambda kv: kv[1].started):
            if r.spec.kind is Kind.OPEN:
                self._finish(aid, ok=True, reason="closed", out=out)
            elif not r.killed:
                r.killed = True
                out.append(cmd.Kill(aid, r.node, "sandbox closed"))
        node = self.cpu.unbind(e.sandbox)
        if node is not None and not sb.lost:
            out.append(cmd.DestroySandbox(node, e.sandbox))
        self._dirty.add(CPU)

    def _on_submitted(self, e: ev.ActionSubmitted, out: list[cmd.Command]) -> None:
        self._submit(e.spec, out)

    def _on_finished(self, e: ev.ActionFinished, out: list[cmd.Command]) -> None:
        r = self.running.get(e.action_id)
        if r is None:
            if e.action_id in self.stages:  # dropped unstarted by the agent (killed while staged)
                staging.end_unstarted(self.stages, e.action_id, e.ok, e.reason, out, self._ctx.count)
            return  # or stale or duplicate: the first report won
        if e.ok and r.spec.kind in (Kind.EXEC, Kind.CALL) and not r.killed:
            run_s = max(0.0, self.now - r.started - r.load_s)
            el = r.spec.elasticity
            factor = r.units * el.efficiency(r.units) if el is not None and r.units > 1 else 1.0
            self.history.record(r.spec.action_type, run_s * factor)
        self._finish(e.action_id, ok=e.ok, reason=e.reason, out=out)

    def _on_unstaged(self, e: ev.ActionUnstaged, out: list[cmd.Command]) -> None:
        staging.give_back(self.stages, e.action_id, self._requeue, out, self._ctx.count)

    def _requeue(self, w: Waiting) -> None:
        """A staged start given back: queued again in its place (same seq and deadline)."""
        self.pending.add(CPU, w, self._sub_key(w.spec))
        self._dirty.add(CPU)

    def _on_cancelled(self, e: ev.ActionCancelled, out: list[cmd.Command]) -> None:
        pool = self.pending.pool_of(e.action_id)
        if pool is not None:
            self._drop(pool, e.action_id, out, "CANCELLED", e.reason)
            return
        held_in = self.sandboxes.get(self._held.get(e.action_id, ""))
        for spec in held_in.held if held_in is not None else ():
            if spec.action_id == e.action_id:
                held_in.held.remove(spec)
                del self._held[e.action_id]
                out.append(cmd.Reject(e.action_id, "CANCELLED", e.reason))
                return
        r = self.running.get(e.action_id)
        if r is None:
            self.stages.kill(e.action_id, e.reason, out)
            return
        if r.spec.kind is Kind.LEASE:
            self._finish(e.action_id, ok=False, reason=e.reason, out=out)
        elif not r.killed:
            r.killed = True
            out.append(cmd.Kill(e.action_id, r.node, e.reason))

    def _on_service_evicted(self, e: ev.ServiceEvicted, out: list[cmd.Command]) -> None:
        node = self.gpu.nodes.get(e.node)
        if node is None:
            return
        if self._ctx.warming.cancel(e.node, e.service, e.start, self.gpu.nodes, float(self._ctx.stamp())):
            self._dirty.add(GPU)
        for inst in [i for i in node.resident if i[0] == e.service and i[1] == e.start]:
            if inst not in node.in_use:
                node.drop_resident(inst)

    def _on_client_gone(self, e: ev.ClientGone, out: list[cmd.Command]) -> None:
        for w in self.pending.of_client(e.client):
            self._drop(self._pool(w.spec), w.spec.action_id, out, "CANCELLED", "client gone")
        for aid, r in sorted(self.running.of_client(e.client).items(), key=lambda kv: kv[1].started):
            if r.spec.kind is Kind.LEASE:
                self._finish(aid, ok=False, reason="client gone", out=out)
        for name in sorted(self._client_sandboxes.get(e.client, {})):
            self._on_sandbox_closed(ev.SandboxClosed(name), out)
        self.jobs.leave(e.client)

    def _on_tick(self, e: ev.Tick, out: list[cmd.Command]) -> None:
        for name in self.basic.apis:
            self._dirty.add(_api_pool(name))
        due = [node for node, (_, t) in self._ctx.held.items() if t <= self.now]
        for node in due:  # a held node's plan expected a release by now: decide it again
            del self._ctx.held[node]
            self._dirty.add(CPU)

    # -- admission -----------------------------------------------------------------------
    def _submit(self, spec: ActionSpec, out: list[cmd.Command]) -> None:
        self.counters["submitted"] = self.counters.get("submitted", 0) + 1
        problem = self._malformed(spec)
        if problem is not None:
            out.append(cmd.Reject(spec.action_id, "BAD_REQUEST", problem))
            return
        sb = self.sandboxes.get(spec.sandbox) if spec.sandbox else None
        if sb is not None and sb.lost:
            out.append(cmd.Reject(spec.action_id, "SANDBOX_LOST", f"sandbox {sb.sandbox} was lost with its node"))
            return
        job, pool = self.jobs.job_of(spec.client), self._pool(spec)
        st = self._never(spec) or jobs.never_fits(self.jobs, spec, pool, job)
        if st is not None:
            self.counters["rejected"] = self.counters.get("rejected", 0) + 1
            out.append(cmd.Reject(spec.action_id, "NO_CAPACITY", st.message, st.reasons))
            return
        if spec.kind is Kind.EXEC and sb is not None and sb.reserve > 0:
            cpu_pass.exec_reserved(self._ctx, sb, spec, out)
            return
        self._seq += 1
        deadline = self.now + spec.timeout_s if spec.timeout_s > 0 else None
        w = Waiting(spec, self._seq, self.now, deadline, need=self._min_units(spec), job=job)
        self.pending.add(pool, w, self._sub_key(spec) if pool == CPU else "")
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, self._seq, spec.action_id))
        self._dirty.add(pool)

    def _malformed(self, spec: ActionSpec) -> str | None:
        if self._known(spec.action_id):
            return f"action id {spec.action_id!r} is already in use"
        for res, d in spec.demand:
            if not valid_resource(res):
                return f"unknown resource type {res!r}"
            if (p := d.problem()) is not None:
                return f"{res}: {p}"
        if spec.key not in dict(spec.demand):
            return f"the key resource {spec.key!r} has no demand"
        if spec.elasticity is not None and (p := spec.elasticity.problem()) is not None:
            return p
        if spec.kind in (Kind.EXEC, Kind.OPEN):
            if spec.kind is Kind.EXEC and spec.sandbox not in self.sandboxes:
                return f"unknown sandbox {spec.sandbox!r}: open it first"
            if spec.key_demand.min < 1:
                return "cpus must be >= 1"
        if spec.kind is Kind.CALL:
            d = spec.key_demand
            if any(u not in SIZES for u in d.options()):
                return f"gpus must be one of {SIZES}, got {list(d.options())}"
        if spec.kind is Kind.LEASE and spec.api not in self.basic.apis:
            known = ", ".join(sorted(self.basic.apis)) or "none"
            return f"unknown API {spec.api!r} (known: {known})"
        return None

    def _known(self, aid: str) -> bool:
        return aid in self.running or aid in self.pending or aid in self._held or aid in self.stages

    def _never(self, spec: ActionSpec) -> Status | None:
        """NO_CAPACITY status if no registered node could ever run ``spec``."""
        if spec.kind in (Kind.EXEC, Kind.OPEN):
            sb = self.sandboxes.get(spec.sandbox)
            need = spec.key_demand.min
            if sb is not None and sb.node is not None:
                node = self.cpu.nodes.get(sb.node)
                total = node.total if node else 0
                if total < need:
                    return never(Shortfall(CPU, need, total, total, sb.node), message="its sandbox's node is too small")
                return None
            mem = sb.mem_mib if sb is not None else spec.mem_mib
            short = self.cpu.never_fits(need, mem)
            return None if short is None else never(short, message="no node is large enough")
        if spec.kind is Kind.CALL:
            why = self.gpu.never_fits(spec.service, chunk_size(spec.key_demand.min))
            if why is None:
                return None
            cap = max((n.count for n in self.gpu.nodes.values()), default=0)
            return never(Shortfall(GPU, spec.key_demand.min, cap, cap, "largest node"), message=why)
        if spec.kind is Kind.LEASE:
            return api_pass.never_fits(self, spec)
        return None

    def _pool(self, spec: ActionSpec) -> str:
        if spec.kind is Kind.LEASE:
            return _api_pool(spec.api)
        return GPU if spec.kind is Kind.CALL else CPU

    # -- scheduling passes ---------------------------------------------------------------
    def _schedule(self, out: list[cmd.Command]) -> None:
        dirty, self._dirty = self._dirty, set()
        for pool in sorted(dirty):
            if not self.queues.get(pool):
                continue
            if pool == CPU:
                cpu_pass.run(self._ctx, out)
            elif pool == GPU:
                gpu_pass.run(self._ctx, out)
            elif is_api(pool):
                api_pass.run(self, pool, out)

    # -- duration model (shared by admission and both passes) ------------------------------
    def _min_units(self, spec: ActionSpec) -> int:
        """The fewest units the policy starts ``spec`` with (fixed DoP: exactly K)."""
        d = spec.key_demand
        if self.config.policy == FIXED and self.config.fixed_dop > 0 and d.elastic and spec.kind is Kind.EXEC:
            k = min(max(self.config.fixed_dop, d.min), d.max)
            return k if d.allows(k) else d.min
        return d.min

    def _behind(self, spec: ActionSpec) -> Behind:
        """The action as a waiting one in ApproxACTs: (units, estimate) options, memoised
        on what they depend on (the key demand, the elasticity and the current T_ori)."""
        key = (spec.key_demand, spec.elasticity, self._t_ori(spec))
        b = self._behind_memo.get(key)
        if b is None:
            if len(self._behind_memo) >= 4096:
                self._behind_memo.clear()
            b = self._behind_memo[key] = self._behind_new(spec)
        return b

    def _behind_of(self, w: Waiting) -> Behind:
        """``_behind`` of a queued action, kept on it until its T_ori changes."""
        t = self._t_ori(w.spec)
        got = w.memo.get("behind")
        if got is not None and got[0] == t:  # type: ignore[index]
            return got[1]  # type: ignore[index,no-any-return]
        b = self._behind(w.spec)
        w.memo["behind"] = (t, b)
        return b

    def _behind_new(self, spec: ActionSpec) -> Behind:
        d = spec.key_demand
        opts = [d.min]
        if d.elastic and self.config.policy == TANGRAM:
            u = 2
            while u < d.max:
                if u > d.min and d.allows(u):
                    opts.append(u)
                u *= 2
            opts.append(d.max)
        return Behind(tuple((u, self._estimate(spec, u)) for u in dict.fromkeys(opts)))

    def _t_ori(self, spec: ActionSpec) -> float | None:
        """Profiled T_ori (the action's, else its service's), else the type's history."""
        if spec.t_ori is None and spec.kind is Kind.CALL:
            svc = self.gpu.services.get(spec.service)
            if svc is not None and svc.t_ori is not None:
                return svc.t_ori
        return self.history.t_ori(spec)

    def _estimate(self, spec: ActionSpec, units: int) -> float:
        t = self._t_ori(spec)
        t_ori = self.config.default_duration_s if t is None else t
        return duration(t_ori, spec.elasticity, units) if spec.elasticity is not None else t_ori

    # -- endings -------------------------------------------------------------------------
    def _finish(self, aid: str, ok: bool, reason: str, out: list[cmd.Command], release: bool = True) -> None:
        r = self.running.pop(aid)
        kind = r.spec.kind
        if self.stages.overran:
            self.stages.overran.discard(aid)
        if kind in (Kind.EXEC, Kind.OPEN) and r.units and release:
            follower = staging.promote(self.stages, r, self.now) if self.stages else None
            node = self.cpu.nodes.get(r.node)
            if follower is not None:  # a staged start: the cores pass to it
                self._ctx.start(follower)
            elif node is not None:
                node.give(r.cores)
            self._dirty.add(CPU)
        elif kind is Kind.CALL:
            node_g = self.gpu.nodes.get(r.node)
            if node_g is not None:
                self._seq += 1
                node_g.give((r.spec.service, *r.chunk), float(self._seq))
            self._dirty.add(GPU)
        elif kind is Kind.LEASE:
            api = self.basic.apis.get(r.spec.api)
            if api is not None:
                api.release(aid)
            self._dirty.add(_api_pool(r.spec.api))
        self.counters["finished" if ok else "failed"] = self.counters.get("finished" if ok else "failed", 0) + 1
        out.append(cmd.Done(aid, ok, reason))

    def _dequeue(self, pool: str, aid: str) -> None:
        self.pending.remove(aid)

    def _sub_key(self, spec: ActionSpec) -> str:
        sb = self.sandboxes.get(spec.sandbox)
        return sb.node if sb is not None and sb.node is not None else ""

    def _drop(self, pool: str, aid: str, out: list[cmd.Command], code: str, message: str,
              reasons: tuple[Shortfall, ...] = ()) -> None:
        self._dequeue(pool, aid)
        self._dirty.add(pool)
        out.append(cmd.Reject(aid, code, message, reasons))

    def _deadline_live(self, aid: str, t: float) -> bool:
        r = self.running.get(aid)
        if r is not None:
            return r.deadline == t and not r.killed
        if (staged := self.stages.deadline_live(aid, t)) is not None:
            return staged
        w = self.pending.get(aid)
        return w is not None and w.deadline == t

    def _expire(self, out: list[cmd.Command]) -> None:
        while self._deadlines and self._deadlines[0][0] <= self.now:
            t, _, aid = heapq.heappop(self._deadlines)
            if not self._deadline_live(aid, t):
                continue
            r = self.running.get(aid)
            if r is None:
                pool = self.pending.pool_of(aid)
                if pool is not None:
                    self._drop(pool, aid, out, "TIMEOUT", "timed out while queued")
                else:
                    self.stages.kill(aid, "timeout", out)
            elif r.spec.kind is Kind.LEASE:
                self._finish(aid, ok=False, reason="lease expired", out=out)
                out.append(cmd.Reject(aid, "TIMEOUT", "lease not released before its deadline: reclaimed"))
            else:
                r.killed = True
                out.append(cmd.Kill(aid, r.node, "timeout"))

    # -- views ---------------------------------------------------------------------------
    def status_of(self, aid: str) -> Status | None:
        w = self.pending.get(aid)
        if w is not None:
            return w.status
        return ADMITTED if aid in self.running or aid in self.stages else None

    def snapshot(self, limit: int | None = None, now: float | None = None) -> Snapshot:
        """A read-only view for status and metrics at ``now`` (``views.snapshot``)."""
        return views.snapshot(self, limit, now)


def _api_pool(name: str) -> str:
    return "api:" + name


_HANDLERS = {
    ev.NodeJoined: Scheduler._on_node_joined,
    ev.NodeLost: Scheduler._on_node_lost,
    ev.ServiceDefined: Scheduler._on_service,
    ev.ApiDefined: Scheduler._on_api,
    ev.ApiUsed: Scheduler._on_api_used,
    ev.ApiReported: Scheduler._on_api_reported,
    ev.KeyUsed: api_pass.on_key_used,
    ev.SandboxOpened: Scheduler._on_sandbox_opened,
    ev.SandboxClosed: Scheduler._on_sandbox_closed,
    ev.SandboxAdopted: Scheduler._on_sandbox_adopted,
    ev.ActionSubmitted: Scheduler._on_submitted,
    ev.ActionFinished: Scheduler._on_finished,
    ev.ActionUnstaged: Scheduler._on_unstaged,
    ev.ActionCancelled: Scheduler._on_cancelled,
    ev.ServiceEvicted: Scheduler._on_service_evicted,
    ev.ClientGone: Scheduler._on_client_gone,
    ev.JobDefined: jobs.on_defined,
    ev.JobJoined: jobs.on_joined,
    ev.Tick: Scheduler._on_tick,
}
