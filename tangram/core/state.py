"""The scheduler's records: policy names, queued and running actions, sandboxes, and the
read-only views that ``Scheduler.snapshot()`` returns. Plain data; the logic that moves
these records lives in ``scheduler.py``, ``cpu_pass.py`` and ``gpu_pass.py``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tangram.core.actions import ActionSpec, Kind
from tangram.core.status import ADMITTED, Code, Status

TANGRAM, MIN, MAX, FIXED = "tangram", "min", "max", "fixed"
K = TypeVar("K")


@dataclass
class Waiting:
    spec: ActionSpec
    seq: int
    submitted: float
    deadline: float | None
    status: Status = ADMITTED
    need: int = 0  # the policy's minimum units, fixed at submission
    job: str = ""  # its client's job when it was submitted (jobs.py)
    # the CPU pass's unit options, memoised on the T_ori they were built from
    memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)


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


def expected_left(r: Running, now: float) -> float:
    """How long ``r`` is expected to run on from ``now``. One past its estimate is expected to
    need its estimated duration again (memoryless), not to end this instant."""
    return r.est_end - now if r.est_end > now else r.est_end - r.started


class RunningTable(dict[str, Running]):
    """The running actions by id, with indexes so that no event scans the whole cluster:
    per node (``on(node)``, and per node and kind), per sandbox and per client. Only
    ``[id] = r`` and ``pop(id)`` change it; every index keeps start order. ``on_start`` and
    ``on_end`` (set by the scheduler) hear of every action that enters and leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.on_start: Callable[[Running], None] | None = None
        self.on_end: Callable[[Running], None] | None = None
        self._by_node: dict[str, dict[str, Running]] = {}
        self._by_node_kind: dict[tuple[str, Kind], dict[str, Running]] = {}
        self._by_sandbox: dict[str, dict[str, Running]] = {}
        self._by_client: dict[str, dict[str, Running]] = {}
        self._changes: dict[str, int] = {}

    def __setitem__(self, aid: str, r: Running) -> None:
        old = self.get(aid)
        if old is not None:
            self._unindex(aid, old)
            if self.on_end is not None:
                self.on_end(old)
        super().__setitem__(aid, r)
        self._by_node.setdefault(r.node, {})[aid] = r
        self._by_node_kind.setdefault((r.node, r.spec.kind), {})[aid] = r
        if r.spec.sandbox:
            self._by_sandbox.setdefault(r.spec.sandbox, {})[aid] = r
        self._by_client.setdefault(r.spec.client, {})[aid] = r
        self._changes[r.node] = self._changes.get(r.node, 0) + 1
        if self.on_start is not None:
            self.on_start(r)

    def pop(self, aid: str, *default: Running) -> Running:  # type: ignore[override]
        if aid not in self:
            if default:
                return default[0]
            raise KeyError(aid)
        r = super().pop(aid)
        self._unindex(aid, r)
        if self.on_end is not None:
            self.on_end(r)
        return r

    def _unindex(self, aid: str, r: Running) -> None:
        _drop(self._by_node, r.node, aid)
        _drop(self._by_node_kind, (r.node, r.spec.kind), aid)
        _drop(self._by_sandbox, r.spec.sandbox, aid)
        _drop(self._by_client, r.spec.client, aid)
        self._changes[r.node] = self._changes.get(r.node, 0) + 1

    def __delitem__(self, aid: str) -> None:
        self.pop(aid)

    def changes(self, node: str) -> int:
        """A counter that moves whenever an action starts or ends on ``node``."""
        return self._changes.get(node, 0)

    def on(self, node: str, kind: Kind | None = None) -> dict[str, Running]:
        """The running actions placed on ``node`` (of ``kind``), in start order (a live
        view: do not mutate)."""
        if kind is None:
            return self._by_node.get(node, {})
        return self._by_node_kind.get((node, kind), {})

    def of_sandbox(self, sandbox: str) -> dict[str, Running]:
        """The running actions of ``sandbox`` (a live view: do not mutate)."""
        return self._by_sandbox.get(sandbox, {})

    def of_client(self, client: str) -> dict[str, Running]:
        """The running actions of ``client`` (a live view: do not mutate)."""
        return self._by_client.get(client, {})


def _drop(index: dict[K, dict[str, Running]], key: K, aid: str) -> None:
    found = index.get(key)
    if found is not None:
        found.pop(aid, None)
        if not found:
            del index[key]


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
    jobs: tuple[dict[str, object], ...] = ()  # per RL job: weight, caps, held, shares, mem (views.job_rows)
    staged: int = 0  # execs decided to start on a running one's cores when it ends (staging.py)



def node_row(name: str, c: Any, g: Any) -> dict[str, object]:
    """A node's status row from its CPU and GPU records (either may be None)."""
    return {
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
    }


def queue_row(w: Waiting, pool: str, now: float) -> QueueRow:
    """A waiting action's status row."""
    spec = w.spec
    demand = ",".join(f"{r}={d.min}" if not d.elastic else f"{r}={d.min}..{d.max}" for r, d in spec.demand)
    status = str(w.status) if w.status.code != Code.ADMITTED else "pending"
    return QueueRow(spec.action_id, pool, spec.kind.value, spec.client, now - w.submitted, demand, status)
