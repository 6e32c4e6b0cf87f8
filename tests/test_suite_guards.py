"""The suite's own guards: loopback-only connects."""
from __future__ import annotations

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
