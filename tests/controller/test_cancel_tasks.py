"""The controller's task shutdown under a cancel a task does not take."""

from __future__ import annotations

import asyncio

from tangram.aiotasks import cancel_tasks


async def test_cancel_tasks_cancels_again_a_task_that_dropped_its_cancel() -> None:
    dropped = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped.append(1)  # the first cancel is lost, as in wait_for's race

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_tasks({task}), 5)
    assert task.cancelled() and dropped == [1]
