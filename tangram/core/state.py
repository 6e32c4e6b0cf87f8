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

