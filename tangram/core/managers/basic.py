"""Basic manager: API slots under a concurrency limit or a quota per period (paper §5).

Contract:
1. ``concurrency`` mode: at most ``limit`` leases in flight at once.
2. ``quota`` mode: at most ``limit`` leases granted per period; periods are aligned to the
   first use, and ``next_deadline`` is the start of the next period while work waits.
3. ``release`` is idempotent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CONCURRENCY = "concurrency"
QUOTA = "quota"


@dataclass
class Api:
    name: str
    mode: str
    limit: int
    period_s: float = 60.0
    in_flight: set[str] = field(default_factory=set)
    window_start: float | None = None
    used: int = 0

    def roll(self, now: float) -> None:
        if self.mode != QUOTA or self.window_start is None:
            return
        if now >= self.window_start + self.period_s:
            periods = int((now - self.window_start) // self.period_s)
            self.window_start += periods * self.period_s
            self.used = 0

    def free(self, now: float) -> int:
        self.roll(now)
        if self.mode == QUOTA:
            return max(0, self.limit - self.used)
        return max(0, self.limit - len(self.in_flight))

    def take(self, lease: str, units: int, now: float) -> None:
        self.roll(now)
        if self.mode == QUOTA:
            if self.window_start is None:
                self.window_start = now
            self.used += units
        self.in_flight.add(lease)

    def release(self, lease: str) -> None:
        self.in_flight.discard(lease)

    def spent(self, used: int, window_start: float, now: float) -> None:
        """Quota spent in a window that began at ``window_start`` (restored after a restart)."""
        if self.mode == QUOTA and now < window_start + self.period_s:
            self.window_start, self.used = window_start, used

    def next_window(self) -> float | None:
        if self.mode != QUOTA or self.window_start is None:
            return None
        return self.window_start + self.period_s


class BasicManager:
    def __init__(self) -> None:
        self.apis: dict[str, Api] = {}

    def define(self, name: str, mode: str, limit: int, period_s: float) -> None:
        old = self.apis.get(name)
        api = Api(name, mode, limit, period_s)
        if old is not None:
            api.in_flight, api.window_start, api.used = old.in_flight, old.window_start, old.used
        self.apis[name] = api
