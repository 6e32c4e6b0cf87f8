"""Field values of an inventory, parsed and checked: units and names.

Units: sizes (``4GiB`` -> MiB), durations (``10s`` -> ms), cpusets (``"0-3,8"``) and GPU
selectors (``all``, an emulated count, or GPU UUIDs). Names: host names and IP literals, SSH
destinations, ports, users, paths, ids, python commands and image references, checked with
strict regular expressions because they end up in SSH destinations, remote command lines,
container labels and file names. Each parser raises ``ValueError`` with a readable message (the
loader shows it next to the entry's path); the ``Annotated`` types at the end of each section
attach them to the pydantic models in ``model.py``, which re-exports every name here.
"""

# These functions run inside pydantic validators, which turn a ValueError into a validation
# error; a TypeError would escape them. So a value of the wrong type is a ValueError here too.
# ruff: noqa: TRY004

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

from tangram import units

# --------------------------------------------------------------------------------------------
# Units

# One parser per unit for the whole project: tangram.units (rules in docs/cli.md, "Units"). The
# inventory's keys (`mem`, `connect_timeout`...) name no unit, so here the unit is required: a bare
# `mem: 64` is refused rather than read as MiB. UnitError is a ValueError, as pydantic needs.
MAX_CPU_ID = units.MAX_CPU


def parse_size_mib(value: Any) -> int:
    """``"4GiB"`` -> 4096, ``"2GB"`` -> 1907 (`tangram.units`, unit required)."""
    return units.parse_size_mib(value, "", unit_required=True)


def parse_duration_ms(value: Any) -> int:
    """``"10s"`` -> 10000, ``"500ms"`` -> 500 (`tangram.units`, unit required)."""
    return units.parse_duration_ms(value, "", unit_required=True)


def parse_cpuset(value: Any) -> tuple[int, ...]:
    """``"0-3,8"`` -> (0, 1, 2, 3, 8) (`tangram.units` cpulist)."""
    return units.parse_cpulist(value, "")


def format_cpuset(cpus: tuple[int, ...] | None) -> str | None:
    """(0, 1, 2, 5) -> ``"0-2,5"``; None stays None, no cores is ``""``."""
    if cpus is None:
        return None
    return units.format_cpulist(cpus) if cpus else ""


def parse_gpus(value: Any) -> str | int | tuple[str, ...]:
    """``all``, a count in {0, 1, 2, 4, 8} (emulated GPUs), or a list of 1, 2, 4 or 8 GPU UUIDs."""
    if value == "all" and isinstance(value, str):
        return "all"
    if isinstance(value, bool | float) or value is None:
        raise ValueError(f"expected 'all', a GPU count or a list of GPU UUIDs, got {value!r}")
    if isinstance(value, int):
        if value < 0 or value > 8 or (value & (value - 1)):
            raise ValueError(f"a GPU count must be 0, 1, 2, 4 or 8, got {value}")
        return value
    if isinstance(value, str):
        value = [value] if _UUID.match(value) else value
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected 'all', a GPU count or a list of GPU UUIDs, got {value!r}")
    if any(isinstance(u, int) and not isinstance(u, bool) for u in value):
        raise ValueError(
            "bare GPU indices are not allowed (they change across reboots); use 'all' or GPU UUIDs"
        )
    for u in value:
        if not isinstance(u, str) or not _UUID.match(u):
            raise ValueError(f"{u!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-...; see `nvidia-smi -L`)")
    if len(set(value)) != len(value):
        raise ValueError("a GPU UUID is listed twice")
    if len(value) not in (1, 2, 4, 8):
        raise ValueError(f"{len(value)} GPUs listed; a node needs 1, 2, 4 or 8 of them (buddy chunks)")
    return tuple(value)


def parse_service_duration(value: Any) -> int | None:
    """``profiled`` (None: measured at load time) or a duration."""
    if value == "profiled" and isinstance(value, str):
        return None
    return parse_duration_ms(value)


SizeMiB = Annotated[int, BeforeValidator(parse_size_mib)]
DurationMs = Annotated[int, BeforeValidator(parse_duration_ms)]
CpuSet = Annotated[tuple[int, ...], BeforeValidator(parse_cpuset)]
GpuSelector = Annotated[Any, BeforeValidator(parse_gpus)]
ServiceDuration = Annotated[Any, BeforeValidator(parse_service_duration)]

# --------------------------------------------------------------------------------------------
# Names

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_PATH = re.compile(r"^(?:~|~/|/)[A-Za-z0-9_./+@=-]*$")
_PYTHON = re.compile(r"^(?:[A-Za-z0-9_.+-]+|(?:~/|/)[A-Za-z0-9_./+@=-]+)$")
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,254}$")
_UUID = re.compile(r"^(?:GPU|MIG)-[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}$")


def check_host(value: str) -> str:
    """A DNS name (RFC 1123 labels) or an IPv4/IPv6 literal; brackets around IPv6 are removed."""
    if not isinstance(value, str):
        raise ValueError(f"expected a host name string, got {value!r}")
    if value.startswith("-"):
        raise ValueError(f"host name {value!r} starts with '-' (it would be read as an ssh option)")
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if ":" in inner:
        if "%" in inner:
            raise ValueError(f"IPv6 zone ids are not supported: {value!r}")
        try:
            return str(ipaddress.IPv6Address(inner))
        except ValueError:
            raise ValueError(f"invalid IPv6 address {value!r}") from None
    if inner != value:
        raise ValueError(f"brackets are only for IPv6 literals: {value!r}")
    if re.fullmatch(r"[\d.]+", value):
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise ValueError(f"invalid IPv4 address {value!r}") from None
    if not _HOSTNAME.match(value):
        bad = sorted({c for c in value if not (c.isascii() and (c.isalnum() or c in ".-"))})
        why = f"contains {''.join(bad)!r}" if bad else "is not a valid DNS name"
        raise ValueError(f"host name {value!r} {why} (letters, digits, '-' and '.' only)")
    return value.rstrip(".")


def parse_destination(value: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` with IPv6 as ``[::1]`` or ``[::1]:22``; a bare IPv6 literal has no port.

    Ambiguous forms (two ``@``, an empty part, a port on an unbracketed IPv6) are rejected.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a destination such as 'user@host:22', got {value!r}")
    user: str | None = None
    rest = value
    if "@" in value:
        user, _, rest = value.partition("@")
        if "@" in rest or not user:
            raise ValueError(f"ambiguous destination {value!r}")
        check_user(user)
    port: int | None = None
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise ValueError(f"unbalanced '[' in {value!r}")
        host, tail = rest[1:close], rest[close + 1 :]
        if ":" not in host:
            raise ValueError(f"brackets are only for IPv6 literals: {value!r}")
        if tail:
            if not tail.startswith(":"):
                raise ValueError(f"unexpected {tail!r} after ']' in {value!r}")
            port = check_port(tail[1:])
    elif rest.count(":") == 1:
        host, _, p = rest.partition(":")
        port = check_port(p)
    else:
        host = rest
    return user, check_host(host), port


def check_port(value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, str) and re.fullmatch(r"\d{1,5}", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a port number, got {value!r}")
    if value == 0 and allow_zero:
        return 0
    if not 1 <= value <= 65535:
        raise ValueError(f"port {value} is outside 1-65535")
    return value


def check_user(value: str) -> str:
    if not _USER.match(value):
        raise ValueError(
            f"invalid user name {value!r} (letters, digits, '_', '.', '-'; not starting with '-')"
        )
    return value


def check_path(value: str) -> str:
    if not _PATH.match(value) or "/../" in f"{value}/" or value.endswith("/.."):
        raise ValueError(
            f"invalid path {value!r} (absolute or '~/'-relative; letters, digits, '_./+@=-'; no '..')"
        )
    return value


def check_id(value: str, what: str = "name") -> str:
    if not ID_RE.match(value):
        raise ValueError(
            f"invalid {what} {value!r} (1-64 of letters, digits, '_', '.', '-'; starting alphanumeric)"
        )
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_python(value: str) -> str:
    if not _PYTHON.match(value) or value.startswith("-"):
        raise ValueError(f"invalid python {value!r} (a command name like 'python3' or an absolute path)")
    return value


def check_image(value: str) -> str:
    if not _IMAGE.match(value):
        raise ValueError(f"invalid image reference {value!r}")
    return value


User = Annotated[str, AfterValidator(check_user)]
Path = Annotated[str, AfterValidator(check_path)]
Python = Annotated[str, AfterValidator(check_python)]
Port = Annotated[int, AfterValidator(check_port)]
Image = Annotated[str, AfterValidator(check_image)]
