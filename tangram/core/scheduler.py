"""The scheduler: one pure state machine for every driver (paper §4, Algorithm 1).

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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from random import Random

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, DurationHistory, Kind, duration
from tangram.core.approx import Behind, approx_acts
from tangram.core.dp import DPTable, arrange_table
from tangram.core.gpu import ChunkOperator, root_chunks
from tangram.core.managers.basic import BasicManager
from tangram.core.managers.cpu import CpuManager
from tangram.core.managers.gpu import SIZES, GpuManager, GpuNode, ServiceInfo, chunk_size
from tangram.core.resources import CPU, GPU, Demand, is_api, valid_resource
from tangram.core.status import ADMITTED, Code, Shortfall, Status, never, wait

TANGRAM, MIN, MAX, FIXED = "tangram", "min", "max", "fixed"


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


@dataclass
class Waiting:
    spec: ActionSpec
    seq: int
    submitted: float
    deadline: float | None
    status: Status = ADMITTED
    need: int = 0  # the policy's minimum units, fixed at submission


@dataclass
class Running:
    spec: ActionSpec
    node: str
    units: int
    started: float
    est_end: float
    cores: tuple[int, ...] = ()
    chunk: tuple[int, int] = (0, 0)  # (start, size)
    load_s: float = 0.0
    deadline: float | None = None
    killed: bool = False


@dataclass
class Sandbox:
    sandbox: str
    client: str
    mem_mib: int
    image: str
    reserve: int
    task: str
    node: str | None = None
    lost: bool = False
    cores: tuple[int, ...] = ()  # reserved cores (reserve > 0)
    held: list[ActionSpec] = field(default_factory=list)  # execs waiting for the reservation


@dataclass(frozen=True)
class QueueRow:
    action_id: str
    pool: str
    kind: str
    client: str
    waited_s: float
    demand: str
    status: str


@dataclass(frozen=True)
class Snapshot:
    now: float
    nodes: tuple[dict[str, object], ...]
    services: tuple[dict[str, object], ...]
    apis: tuple[dict[str, object], ...]
    queue: tuple[QueueRow, ...]
    queued: int
    running: int
    counters: tuple[tuple[str, int], ...]


class Scheduler:
    def __init__(self, config: CoreConfig | None = None, seed: int = 0) -> None:
        self.config = config or CoreConfig()
        self.random = Random(seed)  # private; tie-breaks that need it stay reproducible
        self.cpu = CpuManager()
        self.gpu = GpuManager(cache_aware=self.config.cache_aware)
        self.basic = BasicManager()
        self.history = DurationHistory(default_s=self.config.default_duration_s)
        self.queues: dict[str, dict[str, Waiting]] = {}
        self._cpu_sub: dict[str, dict[str, Waiting]] = {}  # CPU queue per node ("" = no node yet)
        self.running: dict[str, Running] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        self.now = 0.0
        self._seq = 0
        self._deadlines: list[tuple[float, int, str]] = []
        self._dirty: set[str] = set()
        self.counters: dict[str, int] = {}

    # -- public contract -----------------------------------------------------------------
    def handle(self, event: ev.Event, now: float) -> list[cmd.Command]:
        """Apply ``event`` at time ``now`` and return the commands to carry out, in order."""
        self.now = max(self.now, now)
        out: list[cmd.Command] = []
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not an event: {event!r}")
        handler(self, event, out)
        self._expire(out)
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
        for name, api in self.basic.apis.items():
            if self.queues.get(_api_pool(name)) and (t := api.next_window()) is not None:
                times.append(t)
        return min(times) if times else None

    # -- events --------------------------------------------------------------------------
    def _on_node_joined(self, e: ev.NodeJoined, out: list[cmd.Command]) -> None:
        if e.cpus:
            self.cpu.add_node(e.node, tuple(sorted(e.cpus)), e.numa, e.mem_mib)
        if e.gpus:
            self.gpu.add_node(e.node, e.gpus, e.gpu_mem_mib)
        self._dirty.update(self.queues)

    def _on_node_lost(self, e: ev.NodeLost, out: list[cmd.Command]) -> None:
        for aid, r in sorted(self.running.items(), key=lambda kv: kv[1].started):
            if r.node == e.node:
                sandboxed = r.spec.kind in (Kind.EXEC, Kind.OPEN)
                code = "SANDBOX_LOST" if sandboxed else "NODE_LOST"
                self._finish(aid, ok=False, reason=e.reason, out=out, release=False)
                out.append(cmd.Reject(aid, code, f"{e.node}: {e.reason}"))
        for s in self.cpu.remove_node(e.node):
            self.sandboxes[s].lost = True
        self.gpu.remove_node(e.node)
        for pool, queue in self.queues.items():
            for aid, w in list(queue.items()):
                sb = self.sandboxes.get(w.spec.sandbox)
                if sb is not None and sb.lost:
                    self._drop(pool, aid, out, "SANDBOX_LOST", f"sandbox {sb.sandbox} was on {e.node}: {e.reason}")
                elif (st := self._never(w.spec)) is not None:
                    self._drop(pool, aid, out, "NO_CAPACITY", st.message, st.reasons)
        self._dirty.update(self.queues)

    def _on_service(self, e: ev.ServiceDefined, out: list[cmd.Command]) -> None:
        sizes = tuple(sorted(s for s in e.chunk_sizes if s in SIZES)) or (1,)
        self.gpu.define(ServiceInfo(e.service, e.gpu_mem_mib, sizes, e.load_s, e.t_ori))

    def _on_api(self, e: ev.ApiDefined, out: list[cmd.Command]) -> None:
        self.basic.define(e.api, e.mode, e.limit, e.period_s)
        self._dirty.add(_api_pool(e.api))

    def _on_sandbox_opened(self, e: ev.SandboxOpened, out: list[cmd.Command]) -> None:
        if e.sandbox in self.sandboxes:
            return
        self.sandboxes[e.sandbox] = Sandbox(e.sandbox, e.client, e.mem_mib, e.image, e.reserve, e.task)
        if e.reserve > 0:
            spec = ActionSpec(
                action_id=f"open:{e.sandbox}", kind=Kind.OPEN, demand=((CPU, Demand.fixed(e.reserve)),),
                sandbox=e.sandbox, client=e.client, task=e.task, mem_mib=e.mem_mib,
            )
            self._submit(spec, out)

    def _on_sandbox_closed(self, e: ev.SandboxClosed, out: list[cmd.Command]) -> None:
        sb = self.sandboxes.pop(e.sandbox, None)
        if sb is None:
            return
        for pool, queue in self.queues.items():
            for aid, w in list(queue.items()):
                if w.spec.sandbox == e.sandbox:
                    self._drop(pool, aid, out, "CANCELLED", f"sandbox {e.sandbox} closed")
        for spec in sb.held:
            out.append(cmd.Reject(spec.action_id, "CANCELLED", f"sandbox {e.sandbox} closed"))
        for aid, r in sorted(self.running.items(), key=lambda kv: kv[1].started):
            if r.spec.sandbox != e.sandbox:
                continue
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
            return  # stale or duplicate: the first report won
        if e.ok and r.spec.kind in (Kind.EXEC, Kind.CALL) and not r.killed:
            run_s = max(0.0, self.now - r.started - r.load_s)
            el = r.spec.elasticity
            factor = r.units * el.efficiency(r.units) if el is not None and r.units > 1 else 1.0
            self.history.record(r.spec.action_type, run_s * factor)
        self._finish(e.action_id, ok=e.ok, reason=e.reason, out=out)

    def _on_cancelled(self, e: ev.ActionCancelled, out: list[cmd.Command]) -> None:
        for pool, queue in self.queues.items():
            if e.action_id in queue:
                self._drop(pool, e.action_id, out, "CANCELLED", e.reason)
                return
        for sb in self.sandboxes.values():
            for spec in sb.held:
                if spec.action_id == e.action_id:
                    sb.held.remove(spec)
                    out.append(cmd.Reject(e.action_id, "CANCELLED", e.reason))
                    return
        r = self.running.get(e.action_id)
        if r is None:
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
        for inst in [i for i in node.resident if i[0] == e.service and i[1] == e.start]:
            if inst not in node.in_use:
                node.drop_resident(inst)

    def _on_client_gone(self, e: ev.ClientGone, out: list[cmd.Command]) -> None:
        for pool, queue in self.queues.items():
            for aid, w in list(queue.items()):
                if w.spec.client == e.client:
                    self._drop(pool, aid, out, "CANCELLED", "client gone")
        for aid, r in sorted(self.running.items(), key=lambda kv: kv[1].started):
            if r.spec.client == e.client and r.spec.kind is Kind.LEASE:
                self._finish(aid, ok=False, reason="client gone", out=out)
        for name in sorted(s.sandbox for s in self.sandboxes.values() if s.client == e.client):
            self._on_sandbox_closed(ev.SandboxClosed(name), out)

    def _on_tick(self, e: ev.Tick, out: list[cmd.Command]) -> None:
        for name in self.basic.apis:
            self._dirty.add(_api_pool(name))

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
        st = self._never(spec)
        if st is not None:
            self.counters["rejected"] = self.counters.get("rejected", 0) + 1
            out.append(cmd.Reject(spec.action_id, "NO_CAPACITY", st.message, st.reasons))
            return
        if spec.kind is Kind.EXEC and sb is not None and sb.reserve > 0:
            self._exec_reserved(sb, spec, out)
            return
        pool = self._pool(spec)
        self._seq += 1
        deadline = self.now + spec.timeout_s if spec.timeout_s > 0 else None
        w = Waiting(spec, self._seq, self.now, deadline, need=self._min_units(spec))
        self.queues.setdefault(pool, {})[spec.action_id] = w
        if pool == CPU:
            self._cpu_sub.setdefault(self._sub_key(spec), {})[spec.action_id] = w
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
        return aid in self.running or any(aid in q for q in self.queues.values())

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
            api = self.basic.apis[spec.api]
            units = spec.key_demand.min
            if units > api.limit:
                return never(Shortfall(spec.key, units, api.limit, api.limit, spec.api), message="above the API limit")
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
                self._pass_cpu(out)
            elif pool == GPU:
                self._pass_gpu(out)
            elif is_api(pool):
                self._pass_api(pool, out)

    def _pass_api(self, pool: str, out: list[cmd.Command]) -> None:
        api = self.basic.apis[pool[len("api:"):]]
        queue = self.queues[pool]
        for aid, w in list(queue.items()):
            units = w.spec.key_demand.min
            free = api.free(self.now)
            if free < units:
                w.status = wait(Shortfall(pool, units, free, api.limit, api.name))
                break
            del queue[aid]
            api.take(aid, units, self.now)
            ttl = w.spec.timeout_s or self.config.lease_ttl_s
            expires = self.now + ttl
            self.running[aid] = Running(w.spec, api.name, units, self.now, expires, deadline=expires)
            self._seq += 1
            heapq.heappush(self._deadlines, (expires, self._seq, aid))
            out.append(cmd.Grant(aid, api.name, expires))

    def _pass_cpu(self, out: list[cmd.Command]) -> None:
        """Algorithm 1 per node: FCFS prefixes whose minimums fit, then elastic DP.

        The CPU queue is kept per node (plus one queue of trajectories without a node yet);
        the pass merges them in submission order and stops reading a queue at its first
        action that does not fit, so a pass costs O(started + nodes), not O(queued)."""
        free = {n: node.free for n, node in self.cpu.nodes.items()}
        cands: dict[str, list[Waiting]] = {}
        behind: dict[str, list[Waiting]] = {}
        tentative: dict[str, str] = {}  # sandbox -> node chosen earlier in this pass
        heads: list[tuple[int, str]] = []
        iters = {key: iter(q.values()) for key, q in self._cpu_sub.items() if q}
        for key, it in iters.items():
            first = next(it, None)
            if first is not None:
                heads.append((first.seq, key))
                iters[key] = _Peek(first, it)  # type: ignore[assignment]
        heapq.heapify(heads)
        blocked: set[str] = set()
        while heads:
            _, key = heapq.heappop(heads)
            src = iters[key]
            assert isinstance(src, _Peek)
            w = src.pop()
            node = key or tentative.get(w.spec.sandbox, "")
            if node:
                if node in blocked or free.get(node, 0) < w.need:
                    if node not in blocked:
                        blocked.add(node)
                        total = self.cpu.nodes[node].total
                        w.status = wait(Shortfall(CPU, w.need, free.get(node, 0), total, node))
                    behind.setdefault(node, []).append(w)
                    if key:  # the rest of this node's queue waits behind it
                        behind[node].extend(src.take(self.config.behind_limit))
                        continue
                else:
                    cands.setdefault(node, []).append(w)
                    free[node] -= w.need
            else:
                sb = self.sandboxes.get(w.spec.sandbox)
                mem = sb.mem_mib if sb is not None else w.spec.mem_mib
                target = self.cpu.place(w.need, mem, free, blocked)
                if target is None:
                    w.status = self._placement_shortfall(w.need, mem, free)
                    continue  # new trajectories queue FCFS behind this one
                tentative[w.spec.sandbox] = target
                cands.setdefault(target, []).append(w)
                free[target] -= w.need
            if src.has_next():
                heapq.heappush(heads, (src.peek_seq(), key))
        for spec_sb, node in tentative.items():
            self._bind_sandbox(spec_sb, node, out)
        for node in sorted(cands):
            self._start_cpu_group(node, cands[node], behind.get(node, []), out)

    def _placement_shortfall(self, need: int, mem: int, free: dict[str, int]) -> Status:
        best_cores = max(free.values(), default=0)
        best_mem = max((n.mem_free for n in self.cpu.nodes.values()), default=0)
        total = max((n.total for n in self.cpu.nodes.values()), default=0)
        mem_total = max((n.mem_total for n in self.cpu.nodes.values()), default=0)
        reasons = []
        if best_cores < need:
            reasons.append(Shortfall(CPU, need, best_cores, total, "any node"))
        if best_mem < mem:
            reasons.append(Shortfall("mem", mem, best_mem, mem_total, "any node"))
        return wait(*reasons, message="no node has the cores and the trajectory's memory free together")

    def _bind_sandbox(self, sandbox: str, node: str, out: list[cmd.Command]) -> None:
        sb = self.sandboxes.get(sandbox)
        if sb is None or sb.node is not None:
            return
        sb.node = node
        self.cpu.bind(sb.sandbox, node, sb.mem_mib)
        out.append(cmd.CreateSandbox(node, sb.sandbox, sb.mem_mib, sb.image))
        loose = self._cpu_sub.get("", {})
        moved = [w for w in loose.values() if w.spec.sandbox == sb.sandbox]
        if moved:
            target = self._cpu_sub.setdefault(node, {})
            for w in moved:
                del loose[w.spec.action_id]
            merged = sorted([*target.values(), *moved], key=lambda w: w.seq)
            self._cpu_sub[node] = {w.spec.action_id: w for w in merged}

    def _start_cpu_group(self, node: str, group: list[Waiting], waiting: list[Waiting], out: list[cmd.Command]) -> None:
        cpu_node = self.cpu.nodes[node]
        units = self._allocate(group, waiting, cpu_node.free, node)
        for w, u in zip(group, units):
            if u == 0:
                w.status = wait(message="held back: starting it now would raise the summed completion time")
                continue
            self._dequeue(CPU, w.spec.action_id)
            cores = cpu_node.pick(u)
            cpu_node.take(cores)
            est = self._estimate(w.spec, u)
            r = Running(w.spec, node, u, self.now, self.now + est, cores=cores, deadline=w.deadline)
            self.running[w.spec.action_id] = r
            self.counters["started"] = self.counters.get("started", 0) + 1
            if w.spec.kind is Kind.OPEN:
                sb = self.sandboxes[w.spec.sandbox]
                sb.cores = cores
                out.append(cmd.Reserve(w.spec.action_id, node, sb.sandbox, cores))
                for held in sb.held:
                    self._spawn_reserved(sb, held, out)
                sb.held.clear()
            else:
                out.append(cmd.Spawn(w.spec.action_id, node, w.spec.sandbox, cores, u, est))

    def _running_on(self, node: str) -> list[tuple[float, int]]:
        return [
            (r.est_end - self.now, r.units)
            for r in self.running.values()
            if r.node == node and r.spec.kind is Kind.EXEC and r.units
        ]

    # -- allocation (Algorithm 1's inner part) ----------------------------------------------
    def _min_units(self, spec: ActionSpec) -> int:
        """The fewest units the policy starts ``spec`` with (fixed DoP: exactly K)."""
        d = spec.key_demand
        if self.config.policy == FIXED and self.config.fixed_dop > 0 and d.elastic and spec.kind is Kind.EXEC:
            k = min(max(self.config.fixed_dop, d.min), d.max)
            return k if d.allows(k) else d.min
        return d.min

    def _options(self, spec: ActionSpec, spare: int) -> dict[int, float]:
        """Feasible units -> estimated duration, under the configured policy."""
        d = spec.key_demand
        t_ori = self._t_ori(spec)
        policy = self.config.policy
        if spec.kind is Kind.OPEN or not d.elastic:
            return {d.min: self._estimate(spec, d.min)}
        if policy == FIXED and self.config.fixed_dop > 0:
            k = self._min_units(spec)
            return {k: self._estimate(spec, k)}
        if policy == MIN or t_ori is None or spec.elasticity is None:
            return {d.min: self._estimate(spec, d.min)}
        useful = spec.elasticity.max_useful()
        cap = d.min + spare if useful is None else min(d.min + spare, max(useful, d.min))
        return {u: duration(t_ori, spec.elasticity, u) for u in d.clamp_max(cap).options()}

    def _allocate(self, group: list[Waiting], waiting: list[Waiting], free_units: int, node: str) -> list[int]:
        """Units per candidate (0: held back), via DPArrange and greedy eviction."""
        spare = free_units - sum(w.need for w in group)
        if self.config.policy == MAX:
            return self._greedy_max(group, spare)
        options = [self._options(w.spec, spare) for w in group]
        table = arrange_table(options, free_units)
        n = len(group)
        if self.config.policy != TANGRAM or not self.config.eviction or n == 0:
            return list(table.best(n)[1]) if n else []
        if n == 1 or all(len(o) == 1 for o in options):
            return list(table.best(n)[1])  # nothing to evict, or nothing elastic: minimums
        running = self._running_on(node)  # only now: it scans the running actions
        behind = [self._behind(w.spec) for w in waiting[: self.config.behind_limit]]
        cand_behind = [self._behind(w.spec) for w in group]

        def objective(t: int) -> float:
            total, units = table.best(t)
            plan = [(u, options[i][u]) for i, u in enumerate(units)]
            return approx_acts(total, plan, running, cand_behind[t:] + behind, free_units, self.config.depth)

        t, best = n, objective(n)
        while t > 1:
            obj = objective(t - 1)
            if obj >= best:
                break
            best, t = obj, t - 1
        units = list(table.best(t)[1])
        return units + [0] * (n - t)

    def _greedy_max(self, group: list[Waiting], spare: int) -> list[int]:
        """Always-maximum baseline: in FCFS order each takes all it can of what is left."""
        units = []
        for w in group:
            d = w.spec.key_demand
            top = d.clamp_max(d.min + spare).max if d.elastic and w.spec.kind is Kind.EXEC else d.min
            spare -= top - d.min
            units.append(top)
        return units

    def _behind(self, spec: ActionSpec) -> Behind:
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

    # -- reserved sandboxes (the trajectory-level baseline) --------------------------------
    def _exec_reserved(self, sb: Sandbox, spec: ActionSpec, out: list[cmd.Command]) -> None:
        if not sb.cores:
            sb.held.append(spec)
            return
        self._spawn_reserved(sb, spec, out)

    def _spawn_reserved(self, sb: Sandbox, spec: ActionSpec, out: list[cmd.Command]) -> None:
        dop = max(1, min(len(sb.cores), spec.key_demand.max))
        est = self._estimate(spec, dop)
        deadline = self.now + spec.timeout_s if spec.timeout_s > 0 else None
        assert sb.node is not None
        self.running[spec.action_id] = Running(spec, sb.node, 0, self.now, self.now + est, deadline=deadline)
        if deadline is not None:
            self._seq += 1
            heapq.heappush(self._deadlines, (deadline, self._seq, spec.action_id))
        out.append(cmd.Spawn(spec.action_id, sb.node, sb.sandbox, sb.cores, dop, est))

    # -- GPU pool ------------------------------------------------------------------------
    def _pass_gpu(self, out: list[cmd.Command]) -> None:
        """Algorithm 1 over the GPU queue: the FCFS prefix whose minimum chunks fit (with the
        tentative busy masks of this pass), grouped per node; elastic calls get their chunk
        sizes from DPArrange with the chunk-wise operator (Algorithm 4)."""
        busy = {n: node.busy for n, node in self.gpu.nodes.items()}
        groups: dict[str, list[Waiting]] = {}
        blocked = False
        behind: list[Waiting] = []
        soon: dict[tuple[str, int], list[float]] = {}
        for w in self.queues[GPU].values():
            if blocked:
                if len(behind) >= self.config.behind_limit:
                    break
                behind.append(w)
                continue
            size = chunk_size(w.spec.key_demand.min)
            pl = self.gpu.choose(w.spec.service, size, busy, set())
            if pl is None:
                blocked = True
                free = sum(n.count - busy[name].bit_count() for name, n in self.gpu.nodes.items())
                total = sum(n.count for n in self.gpu.nodes.values())
                w.status = wait(Shortfall(GPU, size, free, total, "a free aligned chunk"))
                behind.append(w)
                continue
            if not pl.resident and self._wait_for_resident(w, size, soon):
                continue
            busy[pl.node] |= self.gpu.nodes[pl.node].chunk_mask(pl.start, pl.size)
            groups.setdefault(pl.node, []).append(w)
        for node in sorted(groups):
            self._start_gpu_group(node, groups[node], behind, out)

    def _wait_for_resident(self, w: Waiting, size: int, soon: dict[tuple[str, int], list[float]]) -> bool:
        """Cache awareness beyond the paper's tie-break: rather than restore a service onto a
        free chunk, wait for a busy chunk that already holds it when that chunk frees up
        sooner than a restore would take. ``soon`` tracks, per (service, size), when each busy
        resident copy frees, counting the calls already queued for it in this pass."""
        if self.config.policy != TANGRAM or not self.config.cache_aware:
            return False
        spec = w.spec
        key = (spec.service, size)
        if key not in soon:
            soon[key] = sorted(r.est_end for r in self.running.values()
                               if r.spec.kind is Kind.CALL and r.spec.service == spec.service and r.chunk[1] == size)
        frees = soon[key]
        load_s = self.gpu.services[spec.service].load_s
        if not frees or frees[0] - self.now >= load_s:
            return False
        heapq.heapreplace(frees, frees[0] + self._estimate(spec, size))
        w.status = wait(message=f"waiting for a busy GPU that holds {spec.service}: sooner than a {load_s:g} s restore")
        return True

    def _start_gpu_group(self, node: str, group: list[Waiting], behind: list[Waiting], out: list[cmd.Command]) -> None:
        gnode = self.gpu.nodes[node]
        sizes = self._gpu_sizes(gnode, group, behind)
        for w, size in zip(group, sizes):
            if size == 0:
                w.status = wait(message="held back: starting it now would raise the summed completion time")
                continue
            pl = self.gpu.choose(w.spec.service, size, {}, set(), only=node)
            if pl is None and size != chunk_size(w.spec.key_demand.min):
                pl = self.gpu.choose(w.spec.service, chunk_size(w.spec.key_demand.min), {}, set(), only=node)
            if pl is None:
                w.status = wait(message=f"no aligned chunk free on {node} after fragmentation")
                continue
            del self.queues[GPU][w.spec.action_id]
            self._start_call(w, pl, out)

    def _gpu_sizes(self, gnode: GpuNode, group: list[Waiting], behind: list[Waiting]) -> list[int]:
        """Chunk size per candidate on one node (0: held back)."""
        mins = [chunk_size(w.spec.key_demand.min) for w in group]
        free = gnode.count - gnode.busy.bit_count()
        options = [self._gpu_options(w.spec, free) for w in group]
        if all(len(o) == 1 for o in options):
            return [next(iter(o)) for o in options]
        table = DPTable(options, ChunkOperator(_FreeView(gnode)))
        n = len(group)
        if not table.feasible(n):
            return mins
        if self.config.policy != TANGRAM or not self.config.eviction:
            return list(table.best(n)[1])
        running = [(r.est_end - self.now, r.units) for r in self.running.values()
                   if r.node == gnode.name and r.spec.kind is Kind.CALL]
        cand_behind = [self._behind(w.spec) for w in group]
        rest = [self._behind(w.spec) for w in behind[: self.config.behind_limit]]

        def objective(t: int) -> float:
            total, units = table.best(t)
            plan = [(u, options[i][u]) for i, u in enumerate(units)]
            return approx_acts(total, plan, running, cand_behind[t:] + rest, free, self.config.depth)

        t, best = n, objective(n)
        while t > 1 and table.feasible(t - 1):
            obj = objective(t - 1)
            if obj >= best:
                break
            best, t = obj, t - 1
        return list(table.best(t)[1]) + [0] * (n - t)

    def _gpu_options(self, spec: ActionSpec, free: int) -> dict[int, float]:
        d = spec.key_demand
        sizes = sorted({chunk_size(u) for u in d.options() if chunk_size(u) <= max(free, 1)}) or [chunk_size(d.min)]
        base = chunk_size(d.min)
        policy = self.config.policy
        if not d.elastic or policy == MIN:
            return {base: self._estimate(spec, base)}
        if policy == FIXED and self.config.fixed_dop:
            k = chunk_size(min(max(self.config.fixed_dop, d.min), d.max))
            return {k: self._estimate(spec, k)} if k in sizes else {base: self._estimate(spec, base)}
        if policy == MAX:
            return {sizes[-1]: self._estimate(spec, sizes[-1])}
        if self._t_ori(spec) is None or spec.elasticity is None:
            return {base: self._estimate(spec, base)}
        return {s: self._estimate(spec, s) for s in sizes}

    def _start_call(self, w: Waiting, pl: object, out: list[cmd.Command]) -> None:
        from tangram.core.managers.gpu import Placement

        assert isinstance(pl, Placement)
        spec = w.spec
        node = self.gpu.nodes[pl.node]
        svc = self.gpu.services[spec.service]
        inst = (spec.service, pl.start, pl.size)
        for victim in pl.evict:
            node.drop_resident(victim)
            out.append(cmd.Evict(pl.node, victim[0], victim[1], victim[1] + victim[2]))
        self._seq += 1
        load_s = 0.0
        if not pl.resident:
            node.add_resident(inst, svc.gpu_mem_mib, float(self._seq))
            load_s = svc.load_s
            out.append(cmd.Load(pl.node, spec.service, pl.start, pl.start + pl.size, load_s))
        node.resident[inst] = float(self._seq)
        node.in_use[inst] = node.in_use.get(inst, 0) + 1
        node.busy |= node.chunk_mask(pl.start, pl.size)
        est = load_s + self._estimate(spec, pl.size)
        r = Running(spec, pl.node, pl.size, self.now, self.now + est, chunk=(pl.start, pl.size), load_s=load_s,
                    deadline=w.deadline)
        self.running[spec.action_id] = r
        self.counters["started"] = self.counters.get("started", 0) + 1
        self.counters["loads"] = self.counters.get("loads", 0) + (0 if pl.resident else 1)
        out.append(cmd.Invoke(spec.action_id, pl.node, spec.service, pl.start, pl.start + pl.size, est))

    # -- endings -------------------------------------------------------------------------
    def _finish(self, aid: str, ok: bool, reason: str, out: list[cmd.Command], release: bool = True) -> None:
        r = self.running.pop(aid)
        kind = r.spec.kind
        if kind in (Kind.EXEC, Kind.OPEN) and r.units and release:
            node = self.cpu.nodes.get(r.node)
            if node is not None:
                node.give(r.cores)
            self._dirty.add(CPU)
        elif kind is Kind.CALL:
            node_g = self.gpu.nodes.get(r.node)
            if node_g is not None:
                start, size = r.chunk
                inst = (r.spec.service, start, size)
                node_g.busy &= ~node_g.chunk_mask(start, size)
                left = node_g.in_use.get(inst, 1) - 1
                if left > 0:
                    node_g.in_use[inst] = left
                else:
                    node_g.in_use.pop(inst, None)
                self._seq += 1
                if inst in node_g.resident:
                    node_g.resident[inst] = float(self._seq)
            self._dirty.add(GPU)
        elif kind is Kind.LEASE:
            api = self.basic.apis.get(r.spec.api)
            if api is not None:
                api.release(aid)
            self._dirty.add(_api_pool(r.spec.api))
        self.counters["finished" if ok else "failed"] = self.counters.get("finished" if ok else "failed", 0) + 1
        out.append(cmd.Done(aid, ok, reason))

    def _dequeue(self, pool: str, aid: str) -> None:
        w = self.queues[pool].pop(aid, None)
        if w is not None and pool == CPU:
            key = self._sub_key(w.spec)
            sub = self._cpu_sub.get(key)
            if sub is None or sub.pop(aid, None) is None:  # bound since: search every sub-queue
                for q in self._cpu_sub.values():
                    q.pop(aid, None)

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
        return any(aid in q and q[aid].deadline == t for q in self.queues.values())

    def _expire(self, out: list[cmd.Command]) -> None:
        while self._deadlines and self._deadlines[0][0] <= self.now:
            t, _, aid = heapq.heappop(self._deadlines)
            if not self._deadline_live(aid, t):
                continue
            r = self.running.get(aid)
            if r is None:
                for pool, q in self.queues.items():
                    if aid in q:
                        self._drop(pool, aid, out, "TIMEOUT", "timed out while queued")
                        break
            elif r.spec.kind is Kind.LEASE:
                self._finish(aid, ok=False, reason="lease expired", out=out)
                out.append(cmd.Reject(aid, "TIMEOUT", "lease not released before its deadline: reclaimed"))
            else:
                r.killed = True
                out.append(cmd.Kill(aid, r.node, "timeout"))

    # -- views ---------------------------------------------------------------------------
    def status_of(self, aid: str) -> Status | None:
        for q in self.queues.values():
            if aid in q:
                return q[aid].status
        return ADMITTED if aid in self.running else None

    def snapshot(self) -> Snapshot:
        nodes = []
        for name in sorted(set(self.cpu.nodes) | set(self.gpu.nodes)):
            c = self.cpu.nodes.get(name)
            g = self.gpu.nodes.get(name)
            nodes.append({
                "node": name,
                "cpus_total": c.total if c else 0,
                "cpus_used": (c.total - c.free) if c else 0,
                "mem_total_mib": c.mem_total if c else 0,
                "mem_reserved_mib": c.mem_reserved if c else 0,
                "sandboxes": len(c.sandboxes) if c else 0,
                "gpus_total": g.count if g else 0,
                "gpus_busy": g.busy.bit_count() if g else 0,
                "gpu_mem_used_mib": list(g.used_mem) if g else [],
                "resident": sorted(f"{s}@{a}+{z}" for s, a, z in g.resident) if g else [],
            })
        services = tuple(
            {"service": s.name, "gpu_mem_mib": s.gpu_mem_mib, "chunk_sizes": list(s.chunk_sizes), "load_s": s.load_s}
            for s in sorted(self.gpu.services.values(), key=lambda s: s.name)
        )
        apis = tuple(
            {"api": a.name, "mode": a.mode, "limit": a.limit, "in_flight": len(a.in_flight), "used": a.used,
             "queued": len(self.queues.get(_api_pool(a.name), {}))}
            for a in sorted(self.basic.apis.values(), key=lambda a: a.name)
        )
        rows = sorted(
            (w for q in self.queues.values() for w in q.values()), key=lambda w: w.seq
        )
        queue = tuple(
            QueueRow(w.spec.action_id, self._pool(w.spec), w.spec.kind.value, w.spec.client,
                     self.now - w.submitted, _demand_text(w.spec), str(w.status) if w.status.code != Code.ADMITTED
                     else "pending")
            for w in rows
        )
        return Snapshot(self.now, tuple(nodes), services, apis, queue, len(rows), len(self.running),
                        tuple(sorted(self.counters.items())))


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


def _api_pool(name: str) -> str:
    return "api:" + name


def _demand_text(spec: ActionSpec) -> str:
    parts = []
    for res, d in spec.demand:
        parts.append(f"{res}={d.min}" if not d.elastic else f"{res}={d.min}..{d.max}")
    return ",".join(parts)


_HANDLERS = {
    ev.NodeJoined: Scheduler._on_node_joined,
    ev.NodeLost: Scheduler._on_node_lost,
    ev.ServiceDefined: Scheduler._on_service,
    ev.ApiDefined: Scheduler._on_api,
    ev.SandboxOpened: Scheduler._on_sandbox_opened,
    ev.SandboxClosed: Scheduler._on_sandbox_closed,
    ev.ActionSubmitted: Scheduler._on_submitted,
    ev.ActionFinished: Scheduler._on_finished,
    ev.ActionCancelled: Scheduler._on_cancelled,
    ev.ServiceEvicted: Scheduler._on_service_evicted,
    ev.ClientGone: Scheduler._on_client_gone,
    ev.Tick: Scheduler._on_tick,
}
