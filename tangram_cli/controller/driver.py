"""The controller's driver loop: next event or deadline -> core.handle -> journal -> dispatch.

Rules:

1. Only the driver task calls the core. Everything else (agent link, gateway, timers) posts
   events with `Driver.post(event, after=None)`; `after(commands)` runs once the batch that
   held the event was decided and dispatched (the gateway uses it to answer a request once the
   core has decided, e.g. `Accepted` only when the core neither rejected nor started it).
2. Events waiting together are handled as one batch (at most `BATCH_MAX`, one `now`): each is
   applied, and the core decides once, after the last. When no event arrives before
   `core.next_deadline()`, the driver feeds a `Tick`.
3. Every event and its commands are journaled before dispatch (`--journal FILE`), with the
   time in seconds since controller start, so live and simulated journals share one format.
4. `dispatch(event, commands)` must not block: it sends messages without waiting and starts
   tasks for anything that has to wait (sandbox creation, GPU load order).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tangram.clock import WallClock
from tangram.core import events as ev
from tangram.core.commands import Command
from tangram.core.scheduler import Scheduler
from tangram.journal import Journal as SharedJournal

__all__ = ["Driver", "LiveJournal", "NullJournal", "WallClock", "open_journal"]

log = logging.getLogger("tangram.controller.driver")

# Events that only follow something the core already did (a start, a node's arrival), so they
# may overtake queued submissions without reordering anything a client said.
URGENT = (ev.ActionFinished, ev.NodeLost, ev.NodeJoined, ev.ServiceEvicted)

SLOW_DECISION_S = 0.05  # a decision this long is logged, with its event type, and kept for status

SLICE_S = 0.02  # the longest the driver handles queued events before it lets the loop run

BATCH_MAX = 256  # the most events decided together (one pass over the queues per batch)

After = Callable[[list[Command] | None], None]  # None: the core raised (answer INTERNAL)
Dispatch = Callable[[ev.Event, list[Command]], None]


class Journal(Protocol):
    def append(self, t: float, event: ev.Event, commands: list[Command]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class LiveJournal:
    """The shared canonical journal (`tangram.journal`). Records are buffered and handed to the
    OS when the driver goes idle and at least every `SLICE_S` while it is busy (`flush`), so a
    killed controller leaves a complete prefix missing at most the last slice; there is no
    fsync (a machine crash can lose what the OS had not written). A write per record would
    cost more than the decision it records."""

    def __init__(self, path: str, **meta: Any) -> None:
        self._journal = SharedJournal.to_path(path, append=True, **meta)

    def append(self, t: float, event: ev.Event, commands: list[Command]) -> None:
        self._journal.append(t, event, commands)

    def flush(self) -> None:
        self._journal.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._journal.close()


class NullJournal:
    def append(self, t: float, event: ev.Event, commands: list[Command]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_journal(path: str | None, cluster: str, epoch: int = 0) -> Journal:
    """The decision journal; a restarted controller appends after its predecessor (a header
    line per epoch). `tangram.journal.read` reads one run: split the file at header lines."""
    if not path:
        return NullJournal()
    return LiveJournal(path, driver="controller", cluster=cluster, clock="wall", epoch=epoch)


class LatencyWindow:
    """The last `size` samples of a duration, for p50/p99 in status (O(1) per sample)."""

    def __init__(self, size: int = 4096) -> None:
        self.samples: list[float] = []
        self.size = size
        self._next = 0

    def add(self, seconds: float) -> None:
        if len(self.samples) < self.size:
            self.samples.append(seconds)
        else:
            self.samples[self._next] = seconds
            self._next = (self._next + 1) % self.size

    def quantiles(self) -> dict[str, float | None]:
        if not self.samples:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None, "n": 0}
        ordered = sorted(self.samples)

        def pick(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 4)

        return {
            "p50_ms": pick(0.5),
            "p99_ms": pick(0.99),
            "max_ms": round(ordered[-1] * 1e3, 4),
            "n": len(ordered),
        }


class Collector:
    """The controller process's cyclic garbage collection, moved off the hot path.

    Python's automatic full (generation 2) collection scans every tracked object; with 10^4
    to 10^5 actions queued that is over a million objects and a 100-300 ms pause that stops
    sockets, heartbeats and decisions mid-burst (measured: 12 such pauses, up to 312 ms,
    collecting almost nothing, in a 10^5-exec burst). So the process entry (`run_controller`)
    installs this: objects alive at start are frozen out of collection, automatic collection
    keeps only the young generations, and the driver asks for a full collection when it is idle
    and no action is unfinished (at most every `idle_every_s`), or anyway once `max_every_s`
    passed without one, so cycles that reach the old generation are still freed. Process-wide,
    so never used in-process (tests, benches that embed a controller).

    The youngest generation is collected after `YOUNG` more tracked objects than were freed
    (Python's default: 700). A burst's backlog is young when it arrives, and what is answered a
    moment later is young too: at 10,000 the collector scanned it over and over (10^5 instant
    execs: 65-69 young and 5 middle collections, 1.2-1.4 s of the controller's 17-18 s of CPU,
    pauses up to 155 ms); at 100,000 it ran 4 times (0.2-0.4 s, the longest pause 195 ms), and
    the burst ran 12-15% faster (docs/performance.md, eleventh round). The controller makes almost no
    cyclic garbage on the action path (the same burst with collection off ended at the same RSS),
    so collecting rarely holds no memory back."""

    YOUNG = 100_000

    def __init__(
        self, quiet: Callable[[], bool], idle_every_s: float = 30.0, max_every_s: float = 300.0
    ) -> None:
        self.quiet = quiet  # True when no work is unfinished (a pause then delays nobody)
        self.idle_every_s, self.max_every_s = idle_every_s, max_every_s
        self.last = time.monotonic()
        self.full = 0
        self.longest_s = 0.0
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(max(young, self.YOUNG), middle, 1_000_000_000)  # no automatic full collection

    def maybe_collect(self, idle: bool) -> None:
        now = time.monotonic()
        since = now - self.last
        if since < self.idle_every_s or (not (idle and self.quiet()) and since < self.max_every_s):
            return
        gc.collect()
        took = time.monotonic() - now
        self.last, self.full, self.longest_s = time.monotonic(), self.full + 1, max(self.longest_s, took)
        if took > 0.1:
            log.info("full garbage collection took %.0f ms (%s)", took * 1e3, "idle" if idle else "overdue")


def _wake(waiter: asyncio.Future[bool] | None, timed_out: bool) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(timed_out)


class Driver:
    def __init__(self, core: Scheduler, clock: WallClock, journal: Journal, dispatch: Dispatch) -> None:
        self.core = core
        self.clock = clock
        self.journal = journal
        self.dispatch = dispatch
        self._urgent: collections.deque[tuple[ev.Event, After | None]] = collections.deque()
        self._normal: collections.deque[tuple[ev.Event, After | None]] = collections.deque()
        self._waiter: asyncio.Future[bool] | None = None  # the idle driver's: True when its deadline came
        self.handled = 0
        self.loop_lag_s = 0.0  # longest single handle+dispatch, for status
        self.yields = 0  # times a long drain gave the loop back (SLICE_S)
        self.decide = LatencyWindow()  # core.handle times (s), for status p50/p99
        self.collector: Collector | None = None  # set by the process entry (run_controller)
        # the last decisions over SLOW_DECISION_S, as (ms, event type, commands), for status
        self.slow: collections.deque[tuple[float, str, int]] = collections.deque(maxlen=8)
        # around each batch: the controller holds its sends there, so what one batch decides goes
        # out as one message per peer (`wire.Batcher`); none by default (tests, start-up)
        self.holding: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    def _flush(self) -> None:
        try:
            self.journal.flush()
        except Exception:
            log.exception("journal flush failed")

    def post(self, event: ev.Event, after: After | None = None) -> None:
        """Queue an event for the core. Completions and node changes go first: they free units
        and answer clients, and a burst of submissions must not starve them. Everything a
        client sends (submissions, cancels, ClientGone) keeps its arrival order."""
        (self._urgent if isinstance(event, URGENT) else self._normal).append((event, after))
        _wake(self._waiter, False)

    @property
    def pending(self) -> int:
        return len(self._urgent) + len(self._normal)

    def step(self, event: ev.Event, after: After | None = None) -> list[Command]:
        """Handle one event now and decide (driver task, or start-up before it runs)."""
        return self.batch([(event, after)])[-1]

    def batch(self, items: list[tuple[ev.Event, After | None]]) -> list[list[Command]]:
        """Handle `items` at one instant and decide once, after the last (`Scheduler.handle`'s
        ``decide=False``). Each event's own commands are journaled and dispatched as it is
        applied; the decision's go with the last event, as the simulator journals a batch of
        one instant. The `after` callbacks run once everything is dispatched, so an `Accepted`
        goes only to requests still queued after the decision. Returns each event's commands."""
        with self.holding():
            return self._batch(items)

    def _batch(self, items: list[tuple[ev.Event, After | None]]) -> list[list[Command]]:
        now = self.clock.now()
        done: list[list[Command]] = []
        failed: list[After | None] = []
        last = len(items) - 1
        for i, (event, after) in enumerate(items):
            started = time.perf_counter()
            try:
                commands = self.core.handle(event, now, decide=False)
            except Exception as exc:  # what it emitted before the error is still carried out
                log.error("core.handle failed for %r", event, exc_info=exc.__cause__ or exc)
                commands = list(getattr(exc, "commands", ()))
                failed.append(after)
            if i == last:
                try:
                    commands.extend(self.core.decide(now))
                except Exception as exc:  # DecisionFailed: the starts made before the error go out
                    log.error("the core's decision failed after %r", event, exc_info=exc.__cause__ or exc)
                    commands.extend(getattr(exc, "commands", ()))
            self._record(started, event, commands)
            try:
                self.journal.append(now, event, commands)
            except Exception:
                log.exception("journal append failed")
            try:
                self.dispatch(event, commands)
            except Exception:
                log.exception("dispatch failed for %r", event)
            done.append(commands)
        for (_event, after), commands in zip(items, done, strict=True):
            if after is None:
                continue
            try:
                after(None if after in failed else commands)
            except Exception:
                log.exception("after-callback failed for %r", _event)
        return done

    def _record(self, started: float, event: ev.Event, commands: list[Command]) -> None:
        took = time.perf_counter() - started
        self.decide.add(took)
        self.handled += 1
        if took > SLOW_DECISION_S:
            self.slow.append((round(took * 1e3, 1), type(event).__name__, len(commands)))
            log.warning(
                "slow decision: %.0f ms for %s (%d commands)", took * 1e3, type(event).__name__, len(commands)
            )
        self.loop_lag_s = max(self.loop_lag_s * 0.99, took)

    def _take(self) -> list[tuple[ev.Event, After | None]]:
        """The next batch: completions and node changes first, then the rest in arrival order,
        at most `BATCH_MAX` events."""
        out: list[tuple[ev.Event, After | None]] = []
        for lane in (self._urgent, self._normal):
            while lane and len(out) < BATCH_MAX:
                out.append(lane.popleft())
        return out

    async def _idle(self, timeout: float | None) -> bool:
        """Sleep until an event is posted (False) or `timeout` seconds passed (True). A bare future
        and at most one timer, not `asyncio.wait_for` on an `Event` (a task, a future and a timer
        made and dropped every time the driver runs dry: at 16 actions in flight that is several
        times per action)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(max(timeout, 0.0), _wake, waiter, True)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def run(self) -> None:
        """Handle events until cancelled, in batches (`_take`): completions first, then the rest
        in arrival order; a `Tick` when nothing arrives before the core's next deadline; the
        loop is given back every `SLICE_S` so sockets, heartbeats and status are served during
        a burst."""
        while True:
            if not self.pending:
                self._flush()  # idle: what was decided reaches the OS before the driver sleeps
                if self.collector is not None:
                    self.collector.maybe_collect(idle=True)
                if await self._idle(self.clock.until(self.core.next_deadline())):
                    self.step(ev.Tick())
                continue
            slice_end = time.perf_counter() + SLICE_S
            while self.pending:
                self.batch(self._take())
                if time.perf_counter() >= slice_end:
                    self.yields += 1
                    self._flush()
                    if self.collector is not None:
                        self.collector.maybe_collect(idle=False)
                    await asyncio.sleep(0)
                    slice_end = time.perf_counter() + SLICE_S

