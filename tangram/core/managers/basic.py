"""Basic manager: API slots under a concurrency limit or a quota per period (docs/scheduler.md).

Contract:
1. ``concurrency`` mode: at most ``limit`` leases in flight at once.
2. ``quota`` mode: at most ``limit`` leases granted per period; periods are aligned to the
   first use, and ``next_deadline`` is the start of the next period while work waits.
3. ``release`` is idempotent.
4. An API may list keys (``managers/keys.py``): a lease then also needs a key with room, and
   a ``limit`` of 0 means the keys' limits are the only ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tangram.core.managers.keys import ApiKey, KeyPool

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
    keys: KeyPool = field(default_factory=lambda: KeyPool(()))

    def roll(self, now: float) -> None:
        if self.mode != QUOTA or self.window_start is None:
            return
        if now >= self.window_start + self.period_s:
            periods = int((now - self.window_start) // self.period_s)
            self.window_start += periods * self.period_s
            self.used = 0

    def free(self, now: float) -> int:
        self.roll(now)
        if self.limit <= 0 and self.keys:
            return 1 << 30  # no API-wide limit: the keys' own limits apply
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
        self.keys.release(lease)

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

    def define(
        self, name: str, mode: str, limit: int, period_s: float, keys: tuple[ApiKey, ...] = ()
    ) -> None:
        old = self.apis.get(name)
        api = Api(name, mode, limit, period_s, keys=KeyPool(keys))
        if old is not None:
            api.in_flight, api.window_start, api.used = old.in_flight, old.window_start, old.used
            if [k.spec for k in old.keys.keys] == list(keys):
                api.keys = old.keys  # the same keys: keep their windows and leases
        self.apis[name] = api
