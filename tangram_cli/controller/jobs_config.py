"""The ``jobs`` section of the controller's config: RL jobs' weights, caps and keys (issue 14, part 3).

    "jobs": {"grpo-7b": {"weight": 3, "caps": {"cores": 512, "gpus": 16, "api:llm": 64}, "keys": ["alice"]},
             "eval":    {"weight": 1, "caps": {"api": 8}}}

* ``weight`` (default 1): a number > 0. Under contention each job's share of each pool (cores,
  GPUs, each API) converges to its weight over the weights of the jobs that want it.
* ``caps`` (optional): the most a job holds at once, per resource: ``cores`` (or ``cpus``),
  ``gpus``, ``api`` (units of every API) or ``api:<name>`` (one API's); integers >= 0.
* ``keys`` (optional): CURVE key names (``tangram keys add NAME``) bound to the job. A client
  with a bound key is in that job (whether it names it or no job; naming another is refused),
  and no other key may claim a job that lists keys. Without CURVE no key can be proven, so such a job
  cannot be claimed at all.

A job a client names that is not listed here has weight 1 and no caps. Everything wrong is a
``ConfigError`` naming the path and the fix, before the controller starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tangram.core import events as ev
from tangram.core.jobs import ANY_API
from tangram.core.resources import CPU, GPU
from tangram.errors import ConfigError

NAME_RE = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}"  # what a client's HELLO may carry (protocol `Name`)
_CAP_NAMES = {"cores": CPU, "cpus": CPU, "cpu": CPU, "gpus": GPU, "gpu": GPU, ANY_API: ANY_API}
_FIELDS = ("weight", "caps", "keys")


@dataclass(frozen=True)
class JobConf:
    name: str
    weight: float = 1.0
    caps: tuple[tuple[str, int], ...] = ()  # core resource names: cpu, gpu, api, api:<name>
    keys: tuple[str, ...] = ()  # CURVE key names bound to the job

    def event(self) -> ev.JobDefined:
        return ev.JobDefined(self.name, self.weight, self.caps)


def _cap(key: object, value: object, where: str) -> tuple[str, int]:
    res = _CAP_NAMES.get(key) if isinstance(key, str) else None
    if res is None and isinstance(key, str) and re.fullmatch(r"api:[A-Za-z0-9_.-]{1,64}", key):
        res = key
    if res is None:
        raise ConfigError(
            f"{where}: unknown resource {key!r} in caps",
            hint="cap cores, gpus, api (every API) or api:<name> (one API)",
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}.{key}: expected an integer >= 0, got {value!r}")
    return res, value


def _job(name: object, raw: object, where: str) -> JobConf:
    if not isinstance(name, str) or not re.fullmatch(NAME_RE, name):
        raise ConfigError(
            f"{where}: bad job name {name!r}", hint="1-64 of A-Z a-z 0-9 _ . : -, starting alnum"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with `weight`, `caps` or `keys`")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}", hint=f"known: {', '.join(_FIELDS)}")
    weight = raw.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
        or weight <= 0
    ):
        raise ConfigError(
            f"{where}.weight: expected a number > 0, got {weight!r}", hint="weights are relative: 1, 3"
        )
    caps_raw = raw.get("caps") or {}
    if not isinstance(caps_raw, dict):
        raise ConfigError(f"{where}.caps: expected a mapping like {{cores: 64, gpus: 8}}")
    caps: dict[str, int] = {}
    for key, value in caps_raw.items():
        res, n = _cap(key, value, f"{where}.caps")
        if res in caps:
            raise ConfigError(f"{where}.caps: {key!r} caps {res} a second time")
        caps[res] = n
    keys = raw.get("keys") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) and re.fullmatch(NAME_RE, k) for k in keys):
        raise ConfigError(f"{where}.keys: expected a list of key names (`tangram keys list`), got {keys!r}")
    return JobConf(name, float(weight), tuple(sorted(caps.items())), tuple(keys))


def parse_jobs(raw: object, where: str = "jobs") -> tuple[JobConf, ...]:
    """The ``jobs`` mapping (module docstring); ``None`` or empty: no jobs."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of job name -> {{weight, caps, keys}}")
    jobs = tuple(_job(name, body, f"{where}.{name}") for name, body in raw.items())
    bound: dict[str, str] = {}
    for job in jobs:
        for key in job.keys:
            if key in bound:
                raise ConfigError(
                    f"{where}.{job.name}.keys: key {key!r} is bound to job {bound[key]!r} already",
                    hint="a key belongs to one job",
                )
            bound[key] = job.name
    return jobs


def jobs_dict(jobs: tuple[JobConf, ...]) -> dict[str, Any]:
    """The ``jobs`` mapping that ``parse_jobs`` reads back to ``jobs``."""
    names = {CPU: "cores", GPU: "gpus"}
    return {
        j.name: {"weight": j.weight, "caps": {names.get(r, r): n for r, n in j.caps}, "keys": list(j.keys)}
        for j in jobs
    }


def admit_job(jobs: tuple[JobConf, ...], asked: str, key_name: str | None) -> tuple[str, str | None]:
    """The job of a client that named ``asked`` ("": none) with CURVE key ``key_name`` (None:
    no CURVE), and why it is refused (None: admitted). Rules in the module docstring."""
    bound = next((j.name for j in jobs if key_name is not None and key_name in j.keys), None)
    if bound is not None:
        if asked and asked != bound:
            return "", f"key {key_name!r} is bound to job {bound!r}; it may not claim job {asked!r}"
        return bound, None
    conf = next((j for j in jobs if j.name == asked), None)
    if conf is not None and conf.keys:
        if key_name is None:
            return "", f"job {asked!r} is bound to CURVE keys, and this controller runs without CURVE"
        return "", f"job {asked!r} is bound to other keys; key {key_name!r} may not claim it"
    return asked, None
