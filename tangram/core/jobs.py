"""Many RL jobs in one pool: weights, caps, and the fair order of each queue (issue 14, part 3).

A client names its job (``AsyncClient(job="grpo-7b")``); the controller's config gives a job a
weight and optional caps. Rules (they refine the scheduler's rule 2, FCFS per pool):

1. Every action belongs to the job of its client (``JobJoined``); a client that named none is
   in the default job ``""``. A job nobody defined has weight 1 and no caps.
2. ``JobBook`` keeps, per pool (``cpu``, ``gpu``, ``api:<name>``), the units each job's running
   actions hold, and per job and pool the unit-seconds they have held (core-seconds,
   GPU-seconds): the one owner of these figures, fed by the running table.
3. A pass reads a pool's queued actions in *fair order* (``Fair``): the next comes from the
   job with the smallest (units held + units taken so far in this pass) / weight among the
   jobs with actions queued there, ties to the earlier submission; FCFS within a job. With
   one job this is the paper's FCFS order, decision for decision (the simulator's journals
   are byte-identical).
   New trajectories (a sandbox without a node: placing it takes its memory, held until it
   closes, as well as cores) are placed by *dominant share* (weighted DRF): while several
   jobs have new trajectories to place, the next placed is the earliest of the job with the
   smallest max(cores share, memory share) / weight (``Fair.dominant``: shares of the CPU
   pool's totals, held plus taken so far in the pass; ``JobBook.mem`` keeps each job's
   placed sandboxes' memory, fed by ``CpuManager``'s hooks), ties to the earlier submission.
   The others' come after it in the pass, and their jobs' actions in placed sandboxes are not
   held behind them. So when memory binds before cores, the trajectory slots split by weight
   too (by cores alone a job that held memory but few cores took more than its share).
4. The passes' FCFS rules hold along the fair order: the first action that does not fit
   blocks what comes after it on its node (CPU) or pool (GPU, API). So the job furthest below
   its share is first in line for the next units that free, never behind another job's
   burst, and under contention each job's share converges to its weight (weighted max-min: a
   job that asks for less than its share gets all it asks; the rest is shared by weight).
   Within a job the passes minimise ACT as before (DPArrange, greedy eviction).
5. A cap bounds the units a job holds in a pool: an action that would take its job past the
   cap waits ("at its cap") and blocks no other job; elastic grants stop at the cap
   (``Fair.clamp``); an action whose minimum exceeds its job's cap can never run and is
   rejected ``NO_CAPACITY`` at submission (``never_fits``).
6. Pure like the rest of the core: ``now`` comes from the scheduler; ties break by seq.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.queues import Lane
from tangram.core.resources import CPU, GPU, Demand, api_resource, is_api
from tangram.core.state import Running, Waiting
from tangram.core.status import Shortfall, Status, never, wait

if TYPE_CHECKING:
    from tangram.core.scheduler import Scheduler

DEFAULT = ""  # the job of clients that name none
ANY_API = "api"  # a cap on the units of every API (``api:<name>`` caps one)
UNITS = {CPU: "cores", GPU: "GPUs"}  # what a pool's units are called in reasons (APIs: "units")


@dataclass(frozen=True)
class JobSpec:
    """A job's weight and caps (resource -> most units held at once)."""

    name: str
    weight: float = 1.0
    caps: tuple[tuple[str, int], ...] = ()

    def problem(self) -> str | None:
        """What is wrong with it, or None."""
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            return f"job {self.name!r}: weight must be a number > 0, got {w!r}"
        seen: set[str] = set()
        for res, n in self.caps:
            if res not in (CPU, GPU, ANY_API) and not (is_api(res) and len(res) > len(ANY_API) + 1):
                return (
                    f"job {self.name!r}: unknown resource {res!r} in caps (known: cpu, gpu, api, api:<name>)"
                )
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                return f"job {self.name!r}: cap of {res} must be an integer >= 0, got {n!r}"
            if res in seen:
                return f"job {self.name!r}: {res} is capped twice"
            seen.add(res)
        return None


def pool_of(r: Running) -> str | None:
    """The pool whose units a running action holds (None: none, e.g. a reserved sandbox's exec)."""
    kind = r.spec.kind
    if kind is Kind.CALL:
        return GPU
    if kind is Kind.LEASE:
        return api_resource(r.spec.api)
    return CPU if r.units else None


class JobBook:
    """The jobs: their specs, which client is in which, and what each holds and has held."""

    def __init__(self) -> None:
        self.specs: dict[str, JobSpec] = {}
        self._caps: dict[str, dict[str, int]] = {}
        self._client: dict[str, str] = {}  # client -> its job (absent: the default)
        self.held: dict[str, dict[str, int]] = {}  # pool -> job -> units its running actions hold
        self._open: dict[str, tuple[str, str, int, float]] = {}  # action -> (job, pool, units, since)
        self._ended_s: dict[tuple[str, str], float] = {}  # (job, pool) -> unit-seconds of ended actions
        self._since_sum: dict[tuple[str, str], float] = {}  # (job, pool) -> sum of units x start of running
        self.started: dict[str, int] = {}  # job -> actions started
        self.mem: dict[str, int] = {}  # job -> MiB its placed sandboxes reserve (CpuManager's hooks)
        self._mem_of: dict[str, tuple[str, int]] = {}  # sandbox -> (job, MiB)

    def define(self, spec: JobSpec) -> None:
        self.specs[spec.name] = spec
        self._caps[spec.name] = dict(spec.caps)

    def join(self, client: str, job: str) -> None:
        if job == DEFAULT:
            self._client.pop(client, None)
        else:
            self._client[client] = job

    def leave(self, client: str) -> None:
        self._client.pop(client, None)

    def job_of(self, client: str) -> str:
        return self._client.get(client, DEFAULT)

    def weight(self, job: str) -> float:
        spec = self.specs.get(job)
        return 1.0 if spec is None else float(spec.weight)

    def cap(self, job: str, pool: str) -> int | None:
        caps = self._caps.get(job)
        if not caps:
            return None
        n = caps.get(pool)
        if n is None and is_api(pool):
            n = caps.get(ANY_API)
        return n

    def capped(self, pool: str) -> bool:
        """Whether some job has a cap in ``pool``."""
        return any(self.cap(job, pool) is not None for job in self._caps)

    # -- the CPU manager's hooks (CpuManager.on_bind / on_unbind): memory per job ----------------
    def on_bind(self, sandbox: str, client: str, mib: int) -> None:
        self.on_unbind(sandbox)
        if mib <= 0:  # a sandbox without a memory limit reserves nothing to count
            return
        job = self.job_of(client)
        self._mem_of[sandbox] = (job, mib)
        self.mem[job] = self.mem.get(job, 0) + mib

    def on_unbind(self, sandbox: str) -> None:
        got = self._mem_of.pop(sandbox, None)
        if got is None:
            return
        job, mib = got
        left = self.mem.get(job, 0) - mib
        if left > 0:
            self.mem[job] = left
        else:
            self.mem.pop(job, None)

    def dominant_share(self, job: str, cores: int, mem_mib: int) -> float:
        """``job``'s dominant share now, before its weight (rule 3): the larger of the cores its
        actions hold over ``cores`` and its placed sandboxes' memory over ``mem_mib`` (the CPU
        pool's totals; a total of 0 counts for nothing). ``Fair.dominant`` is this, plus what a
        pass took so far, times the pool's cores over the job's weight."""
        share = self.held.get(CPU, {}).get(job, 0) / cores if cores > 0 else 0.0
        return max(share, self.mem.get(job, 0) / mem_mib if mem_mib > 0 else 0.0)

    # -- the running table's hooks (RunningTable.on_start / on_end) ------------------------------
    def on_start(self, r: Running, now: float) -> None:
        pool = pool_of(r)
        if pool is None:
            return
        job = self.job_of(r.spec.client)
        held = self.held.setdefault(pool, {})
        held[job] = held.get(job, 0) + r.units
        self._open[r.spec.action_id] = (job, pool, r.units, now)
        key = (job, pool)
        self._since_sum[key] = self._since_sum.get(key, 0.0) + r.units * now
        self.started[job] = self.started.get(job, 0) + 1

    def on_end(self, r: Running, now: float) -> None:
        got = self._open.pop(r.spec.action_id, None)
        if got is None:
            return
        job, pool, units, since = got
        held = self.held[pool]
        left = held[job] - units
        if left:
            held[job] = left
        else:
            del held[job]
        key = (job, pool)
        self._since_sum[key] -= units * since
        self._ended_s[key] = self._ended_s.get(key, 0.0) + units * max(0.0, now - since)

    def unit_seconds(self, job: str, pool: str, now: float) -> float:
        """Unit-seconds ``job`` has held in ``pool`` so far (its running actions up to ``now``)."""
        key = (job, pool)
        running = self.held.get(pool, {}).get(job, 0) * now - self._since_sum.get(key, 0.0)
        return self._ended_s.get(key, 0.0) + max(0.0, running)

    def rows(
        self, now: float, queued: Mapping[str, int], totals: Mapping[str, int]
    ) -> tuple[dict[str, object], ...]:
        """Status rows, one per job that is defined, has clients, holds or held units or
        waits: weight, caps, clients, queued actions, units held now and their share of each
        pool (``totals``), unit-seconds per pool."""
        names = set(self.specs) | set(self._client.values()) | set(queued) | {j for j, _ in self._ended_s}
        for held in self.held.values():
            names.update(held)
        pools = sorted({p for _, p in self._ended_s} | set(self.held) | set(totals))
        clients: dict[str, int] = {}
        for job in self._client.values():
            clients[job] = clients.get(job, 0) + 1
        rows = []
        for job in sorted(names):
            held = {p: self.held.get(p, {}).get(job, 0) for p in pools}
            rows.append(
                {
                    "job": job,
                    "weight": self.weight(job),
                    "caps": dict(self._caps.get(job, {})),
                    "clients": clients.get(job, 0),
                    "queued": queued.get(job, 0),
                    "started": self.started.get(job, 0),
                    "held": {p: n for p, n in held.items() if n},
                    "share": {p: round(n / totals[p], 4) for p, n in held.items() if n and totals.get(p)},
                    "unit_s": {p: round(s, 3) for p in pools if (s := self.unit_seconds(job, p, now)) > 0},
                }
            )
        return tuple(rows)


class Fair:
    """One pass's view of the shares in one pool (rule 3): units held plus units taken so
    far in the pass, per job, over its weight; and the caps (rule 5)."""

    __slots__ = ("book", "capped", "held", "mem_scale", "mem_taken", "pool", "taken", "total", "wsum")

    def __init__(
        self, book: JobBook, pool: str, total: int = 0, active: Iterable[str] = (), mem_total: int = 0
    ) -> None:
        """``total``: the pool's units, when ``active`` (the jobs with actions queued in it)
        are several: each job's share of them bounds its elastic grants (``limit``).
        ``mem_total``: the CPU pool's memory (MiB), for the dominant shares of new
        trajectories (``dominant``; 0: cores alone)."""
        self.book = book
        self.pool = pool
        self.held = book.held.setdefault(pool, {})  # live: an API pass's grants show at once
        self.taken: dict[str, int] = {}
        self.mem_taken: dict[str, int] = {}  # MiB of the trajectories placed so far in this pass
        self.capped: set[str] = set()  # jobs passed over for the rest of the pass (at their cap)
        jobs = set(active)
        self.total = total if len(jobs) > 1 else 0
        self.wsum = sum(book.weight(j) for j in jobs) if self.total else 0.0
        # a MiB in units of the pool: a job's memory share times ``total``, comparable to its cores
        self.mem_scale = self.total / mem_total if self.total and mem_total > 0 else 0.0

    def share(self, job: str) -> float:
        return (self.held.get(job, 0) + self.taken.get(job, 0)) / self.book.weight(job)

    def dominant(self, job: str) -> float:
        """A new trajectory's key (rule 3): its job's larger share, of the pool's cores or of
        its memory (held plus taken so far in this pass), over the job's weight, in units of
        cores so that it compares with ``share`` (weighted dominant-resource fairness)."""
        cores = self.held.get(job, 0) + self.taken.get(job, 0)
        mem = (self.book.mem.get(job, 0) + self.mem_taken.get(job, 0)) * self.mem_scale
        return max(cores, mem) / self.book.weight(job)

    def take(self, job: str, units: int) -> None:
        self.taken[job] = self.taken.get(job, 0) + units

    def take_mem(self, job: str, mib: int) -> None:
        self.mem_taken[job] = self.mem_taken.get(job, 0) + mib

    def room(self, job: str) -> int | None:
        """Units ``job`` may still take in this pass (None: no cap)."""
        cap = self.book.cap(job, self.pool)
        return None if cap is None else cap - self.held.get(job, 0) - self.taken.get(job, 0)

    def limit(self, job: str) -> int | None:
        """Units beyond their minimums ``job``'s candidates may still get in this pass: what
        its cap leaves and, while several jobs want the pool, what its weighted share of the
        pool's units leaves (weighted max-min of the elastic grants); None: no bound."""
        room = self.room(job)
        if self.total:
            share = int(self.total * self.book.weight(job) / self.wsum)
            left = share - self.held.get(job, 0) - self.taken.get(job, 0)
            room = left if room is None else min(room, left)
        return room

    def limits(self) -> bool:
        """Whether ``limit`` bounds anyone in this pass."""
        return bool(self.total) or self.book.capped(self.pool)

    def over_cap(self, w: Waiting, need: int) -> bool:
        """Whether ``need`` more units take ``w``'s job past its cap; if so the job is passed
        over for the rest of the pass (FCFS within it) and ``w`` says why."""
        job = w.job
        if job in self.capped:
            w.status = self._at_cap(job)
            return True
        room = self.room(job)
        if room is None or need <= room:
            return False
        self.capped.add(job)
        w.status = self._at_cap(job)
        return True

    def _at_cap(self, job: str, held: int | None = None) -> Status:
        cap = self.book.cap(job, self.pool) or 0
        held = self.held.get(job, 0) + self.taken.get(job, 0) if held is None else held
        unit = UNITS.get(self.pool, "units")
        return wait(
            Shortfall(self.pool, cap, max(0, cap - held), cap, f"job {job or 'default'}"),
            message=f"job {job or 'default'} is at its cap of {cap} {unit}",
        )

    def pick(self, heads: Mapping[str, int]) -> str:
        """The job (of ``heads``: job -> seq of its next action) to read next from: the one
        furthest below its share (held + taken), then the earlier submission."""
        return min(heads, key=lambda job: (job in self.capped, self.share(job), heads[job]))

    def pick_new(self, heads: Mapping[str, int]) -> str:
        """The job (of ``heads``: job -> seq of its next new trajectory) whose new trajectory
        is placed next (rule 3): the smallest dominant share, then the earlier submission."""
        return min(heads, key=lambda job: (job in self.capped, self.dominant(job), heads[job]))

    def order(self, lanes: Mapping[str, Lane]) -> Iterator[Waiting]:
        """The actions of several jobs' lanes, read lazily in fair order: as if each action
        read took its minimum (a pass reads ahead of its decisions, so what it takes cannot
        order what it reads); a job past its cap that way comes after the others."""
        its = {job: iter(lane) for job, lane in sorted(lanes.items())}
        nxt = {job: w for job, it in its.items() if (w := next(it, None)) is not None}
        ahead: dict[str, int] = {}

        def key(job: str) -> tuple[bool, float, int]:
            w, cap = nxt[job], self.book.cap(job, self.pool)
            units = self.held.get(job, 0) + ahead.get(job, 0)
            return (cap is not None and units + w.need > cap, units / self.book.weight(job), w.seq)

        while nxt:
            job = min(nxt, key=key)
            w = nxt[job]
            ahead[job] = ahead.get(job, 0) + w.need
            yield w
            got = next(its[job], None)
            if got is None:
                del nxt[job]
                continue
            nxt[job] = got
            if key(job)[0]:  # its job's next would pass its cap: it comes after the others
                got.status = self._at_cap(job, self.held.get(job, 0) + ahead[job])

    def clamp(self, w: Waiting, units: int, allowed: Demand) -> int:
        """``units`` for ``w`` cut to what its job may still get beyond its minimum
        (``limit``), taking what it keeps; the result is one of ``allowed``'s amounts."""
        room = self.limit(w.job)
        extra = units - w.need
        if room is not None and extra > room:
            units = allowed.clamp_max(w.need + max(0, room)).max
        self.take(w.job, units - w.need)
        return units


class FairLane:
    """Several jobs' lanes of one pool as the one lane a pass reads (``len``, ``iter``, ``head``)."""

    def __init__(self, fair: Fair, lanes: Mapping[str, Lane]) -> None:
        self.fair = fair
        self.lanes = lanes

    def __len__(self) -> int:
        return sum(len(lane) for lane in self.lanes.values())

    def __iter__(self) -> Iterator[Waiting]:
        return self.fair.order(self.lanes)

    def head(self) -> Waiting | None:
        """The head of the job to serve next (jobs passed over at their cap are not asked)."""
        capped = self.fair.capped
        heads = {
            job: h for job, lane in self.lanes.items() if job not in capped and (h := lane.head()) is not None
        }
        if not heads:
            return None
        return heads[self.fair.pick({job: h.seq for job, h in heads.items()})]


def ordered(book: JobBook, lanes: Mapping[str, Lane], pool: str) -> tuple[Fair, Lane | FairLane]:
    """A pass's fair view of ``pool`` and its queue in fair order: the one lane itself when
    a single job queues there and none is capped (rule 3: the paper's FCFS)."""
    fair = Fair(book, pool)
    if len(lanes) == 1 and book.cap(next(iter(lanes)), pool) is None:
        return fair, next(iter(lanes.values()))
    return fair, FairLane(fair, lanes)


def never_fits(book: JobBook, spec: ActionSpec, pool: str, job: str) -> Status | None:
    """NO_CAPACITY when ``spec``'s minimum exceeds its job's cap in ``pool`` (rule 5)."""
    cap = book.cap(job, pool)
    need = spec.key_demand.min
    if cap is None or need <= cap:
        return None
    unit = UNITS.get(pool, "units")
    return never(
        Shortfall(pool, need, cap, cap, f"job {job or 'default'}"),
        message=f"job {job or 'default'} is capped at {cap} {unit}",
    )


# -- the scheduler's handlers of the jobs' events ------------------------------------------------
def on_defined(s: Scheduler, e: ev.JobDefined, out: list[cmd.Command]) -> None:
    spec = JobSpec(e.job, e.weight, tuple(e.caps))
    if spec.problem() is not None:
        return  # drivers check specs before they send them; a bad one changes nothing
    s.jobs.define(spec)
    s._dirty.update(s.queues)


def on_joined(s: Scheduler, e: ev.JobJoined, out: list[cmd.Command]) -> None:
    s.jobs.join(e.client, e.job)


def rows(s: Scheduler) -> tuple[dict[str, object], ...]:
    """``JobBook.rows`` of the scheduler's jobs, shares taken of the whole cluster's units."""
    totals = {
        CPU: sum(n.total for n in s.cpu.nodes.values()),
        GPU: sum(n.count for n in s.gpu.nodes.values()),
    }
    totals.update({api_resource(a.name): a.limit for a in s.basic.apis.values()})
    return s.jobs.rows(s.now, s.pending.by_job, totals)
