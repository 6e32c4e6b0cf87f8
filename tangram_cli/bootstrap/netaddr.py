"""Is an address one of this machine's? Used before the controller binds (daemon.py), by
`up --dry-run` (inventory/preflight.py) and to word `up`'s error when the controller could not bind.

Stdlib only. The test is a bind of ``(address, 0)``: the kernel's answer, which also covers
addresses a listing would miss (all of 127.0.0.0/8, ``ip_nonlocal_bind``). The listing
(``local_addresses``) is only for the hint that names what to write instead.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from pathlib import Path

NOT_LOCAL = (errno.EADDRNOTAVAIL,)


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` (an IP literal, bracketed or not, or a name) stands for."""
    bare = host.strip().strip("[]")
    try:
        return [str(ipaddress.ip_address(bare))]
    except ValueError:
        pass
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        return sorted({str(i[4][0]) for i in infos})
    return []


def bind_error(address: str) -> OSError | None:
    """Bind a TCP socket to ``(address, 0)``; the error, or None when it may be bound here."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as exc:
        return exc
    return None


def not_local(host: str) -> list[str]:
    """The addresses of ``host`` this machine cannot bind because they are not its own."""
    out = []
    for addr in resolve(host):
        exc = bind_error(addr)
        if exc is not None and exc.errno in NOT_LOCAL:
            out.append(addr)
    return out


def _ipv4_from_fib_trie() -> set[str]:
    """Local IPv4 addresses: the ``/32 host LOCAL`` entries of /proc/net/fib_trie."""
    found: set[str] = set()
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return found
    for prev, line in zip(lines, lines[1:], strict=False):
        if "/32 host LOCAL" in line:
            addr = prev.strip().split()[-1]
            with contextlib.suppress(ValueError):
                found.add(str(ipaddress.IPv4Address(addr)))
    return found


def _ipv6_from_proc() -> set[str]:
    found: set[str] = set()
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        cols = line.split()
        if len(cols) < 6:
            continue
        with contextlib.suppress(ValueError):
            addr = ipaddress.IPv6Address(int(cols[0], 16))
            if not addr.is_link_local:  # needs a %scope to bind: not worth offering
                found.add(str(addr))
    return found


def local_addresses() -> list[str]:
    """This machine's interface addresses (IPv4 first, loopback last), best effort."""
    found = _ipv4_from_fib_trie() | _ipv6_from_proc()
    if not found:
        with contextlib.suppress(OSError):
            found = set(resolve(socket.gethostname()))
    found.add("127.0.0.1")

    def key(a: str) -> tuple[bool, bool, int, str]:
        ip = ipaddress.ip_address(a)
        return (ip.is_loopback, ip.version == 6, ip.version, a)

    return sorted(found, key=key)


def not_local_message(host: str, addrs: list[str]) -> str:
    """``10.0.0.10 is not an address of this machine``."""
    shown = host if addrs == [host.strip().strip("[]")] else f"{host} ({', '.join(addrs)})"
    return f"{shown} is not an address of this machine"


def not_local_hint(key: str = "controller.bind") -> str:
    """``set controller.bind in the inventory to one of this machine's addresses: ...``."""
    return f"set {key} in the inventory to one of this machine's addresses: {', '.join(local_addresses())}"
