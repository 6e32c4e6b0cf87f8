"""Agent configuration: one dataclass, loaded from JSON (``--config agent.json``) and/or flags.

Stdlib only (the agent bundle carries no click or pydantic). Every check raises
``tangram.errors.ConfigError`` naming the field and what to write instead; ``from_dict`` reports all
unknown keys at once.

Defaults that depend on the machine (``cpus``, ``idle_cpus``, ``mem_mib``) are left ``None`` here
and resolved against the probed facts by ``resolve`` (see ``agent.link.build_agent``).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from tangram import units
from tangram.certs import CurveKeys, keypair, public_key
from tangram.errors import ConfigError

HOSTROOT_IMAGE = "tangram/hostroot:1"
EXECUTORS = ("auto", "docker", "process")
DOCKER_MODES = ("auto", "fastpath", "docker")
_ADDR_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
_NAME_RE = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$")  # protocol ID_PATTERN
_CLUSTER_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")  # becomes part of container names
_CLUSTER_ID_RE = re.compile(r"^[a-z0-9]{1,32}$")  # `tangram up` makes 12 hex digits


def parse_mib(value: Any, what: str = "size") -> int:
    """``"16GiB"`` -> 16384, ``"2GB"`` -> 1907, ``2048`` (an int: MiB) -> 2048: `tangram.units` rules;
    a bad value raises `UnitError`, which is a ConfigError."""
    return units.parse_size_mib(value, what)


def parse_cpulist(value: Any, what: str = "cpus") -> list[int]:
    """``"0-3,8"`` or ``[0, 1, 2, 3, 8]`` -> sorted distinct cores (`tangram.units` rules)."""
    return list(units.parse_cpulist(value, what))


def default_name() -> str:
    host = socket.gethostname().split(".")[0] or "node"
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", host).lstrip(".-")[:64]
    return name or "node"


def default_workdir(name: str) -> str:
    return os.path.join(os.path.expanduser("~"), ".tangram", "agent", name.replace(":", "_"))


DEFAULT_SANDBOX_MEM_MIB = 4096  # a sandbox opened without `mem` (docs/agent.md)

@dataclass
class AgentConfig:
    """Everything an agent needs. Times are seconds, memory MiB, cores are lists of ints."""

    controller: str
    name: str = ""
    cluster: str = "default"
    # The cluster's unique id (`tangram up` writes it): labels and names this agent's containers, and only
    # containers with it are listed, adopted or swept here. "": none (containers told apart by name only).
    cluster_id: str = ""
    executor: str = "auto"  # auto = docker if dockerd answers, else process
    docker_mode: str = "auto"  # docker executor's exec path: auto | fastpath | docker
    cpus: list[int] | None = None  # cores handed out; None = all online minus idle_cpus
    idle_cpus: list[int] | None = None  # where idle sandboxes park; None = the first online core
    mem_mib: int | None = None  # memory offered for sandboxes; None = MemTotal minus a reserve
    workdir: str = ""  # pidfile, log, process-executor sandboxes; "" = ~/.tangram/agent/<name>
    image: str = HOSTROOT_IMAGE  # default sandbox image (CreateSandbox with image "")
    # Docker sandboxes (agent.executors.docker_limits): the uid:gid sandbox code runs as, and the writable
    # space of each (0: no limit; the agent refuses to start where dockerd cannot enforce it)
    docker_user: str = "65534:65534"
    sandbox_disk_mib: int = 1024
    # Warm sandbox pools (Docker; agent.executors.docker_pool): at most this many created, idle sandboxes
    # over all shapes, whatever the controller asks (0: no pools), made `pool_concurrency` at a time
    pool_max: int = 64
    pool_concurrency: int = 1
    emulated_gpus: int = 0  # > 0: that many emulated GPUs instead of NVML discovery
    gpu_mem_mib: int = 16 * 1024  # memory of each emulated GPU
    restore_bandwidth_gbps: float = 25.0  # emulated restore bandwidth, GB/s
    services: list[dict[str, Any]] = field(default_factory=list)  # GPU service specs prepared at start
    heartbeat_s: float = 1.0  # until the Welcome says otherwise
    orphan_timeout_s: float = 60.0  # cut off this long: kill running actions
    stop_grace_s: float = 5.0  # SIGTERM: wait this long for running requests before cancelling them
    hello_timeout_s: float = 5.0  # no Welcome within this: reconnect
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    max_inflight: int = 1024  # requests handled at once; beyond: RETRY_LATER
    outbox_mib: int = 256  # replies buffered while cut off from the controller
    log_file: str = ""  # "" = stderr
    log_level: str = "INFO"
    log_format: str = ""  # text | json; "" = $TANGRAM_LOG_FORMAT, else text (tangram/logfmt.py)
    allow_remote: bool = False  # plain TCP to a non-loopback controller (unencrypted; prefer `curve`)
    # process executor: run actions without containment where the host cannot contain them (not root, no
    # cpuset/memory/pids cgroup); without it the agent refuses to start there (docs/agent.md)
    trusted_code_only: bool = False
    sandbox_mem_mib: int | None = None  # limit of a sandbox opened without `mem` (default_sandbox_mem)
    sandbox_uid_base: int = 2_000_000  # process sandboxes run as uids base .. base + count - 1
    sandbox_uid_count: int = 1_000_000
    # CURVE: {"controller_public": PATH|Z85, "secret": PATH|Z85, "public": PATH|Z85 (optional)}.
    # PATHs are ZeroMQ certificate files (`tangram up` ships agent.key_secret + controller.key).
    curve: dict[str, str] | None = None
    # The fields this config was given (by `given`, or the keys of the file `from_dict` read), in that
    # order: what `to_json` writes; the agent's defaults and probes fill in the rest. Not a key of the file.
    fields_set: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    # ------------------------------------------------------------ loading

    @classmethod
    def given(cls, **values: Any) -> AgentConfig:
        """A config of these fields alone, as `tangram up` builds it for a node; not checked here: the
        agent checks its file where it runs (its key files, cores and host name are there)."""
        cfg = cls(**values)
        cfg.fields_set = tuple(values)
        return cfg

    def with_values(self, **values: Any) -> AgentConfig:
        """The fields set here with ``values`` set too (a new one goes last)."""
        return self.given(**{**{k: getattr(self, k) for k in self.fields_set}, **values})

    def to_json(self) -> str:
        """``agent.json``: the fields set (every field when none was), indented, with a final newline."""
        keys = self.fields_set or tuple(f.name for f in dataclasses.fields(self) if f.init)
        return json.dumps({k: getattr(self, k) for k in keys}, indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> AgentConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}",
                              hint=f"known keys: {', '.join(sorted(known))}")
        if "controller" not in raw:
            raise ConfigError(f"{where}: `controller` is required",
                              hint="add \"controller\": \"tcp://HOST:PORT\"")
        values = dict(raw)
        for key in ("cpus", "idle_cpus"):
            if values.get(key) is not None:
                values[key] = parse_cpulist(values[key], key)
        for key in ("mem_mib", "gpu_mem_mib", "outbox_mib", "sandbox_mem_mib", "sandbox_disk_mib"):
            if values.get(key) is not None:
                values[key] = parse_mib(values[key], key)
        cfg = cls(**values)
        cfg.fields_set = tuple(values)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | None = None, **overrides: Any) -> AgentConfig:
        """The file (if any), then every override that is not None; validated."""
        raw: dict[str, Any] = {}
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except OSError as exc:
                raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}: expected a JSON object")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(raw, path or "flags")

    # ------------------------------------------------------------ checks

    def _check_cluster(self) -> None:
        if not isinstance(self.cluster, str) or not _CLUSTER_RE.match(self.cluster):
            raise ConfigError(f"cluster: {self.cluster!r} must match {_CLUSTER_RE.pattern}")
        cid = self.cluster_id
        if cid and not (isinstance(cid, str) and _CLUSTER_ID_RE.match(cid)):
            raise ConfigError(f"cluster_id: {cid!r} must match {_CLUSTER_ID_RE.pattern}",
                              hint="`tangram up` writes it into agent.json; leave it out for none")

    def validate(self) -> None:
        """Check every field (in this order: the first problem found is the one raised), normalise
        cores, sizes and times, and fill in ``name`` and ``workdir`` when left empty."""
        self._check_controller()
        self._check_name()
        self._check_cluster()
        self._check_modes()
        self._check_cores()
        self._check_limits()
        self._check_times()
        self._check_image_and_services()
        self._check_logging()
        if not self.workdir:
            self.workdir = default_workdir(self.name)
        self.workdir = os.path.abspath(os.path.expanduser(self.workdir))

    def _check_controller(self) -> None:
        m = _ADDR_RE.match(self.controller) if isinstance(self.controller, str) else None
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ConfigError(f"controller: expected tcp://HOST:PORT, got {self.controller!r}",
                              hint="e.g. --controller tcp://127.0.0.1:7700")
        host = m.group(1).strip("[]")
        self.curve_keys()  # ConfigError now rather than at connect time
        if not self.curve and not self.allow_remote and not is_loopback_host(host):
            raise ConfigError(
                f"controller {self.controller} is not a loopback address, "
                "and plain TCP is only allowed on loopback",
                hint="configure `curve` (keys from `tangram up`), or set allow_remote (no encryption)")

    def _check_name(self) -> None:
        if not self.name:
            self.name = default_name()
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"name: {self.name!r} is not a valid node name",
                              hint="1-64 characters from A-Z a-z 0-9 _ . : - not starting with . or -")

    def _check_modes(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor: expected one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.docker_mode not in DOCKER_MODES:
            raise ConfigError(
                f"docker_mode: expected one of {', '.join(DOCKER_MODES)}, got {self.docker_mode!r}")

    def _check_cores(self) -> None:
        for key in ("cpus", "idle_cpus"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, parse_cpulist(value, key))
        if self.cpus is not None and not self.cpus:
            raise ConfigError("cpus: must not be empty")
        if self.idle_cpus is not None and not self.idle_cpus:
            raise ConfigError("idle_cpus: must not be empty (idle sandboxes need somewhere to sit)")

    def _check_limits(self) -> None:
        _int(self, "emulated_gpus", 0, 64)
        _int(self, "gpu_mem_mib", 1, 1 << 30)
        _int(self, "max_inflight", 1, 1 << 20)
        _int(self, "outbox_mib", 1, 1 << 20)
        if self.mem_mib is not None:
            _int(self, "mem_mib", 1, 1 << 40)
        if self.sandbox_mem_mib is not None:
            _int(self, "sandbox_mem_mib", 1, 1 << 40)
        _int(self, "sandbox_disk_mib", 0, 1 << 40)
        _int(self, "pool_max", 0, 1 << 16)
        _int(self, "pool_concurrency", 1, 64)
        user = self.docker_user
        if not isinstance(user, str) or not re.match(r"^[0-9]{1,10}:[0-9]{1,10}$", user):
            raise ConfigError(f"docker_user: expected 'uid:gid' numbers, got {self.docker_user!r}",
                              hint='e.g. "65534:65534" (nobody); "0:0" runs sandbox code as root')
        _int(self, "sandbox_uid_base", 1000, (1 << 32) - 2)
        _int(self, "sandbox_uid_count", 1, (1 << 32) - 2 - self.sandbox_uid_base)
        if not isinstance(self.trusted_code_only, bool):
            raise ConfigError(f"trusted_code_only: expected true or false, got {self.trusted_code_only!r}")

    def _check_times(self) -> None:
        for key, lo in (("heartbeat_s", 0.01), ("orphan_timeout_s", 0.1), ("stop_grace_s", 0.0),
                        ("hello_timeout_s", 0.05), ("backoff_min_s", 0.001), ("backoff_max_s", 0.001),
                        ("restore_bandwidth_gbps", 1e-6)):
            _float(self, key, lo, 1e7)
        if self.backoff_max_s < self.backoff_min_s:
            raise ConfigError("backoff_max_s must be >= backoff_min_s")

    def _check_image_and_services(self) -> None:
        if not isinstance(self.image, str) or not self.image:
            raise ConfigError("image: must be a non-empty image name")
        services_ok = isinstance(self.services, list) and all(
            isinstance(s, dict) and "name" in s for s in self.services)
        if not services_ok:
            raise ConfigError("services: expected a list of service spec objects, each with a `name`")

    def _check_logging(self) -> None:
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: expected DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.log_format not in ("", "text", "json"):
            raise ConfigError(f"log_format: expected text or json, got {self.log_format!r}")

    def default_sandbox_mem(self) -> int:
        """The memory limit (MiB) of a sandbox opened without ``mem``: ``sandbox_mem_mib``, else
        ``DEFAULT_SANDBOX_MEM_MIB`` (at most ``mem_mib``): never unlimited, never the whole node."""
        if self.sandbox_mem_mib:
            return self.sandbox_mem_mib
        return min(DEFAULT_SANDBOX_MEM_MIB, self.mem_mib or DEFAULT_SANDBOX_MEM_MIB)

    def resolve_cpus(self, online: list[int]) -> tuple[list[int], list[int]]:
        """(cores handed out, idle cores) against the online set; ConfigError when they do not fit."""
        if not online:
            raise ConfigError("no online cpus found")
        idle = self.idle_cpus if self.idle_cpus is not None else [online[0]]
        cpus = self.cpus if self.cpus is not None else [c for c in online if c not in idle] or list(online)
        for key, value in (("cpus", cpus), ("idle_cpus", idle)):
            outside = sorted(set(value) - set(online))
            if outside:
                raise ConfigError(f"{key}: cores {outside} are not online (online: {online})")
        return cpus, idle

    def curve_keys(self) -> CurveKeys | None:
        """``tangram.certs.CurveKeys`` from ``curve``, or None when CURVE is off."""
        if self.curve is None:
            return None
        c = self.curve
        allowed = {"controller_public", "secret", "public"}
        if not isinstance(c, dict) or set(c) - allowed or not all(isinstance(v, str) for v in c.values()):
            raise ConfigError("curve: expected a mapping of controller_public, secret and optional public "
                              "(certificate paths or Z85 strings)")
        missing = sorted({"controller_public", "secret"} - set(c))
        if missing:
            raise ConfigError(f"curve: missing {', '.join(missing)}")
        public, secret = keypair(c["secret"], c.get("public"))
        return CurveKeys(public, secret, public_key(c["controller_public"]))

    def pidfile(self) -> str:
        return os.path.join(self.workdir, "agent.pid")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "fields_set"}


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _int(cfg: AgentConfig, key: str, lo: int, hi: int) -> None:
    value = getattr(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{key}: expected an integer in [{lo}, {hi}], got {value!r}")


def _float(cfg: AgentConfig, key: str, lo: float, hi: float) -> None:
    value = getattr(cfg, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ConfigError(f"{key}: expected a number in [{lo}, {hi}], got {value!r}")
    setattr(cfg, key, float(value))
