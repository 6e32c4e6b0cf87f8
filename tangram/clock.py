"""Clocks for the drivers (never for the core: the core gets ``now`` as an argument).

``WallClock`` reads the monotonic clock, counted from its creation, so a live journal
counts seconds from controller start. ``VirtualClock`` only moves when told to
(``advance_to``) and never backwards: the simulator owns it.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def until(self, deadline: float | None) -> float | None:
        """Seconds from now to ``deadline`` (0 if past; None if no deadline)."""
        ...


class WallClock:
    """Monotonic seconds since this clock was made."""

    def __init__(self) -> None:
        self._origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._origin

    def until(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - self.now())


class VirtualClock:
    """Simulated seconds; ``advance_to`` moves it forward (a move backwards is an error)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual time cannot go backwards: {t} < {self._now}")
        self._now = float(t)

    def until(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - self._now)
