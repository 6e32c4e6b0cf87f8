"""The suite's own guards: loopback-only connects, no swallowed exceptions."""
from __future__ import annotations

import logging
import socket

import pytest
from support import guards


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "localhost", "::ffff:127.0.0.1"])
def test_loopback_allowed(host):
    assert guards.is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "169.254.169.254", "8.8.8.8", "::ffff:8.8.8.8", "example.com", "", None])
def test_non_loopback_refused(host):
    assert not guards.is_loopback(host)


def test_connect_to_non_loopback_raises_in_the_hook():
    before = len(guards.violations)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(ConnectionRefusedError, match="non-loopback"):
            s.connect(("192.0.2.1", 9))
    finally:
        s.close()
    del guards.violations[before:]  # this test meant it


def test_loopback_connect_passes():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    with srv, socket.create_connection(srv.getsockname(), timeout=2):
        pass


@pytest.mark.swallows_exceptions  # (it logs one on purpose: the suite-wide guard would fail it)
def test_swallowed_exceptions_are_ours_with_a_traceback():
    seen = guards.Swallowed()
    root = logging.getLogger()
    root.addHandler(seen)
    try:
        try:
            {}["sb-1"]
        except KeyError:
            logging.getLogger("tangram.controller.driver").exception("core.handle failed for SandboxClosed")
        logging.getLogger("tangram.controller.agents").error("prepare of svc on n1 failed: out of memory")
        try:
            raise ValueError("not ours")
        except ValueError:
            logging.getLogger("asyncssh").exception("a library's own")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("agent.executors.spawner").exception("handling a message failed")
    finally:
        root.removeHandler(seen)
    assert len(seen.seen) == 2, seen.seen
    assert seen.seen[0].startswith("tangram.controller.driver: core.handle failed") and "KeyError" in seen.seen[0]
    assert seen.seen[1].startswith("agent.executors.spawner: handling a message failed") and "boom" in seen.seen[1]
