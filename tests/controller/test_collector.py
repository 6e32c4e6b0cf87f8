"""The controller process's GC policy (driver.Collector): no automatic full collection; a full
one when idle and quiet, or once overdue. Process-wide settings are restored after each test."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tangram_cli.controller.driver import Collector


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_automatic_full_collection_is_off() -> None:
    Collector(quiet=lambda: True)
    assert gc.get_threshold()[2] >= 10**9


def test_young_collections_are_rare() -> None:
    """A burst's backlog is not rescanned every few thousand allocations (driver.Collector's doc)."""
    gc.set_threshold(700, 10, 10)
    Collector(quiet=lambda: True)
    young, middle, _ = gc.get_threshold()
    assert young == Collector.YOUNG >= 100_000
    assert middle == 10  # the middle generation keeps Python's pace: cycles that outlive one young
    # collection are still found long before the next full one
    before = gc.get_count()[0]
    junk = [[] for _ in range(5_000)]  # more than Python's default threshold: no collection yet
    assert gc.get_count()[0] >= before + 4_000  # (a collection would have reset the count)
    del junk


def test_full_collection_only_when_idle_and_quiet_or_overdue() -> None:
    busy = {"unfinished": True}
    c = Collector(quiet=lambda: not busy["unfinished"], idle_every_s=0.0, max_every_s=3600.0)
    c.maybe_collect(idle=True)  # idle driver, but actions are unfinished: a pause would delay them
    c.maybe_collect(idle=False)
    assert c.full == 0
    busy["unfinished"] = False
    c.maybe_collect(idle=False)  # quiet but the driver is mid-slice
    assert c.full == 0
    c.maybe_collect(idle=True)
    assert c.full == 1


def test_an_overdue_collection_runs_even_under_load() -> None:
    c = Collector(quiet=lambda: False, idle_every_s=0.0, max_every_s=0.0)
    c.maybe_collect(idle=False)
    assert c.full == 1
