"""Suite-wide rules: loopback-only networking, real-component markers, shared Docker fixtures.

Markers ``docker``/``ssh``/``gpu`` skip with a reason when the component is missing; with
``TANGRAM_REQUIRE_REAL=1`` (set by ``.ci/run``) a missing dockerd or sshd fails instead. ``slow`` tests
get a long timeout and are skipped only with ``TANGRAM_SKIP_SLOW=1``. A test during which in-process code of
ours logged an exception and carried on fails (``_no_swallowed_exceptions``) unless it is marked
``swallows_exceptions``.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

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


@pytest.fixture(autouse=True)
def _no_swallowed_exceptions(request: pytest.FixtureRequest):
    """Fails a test during which in-process code of ours logged an exception and carried on: the
    controller's driver when the core raised (`core.handle failed`), a socket reader whose handler
    raised (`handling a message failed`), a failed dispatch. Those paths keep the controller and the
    agent up by design, so nothing else would show the bug. A test that makes them raise on purpose
    says so with ``@pytest.mark.swallows_exceptions``."""
    if request.node.get_closest_marker("swallows_exceptions"):
        yield
        return
    seen = guards.Swallowed()
    root = logging.getLogger()
    root.addHandler(seen)
    try:
        yield
    finally:
        root.removeHandler(seen)
    if seen.seen:
        pytest.fail("an exception was logged and swallowed: " + "; ".join(seen.seen[:3]), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _relocated_sandboxes_go(tmp_path_factory: pytest.TempPathFactory):
    """At the end of the session, removes the contained sandboxes that agents under this session's temporary
    directory relocated to ``<tmp>/tangram-sandboxes/<hash of the configured path>`` (sandbox users cannot
    pass through pytest's private directories; ``agent.executors.proc_contain.sandbox_home``). Found by the
    symlinks the executors left at the configured places. Left behind, they outlive pytest's own clean-up,
    and a later session whose numbered directory has the same path finds them (a test's sandbox then starts
    with an earlier run's files)."""
    yield
    relocated = os.path.join(os.path.realpath(tempfile.gettempdir()), "tangram-sandboxes") + os.sep
    for dirpath, dirnames, filenames in os.walk(tmp_path_factory.getbasetemp()):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) and (target := os.readlink(path)).startswith(relocated):
                shutil.rmtree(target, ignore_errors=True)


@pytest.fixture(autouse=True)
def _loopback_only():
    """Fails a test that tried a non-loopback connect, even if the test swallowed the error."""
    start = len(guards.violations)
    yield
    new = guards.violations[start:]
    if new:
        pytest.fail("; ".join(new), pytrace=False)
pytest_plugins = ["support.sshd"]
