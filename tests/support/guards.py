"""Test-wide guards and marker availability checks (used by tests/conftest.py)."""
from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import sys
from functools import cache
from typing import Any

violations: list[str] = []
_installed = False


class Swallowed(logging.Handler):
    """Collects the exceptions our code (loggers ``tangram*`` and ``agent*``) logged with their traceback
    and carried on from; errors logged without one (expected conditions) and other loggers are not ours
    to judge."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.name.startswith(("tangram", "agent")):
            exc = record.exc_info[1]
            what = f"{record.name}: {record.getMessage()[:200]} ({type(exc).__name__}: {exc})"
            self.seen.append(what[:400])


def is_loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "socket.connect":
        return
    sock, address = args[0], args[1]
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return
    host = address[0] if isinstance(address, tuple) and address else address
    if not is_loopback(host):
        msg = f"test tried to connect to non-loopback address {address!r}"
        violations.append(msg)
        raise ConnectionRefusedError(msg)


def install_network_guard() -> None:
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True


def require_real() -> bool:
    return os.environ.get("TANGRAM_REQUIRE_REAL") == "1"


@cache
def docker_missing() -> str | None:
    from .docker import docker_available

    return docker_available()


@cache
def ssh_missing() -> str | None:
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if sshd is None:
        return "sshd is not installed (apt-get install openssh-server)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "the ssh client or ssh-keygen is not installed"
    return None


@cache
def gpu_missing() -> str | None:
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return f"NVML unavailable: {exc}"
    try:
        return None if pynvml.nvmlDeviceGetCount() > 0 else "NVML finds no GPU"
    finally:
        pynvml.nvmlShutdown()
