"""Waiting for something that happens after a fire-and-forget message (one helper for the suite)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


async def until(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
                poll_s: float = 0.02) -> None:
    """Poll `cond()` on the running loop until it is true; fail the test naming `what` after `timeout`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, f"{what} not met within {timeout} s"
        await asyncio.sleep(poll_s)
