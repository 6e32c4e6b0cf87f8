"""The discrete-event loop: a heap of (t, seq, item) under a ``VirtualClock``.

Items are core events (fed to ``core.handle`` and journaled, then the cluster model turns
the start commands into finish events), trajectory wake-ups (the client submits its next
action after its generation time) and direct API attempts (the api-retry baseline). Core
events of one instant that follow each other are one batch, decided once after the last (as
the live driver does); after each decision a ``Tick`` is queued at ``core.next_deadline()``.
Ties at one instant keep insertion order (``seq``), so a run is a pure function of
(workload, batch, policy, seed).
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random
from typing import Any

from tangram.clock import VirtualClock
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.resources import CPU, GPU, Demand, api_resource
from tangram.journal import Journal
from tangram.sim.baselines import Policy, call_demand, make_core, static_layout
from tangram.sim.cluster import ApiProvider, ClusterModel, ClusterSpec, KeyedProvider, Truth
from tangram.sim.workloads import ActionPlan, TrajPlan, Workload, generate

EVENT, WAKE, ATTEMPT, API_DONE, FAIL, STEP = range(6)
MIB_PER_GB = 1000**3 / 1024**2


@dataclass(slots=True)
class ActRecord:
    aid: str
    task: str
    category: str  # env | reward
    kind: str  # exec | call | api
    submit: float
    start: float = -1.0
    end: float = -1.0
    ok: bool = True
    attempts: int = 0
    api: str = ""
    job: str = ""  # its RL job ("": the default)


@dataclass(slots=True)
class Traj:
    plan: TrajPlan
    step: int
    start: float
    idx: int = 0
    end: float = -1.0
    again: int = 0  # re-issues of the current action after an API error (api-retry)


@dataclass
class SimResult:
    workload: str
    policy: str
    batch: int
    seed: int
    spec: ClusterSpec
    records: list[ActRecord]
    trajs: list[Traj]
    steps: list[tuple[float, float]]  # (rollout start, rollout end) per step
    train_s: float
    runs: dict[str, Any]
    pods: dict[str, tuple[float, float, int]]  # sandbox -> (reserved at, closed at, cores)
    static_gpus: int
    events: int
    wall_s: float
    decide_s: array = field(default_factory=lambda: array("d"))
    counters: dict[str, int] = field(default_factory=dict)
    prewake_gpu_s: float = 0.0  # GPU-seconds of restores started ahead of their calls
    keyed: dict[str, KeyedProvider] = field(default_factory=dict)  # APIs with keys: their providers


class Engine:
    def __init__(
        self,
        workload: Workload,
        policy: Policy,
        spec: ClusterSpec | None = None,
        batch: int = 64,
        seed: int = 0,
        steps: int = 1,
        journal: Journal | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.workload, self.policy, self.batch, self.seed, self.steps = workload, policy, batch, seed, steps
        base = spec or ClusterSpec()
        self.spec = (
            base.overridden(workload.cluster, f"{workload.name}.cluster") if workload.cluster else base
        )
        self.journal, self.progress = journal, progress
        self.clock = VirtualClock()
        self.heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.trajs: list[Traj] = []
        self.acts: dict[str, tuple[Traj, ActionPlan, ActRecord]] = {}
        self.records: list[ActRecord] = []
        self.cluster = ClusterModel(self.spec, self._truth, self._model_gb)
        self.members = {m: g for g in workload.all_services() for m in g.members()}
        self.static_gpus = 0
        self.core = make_core(policy, seed, self._layout() if policy.static else None)
        self.providers: dict[str, ApiProvider | KeyedProvider] = {
            a.name: KeyedProvider(a.keys) if a.keys else ApiProvider(a.mode, a.limit, a.period_s)
            for a in workload.all_apis()
        }
        self.cluster.providers = {n: p for n, p in self.providers.items() if isinstance(p, KeyedProvider)}
        self.retry_rng = Random(f"{seed}:retry")
        self._elastic: dict[float, Elasticity] = {}
        self._ticks: set[float] = set()
        self._pods: dict[str, tuple[float, float, int]] = {}
        self._open_trajs = 0
        self._done_trajs = 0
        self._steps: list[tuple[float, float]] = []
        self.events = 0
        self.decide_s = array("d")

    # -- set-up ----------------------------------------------------------------------------
    def _layout(self) -> dict[str, list[tuple[str, int, int]]]:
        override = dict(self.spec.static_gpus)
        wants = []
        for name, g in sorted(self.members.items()):
            gpus = override.get(g.name, g.static_gpus)
            wants.append((name, gpus, min(g.chunk_sizes)))
            self.static_gpus += gpus
        nodes = [(e.node, e.gpus) for e in self.spec.node_events() if e.gpus]
        return static_layout(wants, nodes)

    def _setup(self) -> None:
        for e in self.spec.node_events():
            self._feed(e)
        for name, g in sorted(self.members.items()):
            # a copy on k GPUs holds 1/k of the weights per GPU and restores them k x faster
            per_size = tuple(
                (k, int(g.model_gb * MIB_PER_GB / k), self.spec.restore_s(g.model_gb, k)) for k in g.chunk_sizes
            )
            _, mem, load = min(per_size)  # the defaults: the smallest chunk
            self._feed(ev.ServiceDefined(name, mem, g.chunk_sizes, load, per_size=per_size))
        for a in self.workload.all_apis():
            self._feed(ev.ApiDefined(a.name, a.mode, a.limit, a.period_s, a.keys))
        for j in self.workload.jobs if self.workload.fair else ():
            self._feed(ev.JobDefined(j.name, j.weight, j.caps))

    # -- the loop --------------------------------------------------------------------------
    def push(self, t: float, code: int, item: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, code, item))

    def run(self) -> SimResult:
        wall = time.perf_counter()
        self._setup()
        self.push(0.0, STEP, 0)
        heap, clock = self.heap, self.clock
        while heap:
            t, _, code, item = heapq.heappop(heap)
            clock.advance_to(t)
            if code == EVENT:
                if type(item) is ev.Tick:
                    self._ticks.discard(t)
                    due = self.core.next_deadline()
                    if due is None or due > t:
                        continue  # the deadline went away (work ended early): like the live driver, no Tick
                self._feed(item, decide=not self._more_now(t))
            elif code == WAKE:
                self._submit(item)
            elif code == ATTEMPT:
                self._attempt(*item)
            elif code == API_DONE:
                aid = item
                self.providers[self.acts[aid][1].api].done()
                self._complete(aid, True)
            elif code == FAIL:
                self._complete(item, False)
            elif code == STEP:
                self._start_step(item)
        counters = dict(getattr(self.core, "inner", self.core).counters)
        counters["restores"] = self.cluster.restores
        counters["prewakes"] = self.cluster.prewakes
        counters.update(self.cluster.pool_counters())
        counters["api_429"] = sum(p.refused for p in self.providers.values())
        return SimResult(
            self.workload.name,
            self.policy.name,
            self.batch,
            self.seed,
            self.spec,
            self.records,
            self.trajs,
            self._steps,
            self.workload.train_s,
            self.cluster.runs,
            self._pods,
            self.static_gpus,
            self.events,
            time.perf_counter() - wall,
            self.decide_s,
            counters,
            self.cluster.prewake_gpu_s,
            dict(self.cluster.providers),
        )

    def _more_now(self, t: float) -> bool:
        """Whether another event (not a `Tick`) waits at this instant: the live driver decides
        once per batch of waiting events (`Driver.batch`), and so does the simulator."""
        if not self.heap:
            return False
        t2, _, code, item = self.heap[0]
        return t2 == t and code == EVENT and type(item) is not ev.Tick

    def _feed(self, event: ev.Event, decide: bool = True) -> None:
        now = self.clock.now()
        t0 = time.perf_counter()
        commands = self.core.handle(event, now, decide)
        self.decide_s.append(time.perf_counter() - t0)
        self.events += 1
        if self.journal is not None:
            self.journal.append(now, event, commands)
        for t, e in self.cluster.apply(commands, now):
            self.push(t, EVENT, e)
        for c in commands:
            tc = type(c)
            if tc is cmd.Done or tc is cmd.Reject:
                if c.action_id in self.acts:
                    self._complete(c.action_id, c.ok if tc is cmd.Done else False)
            elif tc is cmd.Reserve:
                self._pods[c.sandbox] = (now, -1.0, len(c.cores))
        if not decide:
            return
        d = self.core.next_deadline()
        if d is not None and d not in self._ticks:
            self._ticks.add(d)
            self.push(max(d, now), EVENT, ev.Tick())

    # -- the clients (trajectories) ----------------------------------------------------------
    def _start_step(self, step: int) -> None:
        now = self.clock.now()
        plans = generate(self.workload, self.batch, self.seed, step)
        self._open_trajs = len(plans)
        self._steps.append((now, now))
        reserve = None
        for plan in plans:
            tr = Traj(plan, step, now)
            self.trajs.append(tr)
            if plan.job and self.workload.fair:  # the trajectory is the client; it names its job
                self._feed(ev.JobJoined(plan.tid, plan.job))
            if plan.sandboxed:
                if self.policy.reserve is not None:
                    reserve = self.policy.reserve or plan.pod_cores
                self._feed(ev.SandboxOpened(plan.tid, plan.tid, plan.mem_mib, "", reserve or 0, plan.task))
            if plan.actions:
                self.push(now + plan.start_s + plan.actions[0].think_s, WAKE, tr)
            else:
                self._end(tr)

    def _submit(self, tr: Traj) -> None:
        now = self.clock.now()
        plan = tr.plan.actions[tr.idx]
        aid = f"{tr.plan.tid}/{tr.idx}" + (f".{tr.again}" if tr.again else "")
        rec = ActRecord(aid, tr.plan.task, plan.category, plan.kind, now, api=plan.api, job=tr.plan.job)
        self.records.append(rec)
        self.acts[aid] = (tr, plan, rec)
        if plan.kind == "api" and self.policy.api_direct:
            self._attempt(aid, 1)
            return
        self._feed(ev.ActionSubmitted(self._spec(aid, tr, plan)))

    def _elasticity(self, serial: float | None) -> Elasticity | None:
        if serial is None:
            return None
        el = self._elastic.get(serial)
        if el is None:
            el = self._elastic[serial] = Elasticity.amdahl(serial)
        return el

    def _spec(self, aid: str, tr: Traj, p: ActionPlan) -> ActionSpec:
        tid, task = tr.plan.tid, tr.plan.task
        if p.kind == "exec":
            return ActionSpec(
                aid,
                Kind.EXEC,
                ((CPU, Demand.range(p.lo, p.hi)),),
                CPU,
                p.action_type,
                tid,
                task,
                tid,
                tid,
                elasticity=self._elasticity(p.serial),
                t_ori=p.profile,
            )
        if p.kind == "call":
            return ActionSpec(
                aid,
                Kind.CALL,
                ((GPU, call_demand(self.policy, p.gpus)),),
                GPU,
                p.action_type,
                tid,
                task,
                tid,
                service=p.service,
                elasticity=self._elasticity(p.serial),
                t_ori=p.profile,
            )
        res = api_resource(p.api)
        return ActionSpec(
            aid, Kind.LEASE, ((res, Demand.fixed(1)),), res, p.action_type, tid, task, tid, api=p.api,
            tokens=p.tokens,
        )

    def _truth(self, aid: str) -> Truth:
        _, p, _ = self.acts[aid]
        g = self.members.get(p.service)
        gb = g.model_gb if g is not None else 0.0
        return Truth(p.t_ori, self._elasticity(p.serial), gb, p.tokens, p.api)

    def _model_gb(self, service: str) -> float:
        g = self.members.get(service)
        return g.model_gb if g is not None else 0.0

    def _attempt(self, aid: str, n: int) -> None:
        now = self.clock.now()
        _, plan, rec = self.acts[aid]
        rec.attempts = n
        if self.providers[plan.api].try_call(now, plan.tokens, now + plan.t_ori):
            rec.start = now
            self.push(now + plan.t_ori, API_DONE, aid)
            return
        r = self.policy.retry
        if n >= r.max_attempts:
            self.push(now + r.error_s, FAIL, aid)
        else:
            self.push(now + r.error_s + r.backoff(n, self.retry_rng), ATTEMPT, (aid, n + 1))

    def _complete(self, aid: str, ok: bool) -> None:
        now = self.clock.now()
        tr, plan, rec = self.acts.pop(aid)
        rec.end, rec.ok = now, ok
        run = self.cluster.runs.get(aid)
        if run is not None:
            rec.start = run.start
        elif rec.start < 0:
            rec.start = now
        if not ok and plan.kind == "api" and aid in self.cluster.limited:
            # a 429 on a leased key: the rollout code reported it; it leases again at once
            tr.again += 1
            self.push(now, WAKE, tr)
            return
        if not ok and plan.kind == "api" and self.policy.api_direct and tr.again < self.policy.retry.reissues:
            # the tool returned an API error: the agent generates again and re-issues the call
            tr.again += 1
            self.push(now + plan.think_s, WAKE, tr)
            return
        tr.idx += 1
        tr.again = 0
        if tr.idx < len(tr.plan.actions):
            self.push(now + tr.plan.actions[tr.idx].think_s, WAKE, tr)
        else:
            self._end(tr)

    def _end(self, tr: Traj) -> None:
        now = self.clock.now()
        tr.end = now
        if tr.plan.sandboxed:
            self.push(now, EVENT, ev.SandboxClosed(tr.plan.tid))
            if tr.plan.tid in self._pods:
                t0, _, k = self._pods[tr.plan.tid]
                self._pods[tr.plan.tid] = (t0, now, k)
        self._open_trajs -= 1
        self._done_trajs += 1
        if self.progress is not None:
            self.progress(self._done_trajs, self.batch * self.steps)
        if self._open_trajs == 0:
            start, _ = self._steps[-1]
            self._steps[-1] = (start, now)
            if tr.step + 1 < self.steps:
                self.push(now + self.workload.train_s, STEP, tr.step + 1)


def simulate(workload: Workload, policy: Policy, **kw: Any) -> SimResult:
    return Engine(workload, policy, **kw).run()
