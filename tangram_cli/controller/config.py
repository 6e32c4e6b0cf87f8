"""The controller's resolved configuration (`--config resolved.json`) and its defaults.

The file is what `tangram up` writes after resolving an inventory; every key is optional:

    {"cluster": "local", "cluster_id": "3f9c0e1a2b4d",
     "scheduler": {"depth": 2, "client_grace_s": 60, "max_timeout_s": 3600,
                   "max_outstanding_per_client": 4096, "max_queued": 100000, "max_outbox": 1024,
                   "max_client_bytes": 268435456, "max_held_bytes": 2147483648, "stage_starts": true},
     "services": [{"name": "reward", "runtime": "emulated", "model": "agent.gpu.demo_services:reward",
                   "gpu_mem_mib": 16384, "chunk_sizes": [1, 2], "load_s": 2.0, "t_ori": 0.2,
                   "host_mem_mib": 16384}],
     "apis": [{"name": "search", "mode": "concurrency", "limit": 16, "period_s": 60},
              {"name": "llm", "keys": [{"name": "k0", "key_env": "LLM_KEY_0", "rpm": 500, "tpm": 400000,
                                        "concurrency": 64}, {"key_env": "LLM_KEY_1", "rpm": 300}]}],
     "profiles": {"pytest": {"efficiency": {"1": 1.0, "2": 0.97}}, "synthetic": {"serial_fraction": 0.05}},
     "certs": "~/.tangram/clusters/local/certs",
     "metrics_port": 9464, "metrics_clients": 20}

`cluster_id` (made by `tangram up`, see tangram_cli/state.py) labels the cluster's sandbox containers.
`certs` (or `--certs`) turns CURVE on: see tangram_cli/controller/curve.py.
`metrics_port` (or `--metrics-port`) serves Prometheus metrics on the controller's bind address
(metrics_http.py; 0: a free port; absent: off); `metrics_clients` caps the client labels.
`sandbox_pool` sizes the agents' warm sandbox pools (tangram_cli/controller/pools.py; absent: off).
`jobs` gives RL jobs weights, caps and bound keys (tangram_cli/controller/jobs_config.py; absent: none).

Services become `ServiceDefined` events and `Prepare` messages to GPU agents (the Prepare
`spec` is the service mapping's `PREPARE_KEYS`; scheduling keys stay on the controller); APIs
become `ApiDefined` events; profiles name elasticity tables that `exec(elastic="pytest")` uses.
An API may list `keys` (a key pool, docs/operations.md "API key pools"): each names the
environment variable that holds its secret (`key_env`, read on the controller when a lease is
granted; a secret written into the config is refused) and its limits (`rpm`, `tpm`,
`concurrency`; 0 or absent: none); `name` defaults to `k<index>`. With keys, `limit` defaults
to 0: no API-wide limit.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from tangram.core.actions import Elasticity
from tangram.core.pool import PoolPolicy
from tangram.errors import ConfigError
from tangram_cli.controller.jobs_config import JobConf, jobs_dict, parse_jobs
from tangram_cli.controller.pools import parse_policy

# Built-in profiles, always available (a config may override them by name).
BUILTIN_PROFILES: dict[str, Elasticity] = {
    "linear": Elasticity.of_table({1: 1.0, 64: 1.0}),
    "pytest": Elasticity.of_table({1: 1.0, 2: 0.97, 4: 0.92, 8: 0.8, 16: 0.6}),
    "synthetic": Elasticity.amdahl(0.05),
}


# The keys of a service mapping the agent's Prepare accepts (agent.gpu.base.ServiceSpec.from_dict).
PREPARE_KEYS = ("name", "runtime", "model", "gpu_mem_mib", "host_mem_mib", "weight_bytes", "options")


@dataclass(frozen=True)
class ServiceConf:
    name: str
    gpu_mem_mib: int
    chunk_sizes: tuple[int, ...] = (1,)
    load_s: float = 0.0
    t_ori: float | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # the PREPARE_KEYS of the mapping: the Prepare spec


@dataclass(frozen=True)
class ApiKeyConf:
    """One key of an API: its name, the environment variable with its secret, its limits."""

    name: str
    key_env: str
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0


@dataclass(frozen=True)
class ApiConf:
    name: str
    mode: str
    limit: int
    period_s: float = 60.0
    keys: tuple[ApiKeyConf, ...] = ()


@dataclass(frozen=True)
class ControllerConfig:
    cluster: str = "local"
    cluster_id: str = ""  # unique per cluster (`tangram up`); labels its sandboxes; "" = none
    depth: int = 2
    client_grace_s: float = 60.0
    max_timeout_s: float = 3600.0
    heartbeat_s: float = 1.0
    # Backpressure (docs/protocol.md, "Backpressure"): beyond a cap a request gets RETRY_LATER at once.
    max_outstanding_per_client: int = 4096  # pending requests + undelivered replies, per client
    max_queued: int = 100_000  # unfinished actions (queued + running), all clients together
    max_outbox: int = 1024  # final replies kept per client while its connection cannot take them
    # Bytes held for clients (docs/protocol.md, "Bytes held for clients"): puts kept before a sandbox's
    # first exec, stdin and payloads of unfinished actions, undelivered replies. Past the per-client cap
    # a request that brings bytes gets OVER_CAP; past the global one RETRY_LATER.
    max_client_bytes: int = 256 << 20
    max_held_bytes: int = 2 << 30
    # Staged starts (tangram/core/staging.py): a blocked node's next short exec is sent before its
    # cores are free and started by the agent when they are (given back after 0.5 s if the guess
    # was wrong: protocol 1.7). On by default; the chaos bench's Docker and process runs with it on
    # are in docs/recovery.md.
    stage_starts: bool = True
    services: tuple[ServiceConf, ...] = ()
    apis: tuple[ApiConf, ...] = ()
    profiles: dict[str, Elasticity] = field(default_factory=lambda: dict(BUILTIN_PROFILES))
    certs: str | None = None  # CURVE certs directory (`--certs` wins); None: plain TCP on loopback
    metrics_port: int | None = None  # Prometheus endpoint (metrics_http.py; `--metrics-port` wins); None: off
    metrics_clients: int = 20  # clients with a label of their own in the metrics; later ones are "other"
    sandbox_pool: PoolPolicy = PoolPolicy(max=0)  # warm sandbox pools (pools.py); the default: off
    jobs: tuple[JobConf, ...] = ()  # RL jobs: weights, caps, bound keys (jobs_config.py)

    def service(self, name: str) -> ServiceConf | None:
        return next((s for s in self.services if s.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form that `parse_config` reads (``parse_config(c.to_dict()) == c``): what `tangram up`
        writes into ``controller.json``. ``cluster``, the scheduler's ``depth`` and ``client_grace_s``,
        ``services``, ``apis`` and ``profiles`` are always written; every other setting where it differs
        from its default. A built-in profile is written only where the config gave its own (an object
        other than the one in ``BUILTIN_PROFILES``, even with equal values)."""
        default = ControllerConfig()
        sched: dict[str, Any] = {"depth": self.depth, "client_grace_s": self.client_grace_s}
        sched.update(
            {k: getattr(self, k) for k in _SCHEDULER_KEYS[2:] if getattr(self, k) != getattr(default, k)}
        )
        out: dict[str, Any] = {
            "cluster": self.cluster,
            "scheduler": sched,
            "services": [_service_dict(s) for s in self.services],
            "apis": [_api_dict(a) for a in self.apis],
            "profiles": {
                name: _profile_dict(el)
                for name, el in self.profiles.items()
                if el is not BUILTIN_PROFILES.get(name)
            },
        }
        if self.jobs:
            out["jobs"] = jobs_dict(self.jobs)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in out and f.name not in _SCHEDULER_KEYS and value != getattr(default, f.name):
                out[f.name] = _plain(value)
        return out


# The settings `parse_config` reads from the ``scheduler`` mapping (the rest are top-level keys).
_SCHEDULER_KEYS = (
    "depth",
    "client_grace_s",
    "max_timeout_s",
    "heartbeat_s",
    "max_outstanding_per_client",
    "max_queued",
    "max_outbox",
    "max_client_bytes",
    "max_held_bytes",
    "stage_starts",
)


def _service_dict(s: ServiceConf) -> dict[str, Any]:
    """A service mapping: the scheduling keys and the Prepare ``spec`` (``PREPARE_KEYS``)."""
    out: dict[str, Any] = {"name": s.name}
    out.update({k: s.spec[k] for k in ("runtime", "model") if k in s.spec})
    if "gpu_mem_mib" in s.spec or s.gpu_mem_mib:
        out["gpu_mem_mib"] = s.gpu_mem_mib
    out.update({"chunk_sizes": list(s.chunk_sizes), "load_s": s.load_s})
    out.update({k: v for k, v in s.spec.items() if k not in out})
    if s.t_ori is not None:
        out["t_ori"] = s.t_ori
    return out


def _api_dict(a: ApiConf) -> dict[str, Any]:
    out: dict[str, Any] = {"name": a.name, "mode": a.mode, "limit": a.limit, "period_s": a.period_s}
    if a.keys:
        out["keys"] = [
            {"name": k.name, "key_env": k.key_env}
            | {f: getattr(k, f) for f in ("rpm", "tpm", "concurrency") if getattr(k, f)}
            for k in a.keys
        ]
    return out


def _profile_dict(el: Elasticity) -> dict[str, Any]:
    if el.serial_fraction is not None:
        return {"serial_fraction": el.serial_fraction}
    return {"efficiency": {str(m): e for m, e in el.table}}


def _plain(value: Any) -> Any:
    """A setting as JSON: dataclasses as mappings, tuples as lists."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _num(value: object, where: str, lo: float = 0.0) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < lo
    ):
        raise ConfigError(f"{where}: expected a number >= {lo}, got {value!r}")
    return float(value)


def _flag(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _int(value: object, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{where}: expected an integer >= {lo}, got {value!r}")
    return value


def _profile(name: str, raw: object) -> Elasticity:
    if not isinstance(raw, dict):
        raise ConfigError(f"profiles.{name}: expected a mapping")
    if "serial_fraction" in raw:
        el = Elasticity.amdahl(_num(raw["serial_fraction"], f"profiles.{name}.serial_fraction"))
    else:
        table = raw.get("efficiency")
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"profiles.{name}: needs `efficiency` {{units: E}} or `serial_fraction`")
        try:
            el = Elasticity.of_table({int(k): float(v) for k, v in table.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"profiles.{name}.efficiency: {exc}") from None
    if (problem := el.problem()) is not None:
        raise ConfigError(f"profiles.{name}: {problem}")
    return el


def _apis(raw: Any) -> list[ApiConf]:
    apis = []
    for i, a in enumerate(raw):
        where = f"apis[{i}]"
        if not isinstance(a, dict) or not isinstance(a.get("name"), str):
            raise ConfigError(f"{where}: expected a mapping with a `name`")
        mode = a.get("mode", "concurrency")
        if mode not in ("concurrency", "quota"):
            raise ConfigError(f"{where}.mode: expected concurrency or quota, got {mode!r}")
        keys = _keys(a.get("keys") or (), f"{where}.keys")
        apis.append(
            ApiConf(
                a["name"],
                mode,
                _int(a.get("limit", 0 if keys else 1), f"{where}.limit", 0 if keys else 1),
                _num(a.get("period_s", 60.0), f"{where}.period_s"),
                keys,
            )
        )
    return apis


_KEY_FIELDS = ("name", "key_env", "rpm", "tpm", "concurrency")


def _keys(raw: Any, where: str) -> tuple[ApiKeyConf, ...]:
    """An API's key pool. Secrets never appear here: only the variables that hold them."""
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{where}: expected a list of keys")
    keys: list[ApiKeyConf] = []
    for i, k in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(k, dict):
            raise ConfigError(f"{at}: expected a mapping with `key_env`")
        if "key" in k or "secret" in k:
            raise ConfigError(
                f"{at}: a key's secret may not be written in the config; name its variable in `key_env`"
            )
        unknown = sorted(set(k) - set(_KEY_FIELDS))
        if unknown:
            raise ConfigError(f"{at}: unknown field {unknown[0]!r} (known: {', '.join(_KEY_FIELDS)})")
        env, name = k.get("key_env"), k.get("name", f"k{i}")
        if not isinstance(env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env):
            raise ConfigError(f"{at}.key_env: expected the name of an environment variable, got {env!r}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ConfigError(f"{at}.name: expected 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
        if any(x.name == name for x in keys):
            raise ConfigError(f"{at}.name: {name!r} names two keys")
        limits = (_int(k.get(f, 0), f"{at}.{f}") for f in ("rpm", "tpm", "concurrency"))
        keys.append(ApiKeyConf(name, env, *limits))
    return tuple(keys)


def parse_config(raw: dict[str, Any]) -> ControllerConfig:
    if not isinstance(raw, dict):
        raise ConfigError("controller config: expected a JSON object")
    sched = raw.get("scheduler") or {}
    services = []
    for i, s in enumerate(raw.get("services") or ()):
        where = f"services[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("name"), str):
            raise ConfigError(f"{where}: expected a mapping with a `name`")
        sizes = tuple(
            _int(c, f"{where}.chunk_sizes", 1) for c in s.get("chunk_sizes") or s.get("gpus") or (1,)
        )
        t_ori = s.get("t_ori")
        services.append(
            ServiceConf(
                name=s["name"],
                gpu_mem_mib=_int(s.get("gpu_mem_mib", 0), f"{where}.gpu_mem_mib"),
                chunk_sizes=sizes,
                load_s=_num(s.get("load_s", 0.0), f"{where}.load_s"),
                t_ori=None if t_ori is None else _num(t_ori, f"{where}.t_ori"),
                spec={k: v for k, v in json.loads(json.dumps(s)).items() if k in PREPARE_KEYS},
            )
        )
    apis = _apis(raw.get("apis") or ())
    profiles = dict(BUILTIN_PROFILES)
    for name, prof in (raw.get("profiles") or {}).items():
        profiles[name] = _profile(name, prof)
    return ControllerConfig(
        cluster=str(raw.get("cluster", "local")),
        cluster_id=_cluster_id(raw.get("cluster_id")),
        depth=_int(sched.get("depth", 2), "scheduler.depth", 1),
        client_grace_s=_num(sched.get("client_grace_s", 60.0), "scheduler.client_grace_s"),
        max_timeout_s=_num(sched.get("max_timeout_s", 3600.0), "scheduler.max_timeout_s", 1.0),
        heartbeat_s=_num(sched.get("heartbeat_s", 1.0), "scheduler.heartbeat_s", 0.01),
        max_outstanding_per_client=_int(
            sched.get("max_outstanding_per_client", 4096), "scheduler.max_outstanding_per_client", 1
        ),
        max_queued=_int(sched.get("max_queued", 100_000), "scheduler.max_queued", 1),
        max_outbox=_int(sched.get("max_outbox", 1024), "scheduler.max_outbox", 1),
        max_client_bytes=_int(sched.get("max_client_bytes", 1 << 28), "scheduler.max_client_bytes", 1 << 20),
        max_held_bytes=_int(sched.get("max_held_bytes", 1 << 31), "scheduler.max_held_bytes", 1 << 20),
        stage_starts=_flag(sched.get("stage_starts", True), "scheduler.stage_starts"),
        services=tuple(services),
        apis=tuple(apis),
        profiles=profiles,
        certs=_certs(raw.get("certs")),
        metrics_port=_port(raw.get("metrics_port"), "metrics_port"),
        metrics_clients=_int(raw.get("metrics_clients", 20), "metrics_clients", 1),
        sandbox_pool=parse_policy(raw.get("sandbox_pool")),
        jobs=parse_jobs(raw.get("jobs")),
    )


def _port(value: object, where: str) -> int | None:
    if value is None:
        return None
    port = _int(value, where)
    if port > 65535:
        raise ConfigError(f"{where}: expected a port 0-65535 (0: a free one), got {value!r}")
    return port


def _cluster_id(value: object) -> str:
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9]{1,32}", value):
        raise ConfigError(f"cluster_id: expected 1-32 of a-z 0-9, got {value!r}")
    return value


def _certs(value: object) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise ConfigError(f"certs: expected a directory path, got {value!r}")
    return value


def load_config(path: str | None) -> ControllerConfig:
    if not path:
        return ControllerConfig()
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read controller config {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return parse_config(raw)
