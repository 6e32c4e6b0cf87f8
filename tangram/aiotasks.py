"""Stopping asyncio tasks for good: shared by the client library and the controller.

Python 3.11's `asyncio.wait_for` can drop a cancel that crosses the event it waited for (the
inner future completes in the same loop iteration): the task then runs on, and one `cancel()`
followed by `await task` waits forever. The client transport's monitor reads and the controller
driver's idle wait both use `wait_for`, so their owners stop them with `cancel_tasks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("tangram.aiotasks")

__all__ = ["cancel_tasks"]

ROUNDS = 20  # cancels, half a second apart: at most 10 s for a task that takes none


async def cancel_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until each is done: one still running half a second after its
    cancel is cancelled again, at most `ROUNDS` times; one that takes no cancel at all is left
    running and named in the log. Their results and exceptions are retrieved (no warnings)."""
    tasks = list(tasks)
    running = {t for t in tasks if not t.done()}
    for _ in range(ROUNDS):
        if not running:
            break
        for t in running:
            t.cancel()
        _, running = await asyncio.wait(running, timeout=0.5)
    for t in running:
        log.warning("task %s did not stop after %d cancels; left running", t.get_name(), ROUNDS)
    for t in tasks:
        if t.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                t.result()
