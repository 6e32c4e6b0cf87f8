"""The scheduler's records: policy names, queued and running actions, sandboxes, and the
read-only views that ``Scheduler.snapshot()`` returns. Plain data; the logic that moves
these records lives in ``scheduler.py``, ``cpu_pass.py`` and ``gpu_pass.py``."""
from __future__ import annotations

from dataclasses import dataclass, field

from tangram.core.actions import ActionSpec
from tangram.core.status import ADMITTED, Status

TANGRAM, MIN, MAX, FIXED = "tangram", "min", "max", "fixed"


@dataclass
class Waiting:
    spec: ActionSpec
    seq: int
    submitted: float
    deadline: float | None
    status: Status = ADMITTED
    need: int = 0  # the policy's minimum units, fixed at submission
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


class RunningTable(dict[str, Running]):
    """The running actions by id, with an index per node (``on(node)``) so a pass over one
    node does not scan the whole cluster. Only ``[id] = r`` and ``pop(id)`` change it."""

    def __init__(self) -> None:
        super().__init__()
        self._by_node: dict[str, dict[str, Running]] = {}
        self._changes: dict[str, int] = {}

    def __setitem__(self, aid: str, r: Running) -> None:
        old = self.get(aid)
        if old is not None:
            self._by_node[old.node].pop(aid, None)
            self._changes[old.node] = self._changes.get(old.node, 0) + 1
        super().__setitem__(aid, r)
        self._by_node.setdefault(r.node, {})[aid] = r
        self._changes[r.node] = self._changes.get(r.node, 0) + 1

    def pop(self, aid: str, *default: Running) -> Running:  # type: ignore[override]
        if aid not in self:
            if default:
                return default[0]
            raise KeyError(aid)
        r = super().pop(aid)
        self._by_node[r.node].pop(aid, None)
        self._changes[r.node] += 1
        return r

    def __delitem__(self, aid: str) -> None:
        self.pop(aid)

    def changes(self, node: str) -> int:
        """A counter that moves whenever an action starts or ends on ``node``."""
        return self._changes.get(node, 0)

    def on(self, node: str) -> dict[str, Running]:
        """The running actions placed on ``node`` (a live view: do not mutate)."""
        return self._by_node.get(node, {})


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

