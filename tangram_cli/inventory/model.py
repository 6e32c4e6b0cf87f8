"""Inventory schema: pydantic v2 models for the YAML file and frozen dataclasses for the result.

Two layers:

* ``*Spec`` models mirror the YAML file. They use ``extra="forbid"`` and strict types, so a typo
  is an unknown key and an unquoted ``no`` where a string belongs is a type error (the loader
  turns both into readable messages). Sizes (``4GiB``) and durations (``10s``) are parsed to
  integers (MiB, ms) by ``parse_size_mib`` / ``parse_duration_ms``. Every override layer
  (``defaults``, group ``vars``, host mappings, CLI flags) uses the same models with optional
  fields; ``model_dump(exclude_unset=True)`` gives exactly what a layer sets.
* ``Node``, ``Service``, ``Controller``, ... are the resolved, flat values that the rest of
  Tangram reads (``Inventory.nodes``).

Host names, users, paths and ids are checked with strict regular expressions here, because
they end up in SSH destinations, remote command lines, container labels and file names.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

# --------------------------------------------------------------------------------------------
# Units

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS_KIB = {"KiB": 1, "MiB": 1024, "GiB": 1024**2, "TiB": 1024**3}
_DUR_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_size_mib(value: Any) -> int:
    """``"4GiB"`` -> 4096. Binary units only; the result must be a whole number of MiB."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"expected a size with a unit such as '4GiB' or '512MiB', got {value!r}")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot read size {value!r} (expected a number and a unit, e.g. '4GiB')")
    number, unit = m.groups()
    if unit not in _SIZE_UNITS_KIB:
        units = ", ".join(_SIZE_UNITS_KIB)
        why = "missing unit" if not unit else f"unknown unit {unit!r}"
        raise ValueError(f"{why} in size {value!r} (use one of {units})")
    kib = float(number) * _SIZE_UNITS_KIB[unit]
    if kib % 1024:
        raise ValueError(f"size {value!r} is not a whole number of MiB")
    return int(kib // 1024)


def parse_duration_ms(value: Any) -> int:
    """``"10s"`` -> 10000, ``"500ms"`` -> 500. Units: ms, s, m, h."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"expected a duration with a unit such as '10s' or '500ms', got {value!r}")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot read duration {value!r} (expected a number and a unit, e.g. '10s')")
    number, unit = m.groups()
    if unit not in _DUR_UNITS_MS:
        why = "missing unit" if not unit else f"unknown unit {unit!r}"
        raise ValueError(f"{why} in duration {value!r} (use ms, s, m or h)")
    ms = float(number) * _DUR_UNITS_MS[unit]
    if ms != int(ms):
        raise ValueError(f"duration {value!r} is not a whole number of milliseconds")
    return int(ms)


MAX_CPU_ID = 4095


def parse_cpuset(value: Any) -> tuple[int, ...]:
    """``"0-3,8"`` -> (0, 1, 2, 3, 8). Rejects empty items, reversed ranges, repeats, negatives."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f'expected a quoted cpu list such as "2-127", got {value!r}')
    cpus: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if not m:
            raise ValueError(f"bad cpu list {value!r}: item {item!r} is not N or N-M")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"bad cpu list {value!r}: reversed range {item.strip()!r}")
        if hi > MAX_CPU_ID:
            raise ValueError(f"bad cpu list {value!r}: cpu {hi} is above {MAX_CPU_ID}")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"bad cpu list {value!r}: a cpu is listed twice")
    return tuple(sorted(cpus))


def format_cpuset(cpus: tuple[int, ...] | None) -> str | None:
    """(0, 1, 2, 5) -> ``"0-2,5"``."""
    if cpus is None:
        return None
    runs: list[str] = []
    for c in sorted(cpus):
        if runs and "-" in runs[-1] and int(runs[-1].split("-")[1]) == c - 1:
            runs[-1] = f"{runs[-1].split('-')[0]}-{c}"
        elif runs and "-" not in runs[-1] and int(runs[-1]) == c - 1:
            runs[-1] = f"{runs[-1]}-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)


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
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
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

# --------------------------------------------------------------------------------------------
# YAML-facing models

Role = Literal["cpu", "gpu"]
Executor = Literal["auto", "docker", "process", "fastpath"]
Runtime = Literal["emulated", "torch", "vllm", "sglang"]
HostKeyPolicy = Literal["accept-new", "strict"]
Connection = Literal["ssh", "local"]
SECRET_WORDS = (
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "key",
    "credential",
    "passphrase",
)


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SshSpec(Spec):
    """SSH settings; every field optional so the same model serves each override layer."""

    user: User | None = None
    identity_file: Path | None = None
    port: Port | None = None
    host_key_policy: HostKeyPolicy | None = None
    connect_timeout: DurationMs | None = None

    @field_validator("connect_timeout")
    @classmethod
    def _timeout(cls, v: int | None) -> int | None:
        if v is not None and not 100 <= v <= 600_000:
            raise ValueError("connect_timeout must be between 100ms and 10m")
        return v


class ServiceSpec(Spec):
    name: Annotated[str, AfterValidator(lambda v: check_id(v, "service name"))]
    runtime: Runtime
    model: str | None = None
    gpus: list[int] = Field(default_factory=lambda: [1])
    gpu_mem: SizeMiB | None = None
    host_mem: SizeMiB | None = None
    duration: ServiceDuration = None
    load_s: float | None = None

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        if v is not None and (not re.fullmatch(r"[A-Za-z0-9_./:@+=-]{1,512}", v) or ".." in v.split("/")):
            raise ValueError(f"invalid model {v!r} (a path or name without '..', spaces or shell characters)")
        return v

    @field_validator("gpus")
    @classmethod
    def _chunks(cls, v: list[int]) -> list[int]:
        bad = [c for c in v if c not in (1, 2, 4, 8)]
        if bad or not v:
            raise ValueError(f"chunk sizes must be in {{1, 2, 4, 8}}, got {v}")
        if len(set(v)) != len(v):
            raise ValueError(f"chunk sizes repeat: {v}")
        return sorted(v)

    @field_validator("load_s")
    @classmethod
    def _load(cls, v: float | None) -> float | None:
        if v is not None and (not math.isfinite(v) or v < 0 or v > 3600):
            raise ValueError(f"load_s must be between 0 and 3600 seconds, got {v}")
        return v

    @model_validator(mode="after")
    def _needs_model(self) -> ServiceSpec:
        if self.runtime != "emulated" and not self.model:
            raise ValueError(f"runtime {self.runtime!r} needs 'model' (a path or model name)")
        return self


class VarsSpec(Spec):
    """Per-node resources and settings (group ``vars``, host mapping ``vars``, CLI overrides)."""

    cpus: CpuSet | None = None
    idle_cpus: CpuSet | None = None
    mem: SizeMiB | None = None
    executor: Executor | None = None
    image: Image | None = None
    gpus: GpuSelector = None
    emulated_gpus: bool | None = None
    gpu_mem: SizeMiB | None = None
    services: list[ServiceSpec] | None = None
    python: Python | None = None
    workdir: Path | None = None


class DefaultsSpec(Spec):
    ssh: SshSpec = SshSpec()
    python: Python | None = None
    workdir: Path | None = None
    connection: Connection | None = None


class HostSpec(Spec):
    """A host mapping: ``{host: 10.0.1.17, ssh: {port: 2222}, vars: {...}}``."""

    host: str
    name: Annotated[str, AfterValidator(lambda v: check_id(v, "node name"))] | None = None
    connection: Connection | None = None
    ssh: SshSpec = SshSpec()
    vars: VarsSpec = VarsSpec()


class GroupSpec(Spec):
    role: Role
    hosts: list[Any]  # strings (host lists) or HostSpec mappings, validated one by one by the loader
    ssh: SshSpec = SshSpec()
    vars: VarsSpec = VarsSpec()


class PortsSpec(Spec):
    agents: int = 7700
    submit: int = 7701
    status: int = 7702

    @field_validator("agents", "submit", "status")
    @classmethod
    def _port(cls, v: int) -> int:
        return check_port(v, allow_zero=True)


class ControllerSpec(Spec):
    bind: str = "127.0.0.1"
    advertise: str | None = None
    ports: PortsSpec = PortsSpec()

    @field_validator("bind", "advertise")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.strip() in ("*", "0.0.0.0", "::", "[::]"):
            raise ValueError(
                f"bind {v!r} listens on every interface; name one address (e.g. the cluster network's)"
            )
        return check_host(v)

    @model_validator(mode="after")
    def _ports(self) -> ControllerSpec:
        ports = [self.ports.agents, self.ports.submit, self.ports.status]
        if 0 in ports and not is_loopback(self.bind):
            raise ValueError(
                "port 0 (pick a free port) needs a loopback bind; agents on other hosts need fixed ports"
            )
        fixed = [p for p in ports if p]
        if len(set(fixed)) != len(fixed):
            raise ValueError(f"controller ports must differ, got {ports}")
        return self


class SchedulerSpec(Spec):
    depth: int = 2
    client_grace: DurationMs = 60_000
    default_profile: str | None = None

    @field_validator("depth")
    @classmethod
    def _depth(cls, v: int) -> int:
        if not 1 <= v <= 64:
            raise ValueError(f"depth must be between 1 and 64, got {v}")
        return v


class ApiSpec(Spec):
    mode: Literal["concurrency", "quota"]
    limit: int
    period: DurationMs | None = None
    key_env: str | None = None

    @field_validator("limit")
    @classmethod
    def _limit(cls, v: int) -> int:
        if not 1 <= v <= 1_000_000:
            raise ValueError(f"limit must be between 1 and 1000000, got {v}")
        return v

    @field_validator("key_env")
    @classmethod
    def _key_env(cls, v: str | None) -> str | None:
        if v is not None and not _ENV.match(v):
            raise ValueError(
                "key_env must name an environment variable (like SEARCH_API_KEY), not hold the secret"
            )
        return v

    @model_validator(mode="after")
    def _period(self) -> ApiSpec:
        if self.mode == "quota" and self.period is None:
            raise ValueError("mode 'quota' needs 'period' (e.g. '60s')")
        if self.mode == "concurrency" and self.period is not None:
            raise ValueError("'period' applies to mode 'quota' only")
        return self


class ProfileSpec(Spec):
    efficiency: dict[int, float] | None = None
    serial_fraction: float | None = None

    @model_validator(mode="after")
    def _one(self) -> ProfileSpec:
        if (self.efficiency is None) == (self.serial_fraction is None):
            raise ValueError("give exactly one of 'efficiency' or 'serial_fraction'")
        if self.efficiency is not None:
            if not self.efficiency:
                raise ValueError("efficiency table is empty")
            for dop, e in self.efficiency.items():
                if not 1 <= dop <= 1024:
                    raise ValueError(f"degree of parallelism {dop} is outside 1-1024")
                if not (math.isfinite(e) and 0 < e <= 1):
                    raise ValueError(f"efficiency {e} at dop {dop} is outside (0, 1]")
        if self.serial_fraction is not None and not (0 <= self.serial_fraction < 1):
            raise ValueError(f"serial_fraction must be in [0, 1), got {self.serial_fraction}")
        return self


class InventorySpec(Spec):
    """The top level; sections are validated one at a time by the loader (see load.py)."""

    version: Literal[1]
    cluster: Annotated[str, AfterValidator(lambda v: check_id(v, "cluster name"))]
    defaults: Any = None
    controller: Any = None
    scheduler: Any = None
    groups: Any = None
    apis: Any = None
    profiles: Any = None


# --------------------------------------------------------------------------------------------
# Resolved values


@dataclass(frozen=True)
class Service:
    name: str
    runtime: str
    model: str | None
    gpus: tuple[int, ...]
    gpu_mem_mib: int | None
    host_mem_mib: int | None
    duration_ms: int | None  # None: profiled at load time
    load_s: float | None


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    port: int
    user: str
    identity_file: str | None
    role: str
    cpus: tuple[int, ...] | None  # None: every online core except idle_cpus (from the probe)
    idle_cpus: tuple[int, ...]
    mem_mib: int | None  # None: what the probe finds
    executor: str
    image: str | None
    gpus: str | int | tuple[str, ...]  # "all", a count (emulated), or UUIDs; 0 for none
    services: tuple[Service, ...]
    workdir: str
    python: str
    host_key_policy: str
    connect_timeout_ms: int
    connection: str = "ssh"
    group: str = ""
    emulated_gpus: bool = False
    gpu_mem_mib: int | None = None

    @property
    def gpu_count(self) -> int | None:
        """Known GPU count, or None for ``all`` (the probe decides)."""
        if isinstance(self.gpus, int):
            return self.gpus
        if isinstance(self.gpus, tuple):
            return len(self.gpus)
        return None

    @property
    def address(self) -> str:
        """``host:port`` with IPv6 literals bracketed."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Ports:
    agents: int
    submit: int
    status: int


@dataclass(frozen=True)
class Controller:
    bind: str
    advertise: str
    ports: Ports


@dataclass(frozen=True)
class Scheduler:
    depth: int
    client_grace_ms: int
    default_profile: str | None


@dataclass(frozen=True)
class Api:
    name: str
    mode: str
    limit: int
    period_ms: int | None
    key_env: str | None


@dataclass(frozen=True)
class Profile:
    name: str
    efficiency: dict[int, float] | None
    serial_fraction: float | None


@dataclass(frozen=True)
class Inventory:
    version: int
    cluster: str
    controller: Controller
    scheduler: Scheduler
    nodes: tuple[Node, ...]
    apis: tuple[Api, ...] = ()
    profiles: tuple[Profile, ...] = ()
    source: str = "<string>"
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group -> node names

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
