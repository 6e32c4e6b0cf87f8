"""Actions: what a rollout asks for, how long it runs, and how it scales.

With ``m`` units of its key elastic resource an action takes
``getDur(m) = T_ori / (E(m) * m)`` where ``T_ori`` is its duration on one unit and
``0 < E(m) <= 1`` its parallel efficiency (docs/scheduler.md, "Paper to code"). ``E`` comes
from a profiled table or from Amdahl's law with a serial fraction. ``T_ori`` is profiled where
possible; otherwise the scheduler uses the running average of the action type (``DurationHistory``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from tangram.core.resources import CPU, Demand


class Kind(str, Enum):
    EXEC = "exec"  # a command in a sandbox (CPU)
    CALL = "call"  # a GPU service call
    LEASE = "lease"  # an API permit held by the client while it makes the call
    OPEN = "open"  # a reserved sandbox (trajectory-level baseline: holds cores until closed)


@dataclass(frozen=True)
class Elasticity:
    """Parallel efficiency ``E(m)``: a table of (units, efficiency) or a serial fraction."""

    table: tuple[tuple[int, float], ...] = ()
    serial_fraction: float | None = None

    @staticmethod
    def amdahl(serial_fraction: float) -> Elasticity:
        return Elasticity(serial_fraction=serial_fraction)

    @staticmethod
    def of_table(table: Mapping[int, float]) -> Elasticity:
        return Elasticity(table=tuple(sorted((int(k), float(v)) for k, v in table.items())))

    def efficiency(self, m: int) -> float:
        if m <= 1:
            return 1.0
        if self.serial_fraction is not None:
            s = self.serial_fraction
            return 1.0 / (s * m + (1.0 - s))  # speedup / m with speedup = 1 / (s + (1-s)/m)
        return self._from_table(m)

    def _from_table(self, m: int) -> float:
        pts = self.table
        if not pts:
            return 1.0 / m  # no table: no speed-up
        if m <= pts[0][0]:
            return pts[0][1]
        for (m0, e0), (m1, e1) in zip(pts, pts[1:], strict=False):
            if m <= m1:
                # interpolate the speed-up m*E(m) linearly between the profiled points
                s0, s1 = m0 * e0, m1 * e1
                speedup = s0 + (s1 - s0) * (m - m0) / (m1 - m0)
                return speedup / m
        last_m, last_e = pts[-1]
        return last_m * last_e / m  # beyond the table: no further speed-up

    def max_useful(self) -> int | None:
        """Units beyond which the table promises no speed-up (None: unbounded)."""
        return self.table[-1][0] if self.table else None

    def problem(self) -> str | None:
        if self.serial_fraction is not None and not 0.0 <= self.serial_fraction <= 1.0:
            return "serial_fraction must be within [0, 1]"
        for m, e in self.table:
            if m < 1 or not 0.0 < e <= 1.0:
                return f"efficiency table entry {m}: {e} must have units >= 1 and 0 < E <= 1"
        return None


def duration(t_ori: float, elasticity: Elasticity | None, m: int) -> float:
    """getDur(m) = T_ori / (E(m) * m); without elasticity the action does not scale."""
    if elasticity is None or m <= 1:
        return t_ori
    return t_ori / (elasticity.efficiency(m) * m)


@dataclass(frozen=True)
class ActionSpec:
    """One action as the scheduler sees it.

    ``demand`` maps resource type to the feasible amounts; ``key`` is the one elastic
    resource; ``sandbox`` is the trajectory's environment (EXEC, OPEN); ``service`` the GPU
    service (CALL); ``api`` the API name (LEASE). ``t_ori`` is the profiled single-unit
    duration in seconds (None: use the history of ``action_type``). ``timeout_s`` bounds
    queueing plus running (0: none). ``tokens`` (LEASE): what the call will be charged against
    a key's tokens-per-minute limit (prompt + maximum output; 0: none). ``api_key`` (LEASE): a
    lease restored after a controller restart names the key it held, and is granted on it again.
    """

    action_id: str
    kind: Kind
    demand: tuple[tuple[str, Demand], ...]
    key: str = CPU
    action_type: str = ""
    trajectory: str = ""
    task: str = ""
    client: str = ""
    sandbox: str = ""
    service: str = ""
    api: str = ""
    elasticity: Elasticity | None = None
    t_ori: float | None = None
    timeout_s: float = 0.0
    mem_mib: int = 0
    extra: tuple[tuple[str, str], ...] = field(default=())
    tokens: int = 0
    api_key: str = ""

    def demand_of(self, resource: str) -> Demand:
        for r, d in self.demand:
            if r == resource:
                return d
        return Demand.fixed(0)

    @property
    def key_demand(self) -> Demand:
        """The demand of the key resource (kept on the spec: every pass reads it)."""
        try:
            return self.__dict__["_key_demand"]  # type: ignore[no-any-return]
        except KeyError:
            d = self.__dict__["_key_demand"] = self.demand_of(self.key)
            return d


class DurationHistory:
    """Running mean of single-unit work ``T_ori`` per action type (exponential, alpha)."""

    def __init__(self, alpha: float = 0.2, default_s: float = 1.0) -> None:
        self.alpha = alpha
        self.default_s = default_s
        self._mean: dict[str, float] = {}

    def record(self, action_type: str, t_ori: float) -> None:
        if not action_type or t_ori < 0:
            return
        old = self._mean.get(action_type)
        self._mean[action_type] = t_ori if old is None else old + self.alpha * (t_ori - old)

    def known(self, action_type: str) -> bool:
        return action_type in self._mean

    def t_ori(self, spec: ActionSpec) -> float | None:
        """Profiled T_ori if given, else the type's history, else None (unknown)."""
        if spec.t_ori is not None:
            return spec.t_ori
        return self._mean.get(spec.action_type)

    def estimate(self, spec: ActionSpec) -> float:
        t = self.t_ori(spec)
        return self.default_s if t is None else t

    def items(self) -> list[tuple[str, float]]:
        return sorted(self._mean.items())
