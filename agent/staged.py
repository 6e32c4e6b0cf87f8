"""Staged starts on the agent (the core's side: tangram/core/staging.py).

A ``Spawn`` with ``after`` set was decided on the cores of action ``after``, which still runs
here: the agent starts it the moment ``after``'s process is gone, whatever its outcome, without
waiting for the controller. Until then the staged action is tracked like a running one (a
Hello lists it; a ``Kill`` drops it unstarted and answers at once, before ``after``'s result).

``Flights`` counts the ``Spawn`` requests in flight per action from the moment each is read
off the socket (so a ``Spawn(after=A)`` read right behind ``A``'s own, whose task has not run
yet, still waits for ``A``) until its reply is queued. ``wait`` says whether the staged action
may start: not when it was killed while staged, not when the session it came in has ended (a
new controller or session kills what its predecessor's sent; nothing staged by an old session
starts), and not when its predecessor overruns (``GIVE_BACK_S``: it is given back unstarted).
A staged action can itself be followed (a chain, ``stage_depth``): a link dropped unstarted
keeps the flight its followers wait on open until its own predecessor's is over
(``Flights.leave``), so the action behind it still waits for the cores to be free.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any


class Flights:
    """Spawn requests in flight per action, and a future per action that resolves when it has none."""

    def __init__(self) -> None:
        self._n: dict[str, tuple[int, asyncio.Future[None]]] = {}
        self._dropped: set[str] = set()  # staged Spawns that end unstarted (until their leave)

    def enter(self, action: str) -> None:
        n, fut = self._n.get(action) or (0, asyncio.get_running_loop().create_future())
        self._n[action] = (n + 1, fut)

    def dropped(self, action: str) -> None:
        """A staged Spawn of ``action`` ends unstarted (killed while staged, or given back)."""
        self._dropped.add(action)

    def leave(self, action: str, after: str = "") -> None:
        """One Spawn's flight of ``action`` ends (its reply is queued). One dropped unstarted
        while its predecessor ``after`` is in flight holds back what was staged behind it until
        that one's flight is over too (those cores are still in use): its future is detached
        from ``action``'s entry and resolves with the predecessor's, so a later Spawn of the
        same action (a start given back runs again) gets an entry of its own and its followers
        wait for that run only."""
        n, fut = self._n[action]
        hold = self._n.get(after) if after and action in self._dropped else None
        self._dropped.discard(action)
        if hold is None or hold[1].done():
            self._release(action, fut)
        elif n == 1:
            del self._n[action]
            hold[1].add_done_callback(lambda _f: fut.done() or fut.set_result(None))
        else:  # another Spawn of it is in flight (a resend): this flight ends with its predecessor's
            hold[1].add_done_callback(lambda _f: self._release(action, fut))

    def _release(self, action: str, fut: asyncio.Future[None]) -> None:
        entry = self._n.get(action)
        if entry is None or entry[1] is not fut:
            return
        if entry[0] > 1:
            self._n[action] = (entry[0] - 1, fut)
            return
        del self._n[action]
        if not fut.done():
            fut.set_result(None)

    def gone(self, action: str) -> asyncio.Future[None] | None:
        """A future that resolves when no Spawn of ``action`` is in flight; None: none is now."""
        entry = self._n.get(action)
        return None if entry is None else entry[1]


GO, STOP, GIVE_BACK = "go", "stop", "give back"
# A staged start waits at most this long for its predecessor (to a controller of 1.7 or later,
# ``UNSTAGE_MINOR``): the core stages only behind a chain expected to end within
# ``CoreConfig.stage_within_s`` (50 ms), so a wait ten times as long means the guess was wrong
# (an action type whose runs differ by orders of magnitude); the action is given back unstarted
# (``ExecOutcome.unstaged``) and the controller queues it again, where the next free core takes it.
GIVE_BACK_S = 0.5


async def wait(flights: Flights, action: str, after: str, stop: asyncio.Future[None], session: Any,
               current: Any, give_back: bool = False) -> tuple[str, float]:
    """Wait until ``after`` has ended here, ``stop`` (a Kill) resolves, or (``give_back``: the
    controller takes starts back) ``GIVE_BACK_S`` passes. Returns (``GO``, ``STOP`` or
    ``GIVE_BACK``, seconds waited): ``STOP`` when killed while staged or the session it came in
    (``session``; ``current()`` is the live one) has ended; ``GIVE_BACK`` when ``after`` still
    runs after ``GIVE_BACK_S``. Unless ``GO``, ``action``'s flight is marked dropped (``Flights.leave``)."""
    limit_s = GIVE_BACK_S if give_back else None
    t0 = time.monotonic()
    gone = flights.gone(after)
    if gone is not None and not gone.done() and not stop.done():
        await _first(gone, stop, limit_s)
    waited = time.monotonic() - t0
    verdict = STOP if stop.done() or current() is not session else (
        GIVE_BACK if gone is not None and not gone.done() else GO)
    if verdict != GO:
        flights.dropped(action)
    return verdict, waited


async def _first(a: asyncio.Future[None], b: asyncio.Future[None], timeout: float | None) -> None:
    """Until ``a`` or ``b`` is done, or ``timeout`` seconds passed: ``asyncio.wait(...,
    FIRST_COMPLETED)`` with one future and one timer, not its sets, checks and task wrapping
    (this runs for most actions under load: every staged start)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_f: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    a.add_done_callback(wake)
    b.add_done_callback(wake)
    timer = None if timeout is None else loop.call_later(timeout, wake)
    try:
        await waiter
    finally:
        a.remove_done_callback(wake)
        b.remove_done_callback(wake)
        if timer is not None:
            timer.cancel()
