"""What a resource pass may see of the scheduler, and the few changes it may make.

The CPU and GPU passes (``cpu_pass.py``, ``gpu_pass.py``) get a ``PassContext``, never the
``Scheduler``. Each piece of state has one owner, and a pass changes it only through that
owner: cores through ``CpuNode.take``, GPU chunks through ``GpuNode.take`` (both given back
by the scheduler when an action ends), queues through ``Pending`` (via ``dequeue`` and
``reject`` here), running actions through ``start``. The duration model (T_ori, estimates,
the ApproxACTs view of a waiting action) is read here too, so that both passes and
admission agree on it. The passes' own memos live here as well: ``held`` (the CPU pass's
nodes that hold their prefix for more cores, which ``Scheduler.next_deadline`` also reads)
and ``chunk_operators`` (the GPU pass's Algorithm 4 operators per free layout). ``warming`` holds
the GPU chunks being restored ahead of their calls (``prewake.py``); ``pass_deadlines`` gives
the scheduler the times at which a held node or a warm needs deciding again.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.actions import ActionSpec
from tangram.core.approx import Behind
from tangram.core.gpu import ChunkOperator
from tangram.core.prewake import Warming
from tangram.core.state import Running, Waiting
from tangram.core.status import Shortfall

if TYPE_CHECKING:
    from tangram.core.scheduler import Scheduler


class PassContext:
    """A narrow view of one ``Scheduler`` for its passes (see the module docstring)."""

    __slots__ = (
        "_s", "chunk_operators", "config", "cpu", "gpu", "held", "jobs", "pending", "running", "sandboxes",
        "stages", "warming",
    )

    def __init__(self, sched: Scheduler) -> None:
        self._s = sched
        self.config = sched.config
        self.cpu = sched.cpu
        self.gpu = sched.gpu
        self.sandboxes = sched.sandboxes
        self.running = sched.running  # read here; changed only by ``start`` (and the scheduler's endings)
        self.pending = sched.pending  # read here; changed only by ``dequeue``, ``reject`` and ``bind``
        self.jobs = sched.jobs  # the RL jobs' weights, caps and holdings (jobs.py); read here
        self.stages = sched.stages  # staged starts (staging.py): changed by ``staging.stage`` in the CPU pass
        # node -> (its state when it held its whole CPU prefix, when to re-decide at the latest)
        self.held: dict[str, tuple[tuple[object, ...], float]] = {}
        self.chunk_operators: dict[tuple[int, tuple[tuple[int, int], ...]], ChunkOperator] = {}  # by free layout
        self.warming = Warming()  # GPU chunks restored ahead of their calls (prewake.py)

    @property
    def now(self) -> float:
        return self._s.now

    def pass_deadlines(self) -> list[float]:
        """When a held CPU node's plan expected a release, and when each warm GPU chunk's
        restore ends: the passes' own deadlines (``Scheduler.next_deadline``)."""
        now = self._s.now
        return [t for _, t in self.held.values() if t > now] + self.warming.deadlines()

    def end_warms(self) -> bool:
        """End the GPU warms that are due (``prewake.Warming.finish_due``); whether any did."""
        now = self._s.now
        if not any(t <= now for t in self.warming.deadlines()):
            return False
        return self.warming.finish_due(now, self.gpu.nodes, float(self.stamp()))

    # -- the duration model ----------------------------------------------------------------
    def estimate(self, spec: ActionSpec, units: int) -> float:
        return self._s._estimate(spec, units)

    def t_ori(self, spec: ActionSpec) -> float | None:
        return self._s._t_ori(spec)

    def min_units(self, spec: ActionSpec) -> int:
        return self._s._min_units(spec)

    def behind(self, w: Waiting) -> Behind:
        return self._s._behind_of(w)

    # -- changes -----------------------------------------------------------------------------
    def dequeue(self, aid: str) -> None:
        """Take a queued action off its queue (it starts)."""
        self._s.pending.remove(aid)

    def reject(self, pool: str, aid: str, out: list[cmd.Command], code: str, message: str,
               reasons: tuple[Shortfall, ...] = ()) -> None:
        """Take a queued action off its queue and reject it."""
        self._s._drop(pool, aid, out, code, message, reasons)

    def bind(self, sandbox: str, node: str) -> None:
        """The sandbox lives on ``node`` from now on: its queued actions join that node's queue."""
        self._s.pending.bind(sandbox, node)

    def start(self, r: Running, counted: bool = True) -> None:
        """Record a started action (its units were taken from their owner already);
        ``counted``: whether it counts as ``started`` (an exec in a reserved sandbox does not)."""
        self._s.running[r.spec.action_id] = r
        if counted:
            self.count("started")

    def stamp(self) -> int:
        """The next number of the scheduler's one sequence (LRU stamps, deadline ties)."""
        self._s._seq += 1
        return self._s._seq

    def add_deadline(self, t: float, aid: str) -> None:
        heapq.heappush(self._s._deadlines, (t, self.stamp(), aid))

    def hold(self, spec: ActionSpec, sandbox: str) -> None:
        """An exec waits for its sandbox's reservation (``Sandbox.held``)."""
        self._s.sandboxes[sandbox].held.append(spec)
        self._s._held[spec.action_id] = sandbox

    def unhold(self, aid: str) -> None:
        self._s._held.pop(aid, None)

    def count(self, name: str, k: int = 1) -> None:
        counters = self._s.counters
        counters[name] = counters.get(name, 0) + k

    def examined(self, pool: str, k: int) -> None:
        """Add to the cost meter ``Scheduler.examined``."""
        examined = self._s.examined
        examined[pool] = examined.get(pool, 0) + k
