"""Suite-wide rules: loopback-only networking, real-component markers, shared Docker fixtures.

Markers ``docker``/``ssh``/``gpu`` skip with a reason when the component is missing; with
``TANGRAM_REQUIRE_REAL=1`` (set by ``.ci/run``) a missing dockerd or sshd fails instead. ``slow`` tests
get a long timeout and are skipped only with ``TANGRAM_SKIP_SLOW=1``. A test during which an in-process
controller's core raised fails (``_core_never_raises``) unless it is marked ``core_raises``.
"""
from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `support` under any import mode

from support import guards  # noqa: E402
from support.docker import busybox_image, docker_client, hostroot_image, test_labels  # noqa: E402

__all__ = ["busybox_image", "docker_client", "hostroot_image", "test_labels"]

guards.install_network_guard()

_CHECKS = {"docker": guards.docker_missing, "ssh": guards.ssh_missing, "gpu": guards.gpu_missing}
SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slow") and os.environ.get("TANGRAM_SKIP_SLOW") == "1":
        pytest.skip("slow test skipped (TANGRAM_SKIP_SLOW=1)")
    for name, check in _CHECKS.items():
        if item.get_closest_marker(name) and (reason := check()):
            if guards.require_real() and name != "gpu":
                pytest.fail(f"{name} is required here (TANGRAM_REQUIRE_REAL=1): {reason}", pytrace=False)
            pytest.skip(f"{name}: {reason}")


class _CoreFailures(logging.Handler):
    """Collects what an in-process controller's driver says when the core raised (it logs and carries on)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage()[:300])


@pytest.fixture(autouse=True)
def _core_never_raises(request: pytest.FixtureRequest):
    """Fails a test during which an in-process controller's core raised (`core.handle failed`, `the core's
    decision failed`): the driver survives that by design, so nothing else would show it. A test that
    makes the core raise on purpose says so with ``@pytest.mark.core_raises``."""
    if request.node.get_closest_marker("core_raises"):
        yield
        return
    seen = _CoreFailures()
    driver = logging.getLogger("tangram.controller.driver")
    driver.addHandler(seen)
    try:
        yield
    finally:
        driver.removeHandler(seen)
    failed = [m for m in seen.seen if m.startswith(("core.handle failed", "the core's decision failed"))]
    if failed:
        pytest.fail("the core raised: " + "; ".join(failed[:3]), pytrace=False)


@pytest.fixture(autouse=True)
def _loopback_only():
    """Fails a test that tried a non-loopback connect, even if the test swallowed the error."""
    start = len(guards.violations)
    yield
    new = guards.violations[start:]
    if new:
        pytest.fail("; ".join(new), pytrace=False)
pytest_plugins = ["support.sshd"]
