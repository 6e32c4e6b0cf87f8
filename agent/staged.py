"""Staged starts on the agent (the core's side: tangram/core/staging.py).

A ``Spawn`` with ``after`` set was decided on the cores of action ``after``, which still runs
here: the agent starts it the moment ``after``'s process is gone, whatever its outcome, without
waiting for the controller. Until then the staged action is tracked like a running one (a
Hello lists it; a ``Kill`` drops it unstarted and answers at once, before ``after``'s result).

``Flights`` counts the ``Spawn`` requests in flight per action from the moment each is read
off the socket (so a ``Spawn(after=A)`` read right behind ``A``'s own, whose task has not run
yet, still waits for ``A``) until its reply is queued. ``wait`` returns whether the staged
action may start: not when it was killed while staged, and not when the session it came in
has ended (a new controller or session kills what its predecessor's sent; nothing staged by
an old session starts). A staged action can itself be followed (a chain, ``stage_depth``): a
link dropped unstarted keeps its flight open until its own predecessor's is over (``leave``),
so the action behind it still waits for the cores to be free.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any


class Flights:
    """Spawn requests in flight per action, and a future per action that resolves when it has none."""

    def __init__(self) -> None:
        self._n: dict[str, tuple[int, asyncio.Future[None]]] = {}

    def enter(self, action: str) -> None:
        n, fut = self._n.get(action) or (0, asyncio.get_running_loop().create_future())
        self._n[action] = (n + 1, fut)

    def leave(self, action: str) -> None:
        n, fut = self._n[action]
        if n > 1:
            self._n[action] = (n - 1, fut)
            return
        del self._n[action]
        if not fut.done():
            fut.set_result(None)

    def gone(self, action: str) -> asyncio.Future[None] | None:
        """A future that resolves when no Spawn of ``action`` is in flight; None: none is now."""
        entry = self._n.get(action)
        return None if entry is None else entry[1]


async def wait(flights: Flights, after: str, stop: asyncio.Future[None], session: Any,
               current: Any) -> tuple[bool, float]:
    """Wait until ``after`` has ended here, or ``stop`` (a Kill) resolves. Returns (may start,
    seconds waited); ``session`` is the session the Spawn came in, ``current()`` the live one."""
    t0 = time.monotonic()
    gone = flights.gone(after)
    if gone is not None and not gone.done():
        await asyncio.wait((gone, stop), return_when=asyncio.FIRST_COMPLETED)
    waited = time.monotonic() - t0
    return not stop.done() and current() is session, waited


async def leave(flights: Flights, action: str, after: str) -> None:
    """A Spawn's flight ends once its reply is queued; a staged one's not before its
    predecessor's: one dropped unstarted while its predecessor still runs must hold back the
    action staged behind it, whose cores are still in use."""
    try:
        gone = flights.gone(after) if after else None
        if gone is not None and not gone.done():
            await asyncio.shield(gone)
    finally:
        flights.leave(action)
