"""`tangram up`'s warm-pool and RL-job flags for the local default: parsed, checked, put into the
controller's configuration, and read back from a running cluster's ``controller.json``.

* ``--sandbox-pool N``: the controller's ``sandbox_pool`` with ``max: N``: each node keeps, per shape
  (image and memory a sandbox is opened with), up to N created idle sandboxes, sized from the opens
  of the last ``history_s`` (tangram/core/pool.py); every other key at its default (``min: 0``,
  ``mem_fraction: 0.25``). 0, the default, leaves pools off. Only the Docker executor keeps pools
  (agent/pool_requests.py): with the process executor the flag is refused.
* ``--job NAME=WEIGHT[,RES=CAP...]`` (repeatable): ``jobs.NAME`` with that weight and caps (``cores``,
  ``gpus``, ``api`` or ``api:<name>``), as tangram_cli/controller/jobs_config.py reads them. Binding
  CURVE keys to a job (``keys``) needs an inventory.

Both are local-default flags: with an inventory `up` refuses them (the inventory's ``sandbox_pool``
and ``jobs`` sections say the same). ``controller.json`` is the one record of what a cluster runs
with; ``recorded`` reads it back so that `up` can compare (``differences``). Every bad value is a
``ConfigError`` (exit 2) naming the flag and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tangram.core.pool import PoolPolicy
from tangram.core.resources import CPU, GPU
from tangram.errors import ConfigError
from tangram_cli import state as st
from tangram_cli.controller.jobs_config import JobConf, jobs_dict, parse_jobs
from tangram_cli.controller.pools import parse_policy

if TYPE_CHECKING:
    from tangram_cli.controller.config import ControllerConfig

MAX_POOL = 1 << 16  # as the controller's `sandbox_pool.max` (pools.parse_policy)
_JOB_HINT = "write --job NAME=WEIGHT, e.g. --job train=3 --job eval=1 (weights are relative; "
_JOB_HINT += "caps: --job eval=1,cores=8,gpus=1,api=4)"


@dataclass(frozen=True)
class LocalExtras:
    """What ``--sandbox-pool`` and ``--job`` ask of the local default's controller."""

    sandbox_pool: int = 0  # the most idle pooled sandboxes per node and shape; 0: off
    jobs: tuple[JobConf, ...] = ()

    def apply(self, config: ControllerConfig) -> ControllerConfig:
        """``config`` with these pools and jobs (unchanged when neither is asked for)."""
        changes: dict[str, Any] = {}
        if self.sandbox_pool:
            changes["sandbox_pool"] = PoolPolicy(max=self.sandbox_pool)
        if self.jobs:
            changes["jobs"] = self.jobs
        return replace(config, **changes) if changes else config

    def describe(self) -> list[str]:
        """Lines for `up`'s closing words; none when pools are off and no job is defined."""
        out = []
        if self.sandbox_pool:
            out.append(
                f"warm sandbox pools: up to {self.sandbox_pool} idle sandbox(es) per node and shape, "
                "sized from recent opens (Docker executor)"
            )
        if self.jobs:
            out.append("jobs: " + ", ".join(_job_line(j) for j in self.jobs))
        return out

    def to_dict(self) -> dict[str, Any]:
        """For `up -o json`: ``sandbox_pool`` (0: off) and ``jobs`` (the config's mapping)."""
        return {"sandbox_pool": self.sandbox_pool, "jobs": jobs_dict(self.jobs)}


def check_pool(n: int) -> int:
    """``--sandbox-pool N``: an integer in [0, 65536]."""
    if not 0 <= n <= MAX_POOL:
        raise ConfigError(
            f"--sandbox-pool {n}: expected an integer in [0, {MAX_POOL}] (idle sandboxes kept per node "
            "and shape; 0: no pools)",
            hint="e.g. --sandbox-pool 8, or leave it out for no pools",
        )
    return n


def parse_job_flags(texts: tuple[str, ...] | list[str]) -> tuple[JobConf, ...]:
    """Every ``--job`` given, in order; a name given twice is an error naming both."""
    seen: dict[str, str] = {}
    jobs = []
    for text in texts:
        job = parse_job_flag(text)
        if job.name in seen:
            raise ConfigError(
                f"--job {job.name} given twice ({seen[job.name]} and {text})",
                hint=f"give each job once: keep one of --job {seen[job.name]} and --job {text}",
            )
        seen[job.name] = text
        jobs.append(job)
    return tuple(jobs)


def parse_job_flag(text: str) -> JobConf:
    """``NAME=WEIGHT[,RES=CAP...]`` -> the job, checked as the controller's config checks it."""
    head, *cap_parts = text.split(",")
    name, eq, weight_text = head.partition("=")
    name = name.strip()
    if not eq or not weight_text.strip():
        raise ConfigError(f"--job {text}: no weight for job {name!r}", hint=_JOB_HINT)
    try:
        weight = float(weight_text)
    except ValueError:
        raise ConfigError(f"--job {text}: weight {weight_text!r} is not a number", hint=_JOB_HINT) from None
    if not math.isfinite(weight) or weight <= 0:
        raise ConfigError(
            f"--job {text}: weight {weight_text} must be a finite number > 0",
            hint="weights are relative shares: e.g. --job train=3 --job eval=1",
        )
    caps: dict[str, int] = {}
    for part in cap_parts:
        res, eq, value = part.partition("=")
        res = res.strip()
        if not eq or not value.strip().isdigit():
            raise ConfigError(
                f"--job {text}: cap {part!r} is not RESOURCE=COUNT with a count >= 0", hint=_JOB_HINT
            )
        if res in caps:
            raise ConfigError(f"--job {text}: {res} is capped twice", hint="give each cap once")
        caps[res] = int(value)
    try:
        (job,) = parse_jobs({name: {"weight": weight, "caps": caps}}, where="jobs")
    except ConfigError as exc:  # the config's words, with the flag instead of the path
        _path, _, why = exc.message.partition(": ")
        raise ConfigError(f"--job {text}: {why}", hint=exc.hint or _JOB_HINT) from None
    return job


def job_word(job: JobConf) -> str:
    """A job as ``--job`` takes it: ``train=3`` or ``eval=1,cores=8``."""
    names = {CPU: "cores", GPU: "gpus"}
    return ",".join([f"{job.name}={_num(job.weight)}", *(f"{names.get(r, r)}={n}" for r, n in job.caps)])


def _job_line(job: JobConf) -> str:
    caps = " ".join(job_word(job).split(",")[1:])
    keys = f" keys {','.join(job.keys)}" if job.keys else ""
    return f"{job.name} (weight {_num(job.weight)}{', caps ' + caps if caps else ''}{keys})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def recorded(name: str) -> LocalExtras | None:
    """The pools and jobs the cluster's controller was started with (its ``controller.json``); None
    when that file is missing or unreadable (restart.recorded_config says why on a restart)."""
    try:
        raw = json.loads(st.controller_config_path(name).read_text())
        policy = parse_policy(raw.get("sandbox_pool"))
        jobs = parse_jobs(raw.get("jobs"))
    except (OSError, ValueError, AttributeError, ConfigError):
        return None
    return LocalExtras(policy.max, jobs)


def _same_jobs(a: tuple[JobConf, ...], b: tuple[JobConf, ...]) -> bool:
    return sorted(a, key=lambda j: j.name) == sorted(b, key=lambda j: j.name)


def differences(running: LocalExtras, wanted: dict[str, object]) -> list[str]:
    """The pool and job flags given (keys ``sandbox_pool``, ``jobs`` of ``wanted``) that differ from
    what runs, each as ``--sandbox-pool 4 (running: off)``; flags not given never differ."""
    out = []
    pool = wanted.get("sandbox_pool")
    if isinstance(pool, int) and pool != running.sandbox_pool:
        out.append(f"--sandbox-pool {pool} (running: {running.sandbox_pool or 'off'})")
    jobs = wanted.get("jobs")
    if isinstance(jobs, tuple) and not _same_jobs(jobs, running.jobs):
        now = " ".join(f"--job {job_word(j)}" for j in running.jobs) or "no jobs"
        out.append(f"{flag_words(jobs)} (running: {now})")
    return out


def flag_words(jobs: tuple[JobConf, ...]) -> str:
    """``--job a=1 --job b=3,cores=4``: the jobs as the user would write them again."""
    return " ".join(f"--job {job_word(j)}" for j in jobs)
