"""The controller's driver loop: next event or deadline -> core.handle -> journal -> dispatch.

Rules:

1. Only the driver task calls the core. Everything else (agent link, gateway, timers) posts
   events with `Driver.post(event, after=None)`; `after(commands)` runs right after the
   commands of that event were dispatched (the gateway uses it to answer a request once the
   core has decided, e.g. `Accepted` only when the core did not reject at once).
2. When no event arrives before `core.next_deadline()`, the driver feeds a `Tick`.
3. Every event and its commands are journaled before dispatch (`--journal FILE`), with the
   time in seconds since controller start, so live and simulated journals share one format.
4. `dispatch(event, commands)` must not block: it sends messages without waiting and starts
   tasks for anything that has to wait (sandbox creation, GPU load order).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tangram.core import events as ev
from tangram.core.commands import Command
from tangram.core.scheduler import Scheduler

log = logging.getLogger("tangram.controller.driver")

After = Callable[[list[Command] | None], None]  # None: the core raised (answer INTERNAL)
Dispatch = Callable[[ev.Event, list[Command]], None]


class WallClock:
    """Monotonic seconds since the clock was made (journals count from controller start)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def until(self, t: float | None) -> float | None:
        """Seconds until core time `t` (never negative); None: no deadline."""
        return None if t is None else max(0.0, t - self.now())


class Journal(Protocol):
    def append(self, t: float, event: ev.Event, commands: list[Command]) -> None: ...
    def close(self) -> None: ...


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def record_of(t: float, seq: int, event: ev.Event, commands: list[Command]) -> dict[str, Any]:
    """One journal record: {"t", "seq", "event": {"type", ...}, "commands": [{"type", ...}]}."""

    def typed(obj: object) -> dict[str, Any]:
        body = _plain(obj)
        assert isinstance(body, dict)
        return {"type": type(obj).__name__, **body}

    return {"t": round(t, 6), "seq": seq, "event": typed(event), "commands": [typed(c) for c in commands]}


class JsonlJournal:
    """Minimal JSONL journal: a header line, then one record per event (see `record_of`).

    Stand-in until the shared `tangram.journal` lands; the record shape follows the design
    (t, seq, event, commands), so switching changes no reader.
    """

    def __init__(self, path: str, *, cluster: str = "local") -> None:
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._seq = 0
        header = {
            "journal": "tangram",
            "version": 1,
            "clock": "wall",
            "cluster": cluster,
            "started_unix": time.time(),
        }
        self._fh.write(json.dumps(header, sort_keys=True) + "\n")
        self._fh.flush()

    def append(self, t: float, event: ev.Event, commands: list[Command]) -> None:
        self._seq += 1
        self._fh.write(
            json.dumps(record_of(t, self._seq, event, commands), sort_keys=True, default=str) + "\n"
        )
        self._fh.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._fh.close()


class NullJournal:
    def append(self, t: float, event: ev.Event, commands: list[Command]) -> None:
        pass

    def close(self) -> None:
        pass


def open_journal(path: str | None, cluster: str) -> Journal:
    if not path:
        return NullJournal()
    try:
        from tangram.journal import open_writer  # type: ignore[attr-defined]  # the shared journal, once it exists
    except ImportError:
        return JsonlJournal(path, cluster=cluster)
    return open_writer(path, cluster=cluster, clock="wall")  # type: ignore[no-any-return]


class Driver:
    def __init__(self, core: Scheduler, clock: WallClock, journal: Journal, dispatch: Dispatch) -> None:
        self.core = core
        self.clock = clock
        self.journal = journal
        self.dispatch = dispatch
        self.inbox: asyncio.Queue[tuple[ev.Event, After | None]] = asyncio.Queue()
        self.handled = 0
        self.loop_lag_s = 0.0  # longest single handle+dispatch, for status

    def post(self, event: ev.Event, after: After | None = None) -> None:
        self.inbox.put_nowait((event, after))

    def step(self, event: ev.Event, after: After | None = None) -> list[Command]:
        """Handle one event now (driver task only)."""
        started = time.monotonic()
        now = self.clock.now()
        try:
            commands = self.core.handle(event, now)
        except Exception:
            if after is not None:
                after(None)
            raise
        self.handled += 1
        try:
            self.journal.append(now, event, commands)
        except Exception:
            log.exception("journal append failed")
        try:
            self.dispatch(event, commands)
        except Exception:
            log.exception("dispatch failed for %r", event)
        if after is not None:
            try:
                after(commands)
            except Exception:
                log.exception("after-callback failed for %r", event)
        self.loop_lag_s = max(self.loop_lag_s * 0.99, time.monotonic() - started)
        return commands

    async def run(self) -> None:
        getter: asyncio.Task[tuple[ev.Event, After | None]] | None = None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(self.inbox.get())
                timeout = self.clock.until(self.core.next_deadline())
                done, _ = await asyncio.wait({getter}, timeout=timeout)
                if getter in done:
                    event, after = getter.result()
                    getter = None
                else:
                    event, after = ev.Tick(), None
                try:
                    self.step(event, after)
                except Exception:
                    log.exception("core.handle failed for %r", event)
                # drain whatever is already queued before sleeping again
                while getter is None and not self.inbox.empty():
                    event, after = self.inbox.get_nowait()
                    try:
                        self.step(event, after)
                    except Exception:
                        log.exception("core.handle failed for %r", event)
        finally:
            if getter is not None:
                getter.cancel()
