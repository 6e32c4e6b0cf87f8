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

The parsers and checkers behind the field types (units and names) live in ``fields.py``; every
name there is importable from here too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from tangram_cli.inventory.fields import (
    ID_RE,
    MAX_CPU_ID,
    CpuSet,
    DurationMs,
    GpuSelector,
    Image,
    Path,
    Port,
    Python,
    ServiceDuration,
    SizeMiB,
    User,
    check_host,
    check_id,
    check_image,
    check_path,
    check_port,
    check_python,
    check_user,
    format_cpuset,
    is_loopback,
    parse_cpuset,
    parse_destination,
    parse_duration_ms,
    parse_gpus,
    parse_service_duration,
    parse_size_mib,
)

__all__ = [
    "ID_RE",
    "MAX_CPU_ID",
    "SECRET_WORDS",
    "Api",
    "ApiKey",
    "ApiKeySpec",
    "ApiSpec",
    "Connection",
    "Controller",
    "ControllerSpec",
    "CpuSet",
    "DefaultsSpec",
    "DurationMs",
    "Executor",
    "GpuSelector",
    "GroupSpec",
    "HostKeyPolicy",
    "HostSpec",
    "Image",
    "Inventory",
    "InventorySpec",
    "Node",
    "Path",
    "Port",
    "Ports",
    "PortsSpec",
    "Profile",
    "ProfileSpec",
    "Python",
    "Role",
    "Runtime",
    "Scheduler",
    "SchedulerSpec",
    "Service",
    "ServiceDuration",
    "ServiceSpec",
    "SizeMiB",
    "Spec",
    "SshSpec",
    "User",
    "VarsSpec",
    "check_host",
    "check_id",
    "check_image",
    "check_path",
    "check_port",
    "check_python",
    "check_user",
    "format_cpuset",
    "is_loopback",
    "parse_cpuset",
    "parse_destination",
    "parse_duration_ms",
    "parse_gpus",
    "parse_service_duration",
    "parse_size_mib",
]

_ENV = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")

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
    trusted_code_only: bool | None = None  # process executor on a host that cannot contain sandboxes
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
    stage_starts: bool = True  # staged starts (tangram/core/staging.py); off: starts wait for free cores

    @field_validator("depth")
    @classmethod
    def _depth(cls, v: int) -> int:
        if not 1 <= v <= 64:
            raise ValueError(f"depth must be between 1 and 64, got {v}")
        return v


def _check_env(v: str | None) -> str | None:
    if v is not None and not _ENV.match(v):
        raise ValueError(
            "key_env must name an environment variable (like SEARCH_API_KEY) that holds the secret on"
            " the controller's host, not the secret itself"
        )
    return v


KeyEnv = Annotated[str, AfterValidator(_check_env)]
KEY_LIMIT = 1_000_000_000  # the most requests or tokens per minute, or leases in flight, of one key


class ApiKeySpec(Spec):
    """One key of an API's pool: the variable holding its secret and its limits (0: none).
    A field that looks like a secret (``key``, ``secret``, ``api_key``, ...) is an unknown key
    whose message says where the secret goes (problems.py)."""

    name: Annotated[str, AfterValidator(lambda v: check_id(v, "key name"))] | None = None
    key_env: KeyEnv
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0

    @field_validator("rpm", "tpm", "concurrency")
    @classmethod
    def _limits(cls, v: int) -> int:
        if not 0 <= v <= KEY_LIMIT:
            raise ValueError(f"must be between 0 (no limit) and {KEY_LIMIT}, got {v}")
        return v


class ApiSpec(Spec):
    """An API: an API-wide limit (``mode``/``limit``/``period``), a key pool (``keys``), or both.
    Without ``keys`` the limit is required; with them it is optional (absent: none)."""

    mode: Literal["concurrency", "quota"] | None = None
    limit: int | None = None
    period: DurationMs | None = None
    key_env: KeyEnv | None = None
    keys: list[ApiKeySpec] | None = None

    @field_validator("limit")
    @classmethod
    def _limit(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 1_000_000:
            raise ValueError(f"limit must be between 1 and 1000000, got {v}")
        return v

    @model_validator(mode="after")
    def _period(self) -> ApiSpec:
        if self.keys is None and (self.mode is None or self.limit is None):
            raise ValueError("give 'mode' and 'limit' (the API's limit), or 'keys' (a key pool), or both")
        if self.mode is not None and self.limit is None:
            raise ValueError(f"mode {self.mode!r} needs 'limit'")
        if self.mode == "quota" and self.period is None:
            raise ValueError("mode 'quota' needs 'period' (e.g. '60s')")
        if self.mode != "quota" and self.period is not None:
            raise ValueError("'period' applies to mode 'quota' only")
        return self

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: list[ApiKeySpec] | None) -> list[ApiKeySpec] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("empty: list at least one key, or leave 'keys' out")
        names = [k.name or f"k{i}" for i, k in enumerate(v)]
        for what, values in (("name", names), ("key_env", [k.key_env for k in v])):
            twice = sorted({x for x in values if values.count(x) > 1})
            if twice:
                why = "unnamed keys are k0, k1, ..." if what == "name" else "one variable per key"
                raise ValueError(f"{what} {twice[0]!r} is given to two keys ({why})")
        return v

    @model_validator(mode="after")
    def _one_or_a_pool(self) -> ApiSpec:
        if self.keys is not None and self.key_env is not None:
            raise ValueError("give 'key_env' (one key) or 'keys' (a key pool), not both")
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
    jobs: Any = None  # RL jobs: checked by tangram_cli.controller.jobs_config.parse_jobs (load.py)
    sandbox_pool: Any = None  # warm sandbox pools: checked by tangram_cli.controller.pools.parse_policy


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
    trusted_code_only: bool = False  # run uncontained where the host cannot contain (docs/agent.md)

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
    stage_starts: bool = True


@dataclass(frozen=True)
class ApiKey:
    """One key of an API's pool: names only, never a secret (the secret is in ``$key_env`` on the
    controller's host)."""

    name: str
    key_env: str
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0


@dataclass(frozen=True)
class Api:
    name: str
    mode: str
    limit: int  # 0: no API-wide limit (an API with keys only)
    period_ms: int | None
    key_env: str | None
    keys: tuple[ApiKey, ...] = ()


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
    jobs: tuple[Any, ...] = ()  # jobs_config.JobConf: weights, caps, bound keys
    sandbox_pool: Any = None  # tangram.core.pool.PoolPolicy; None: pools off
    source: str = "<string>"
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group -> node names

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)
