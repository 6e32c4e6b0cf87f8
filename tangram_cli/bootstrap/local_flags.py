"""`tangram up`'s warm-pool and RL-job flags for the local default: parsed, checked, put into the
controller's configuration, and read back from a running cluster's ``controller.json``.

* ``--sandbox-pool N[,mem=SHARE]``: the controller's ``sandbox_pool`` with ``max: N``: each node keeps,
  per shape (image and memory a sandbox is opened with), up to N created idle sandboxes, sized from the
  opens of the last ``history_s`` (tangram/core/pool.py), holding together at most ``mem_fraction`` of
  the node's memory. ``mem=`` sets that share: a fraction (``0.5``), a percentage (``50%``) or a size
  (``6GiB``, turned into a fraction of what this machine's agent offers sandboxes, agent/probe.py);
  left out, 0.25. A pooled sandbox's own memory is not a pool setting: it is the shape opened (a
  sandbox opened without ``mem`` holds the agent's default). Every other key at its default
  (``min: 0``). 0, the default, leaves pools off. Only the Docker executor keeps pools
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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tangram.core.pool import PoolPolicy
from tangram.core.resources import CPU, GPU
from tangram.errors import ConfigError
from tangram_cli import state as st
from tangram_cli.controller.jobs_config import JobConf, jobs_dict, parse_jobs
from tangram_cli.controller.pools import parse_policy
from tangram_cli.inventory import parse_size_mib

if TYPE_CHECKING:
    from tangram_cli.controller.config import ControllerConfig

MAX_POOL = 1 << 16  # as the controller's `sandbox_pool.max` (pools.parse_policy)
_JOB_HINT = "write --job NAME=WEIGHT, e.g. --job train=3 --job eval=1 (weights are relative; "
_JOB_HINT += "caps: --job eval=1,cores=8,gpus=1,api=4)"


DEFAULT_MEM_FRACTION = PoolPolicy().mem_fraction
_POOL_HINT = (
    "write --sandbox-pool N[,mem=SHARE], SHARE the most of each node's memory its idle pooled sandboxes "
    "hold together: a fraction (0.5), a percentage (50%) or a size (6GiB); e.g. --sandbox-pool 8,mem=50%"
)


@dataclass(frozen=True)
class PoolFlag:
    """``--sandbox-pool N[,mem=SHARE]``: ``max`` idle pooled sandboxes per node and shape (0: off) and
    ``mem_fraction``, the most of a node's memory they hold together (the controller's ``sandbox_pool``
    keys of the same names)."""

    max: int = 0
    mem_fraction: float = DEFAULT_MEM_FRACTION
    text: str = field(default="", compare=False)  # as the user wrote it; "" for one read back

    def same(self, other: PoolFlag) -> bool:
        """The same pools: both off, or the same ``max`` and share of memory."""
        if not self.max or not other.max:
            return self.max == other.max
        return self.max == other.max and math.isclose(self.mem_fraction, other.mem_fraction, rel_tol=1e-9)

    def word(self) -> str:
        """As ``--sandbox-pool`` takes it: the text given, else ``8`` or ``8,mem=50%``."""
        if self.text:
            return self.text
        if not self.max or self.mem_fraction == DEFAULT_MEM_FRACTION:
            return str(self.max)
        return f"{self.max},mem={percent(self.mem_fraction)}"


def percent(fraction: float) -> str:
    """0.25 -> ``25%``; 0.27649 -> ``27.65%``."""
    return f"{round(fraction * 100, 2):g}%"


@dataclass(frozen=True)
class LocalExtras:
    """What ``--sandbox-pool`` and ``--job`` ask of the local default's controller."""

    pool: PoolFlag = PoolFlag()  # warm sandbox pools; max 0: off
    jobs: tuple[JobConf, ...] = ()

    @property
    def sandbox_pool(self) -> int:
        """The most idle pooled sandboxes per node and shape; 0: off."""
        return self.pool.max

    def apply(self, config: ControllerConfig) -> ControllerConfig:
        """``config`` with these pools and jobs (unchanged when neither is asked for)."""
        changes: dict[str, Any] = {}
        if self.pool.max:
            changes["sandbox_pool"] = PoolPolicy(max=self.pool.max, mem_fraction=self.pool.mem_fraction)
        if self.jobs:
            changes["jobs"] = self.jobs
        return replace(config, **changes) if changes else config

    def describe(self) -> list[str]:
        """Lines for `up`'s closing words; none when pools are off and no job is defined."""
        out = []
        if self.pool.max:
            out.append(
                f"warm sandbox pools: up to {self.pool.max} idle sandbox(es) per node and shape, "
                f"sized from recent opens, holding at most {percent(self.pool.mem_fraction)} of the "
                "node's memory (Docker executor)"
            )
        if self.jobs:
            out.append("jobs: " + ", ".join(_job_line(j) for j in self.jobs))
        return out

    def to_dict(self) -> dict[str, Any]:
        """For `up -o json`: ``sandbox_pool`` (0: off), ``sandbox_pool_mem_fraction`` and ``jobs``
        (the config's mapping)."""
        return {
            "sandbox_pool": self.pool.max,
            "sandbox_pool_mem_fraction": self.pool.mem_fraction,
            "jobs": jobs_dict(self.jobs),
        }


def local_mem_mib() -> int:
    """The memory (MiB) the local default's agent offers sandboxes: the node's memory as the controller
    sees it (agent/probe.py ``mem_offer_mib``; the local default sets no ``mem``)."""
    from agent import probe  # start-up cost: only for --sandbox-pool N,mem=SIZE

    return probe.mem_offer_mib(probe.meminfo())


def parse_pool_flag(text: str, node_mem_mib: Callable[[], int] = local_mem_mib) -> PoolFlag:
    """``--sandbox-pool N[,mem=SHARE]`` -> the pools, checked as the controller's config checks them;
    ``node_mem_mib`` is asked only for a SHARE given as a size."""
    head, *parts = text.split(",")
    try:
        n = int(head.strip())
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_POOL:
        raise ConfigError(
            f"--sandbox-pool {text}: expected an integer in [0, {MAX_POOL}] (idle sandboxes kept per node "
            "and shape; 0: no pools)",
            hint="e.g. --sandbox-pool 8, or leave it out for no pools",
        )
    mem: float | None = None
    for part in parts:
        key, eq, value = part.partition("=")
        if key.strip() != "mem" or not eq:
            raise ConfigError(
                f"--sandbox-pool {text}: unknown part {part!r} (only mem=SHARE)", hint=_POOL_HINT
            )
        if mem is not None:
            raise ConfigError(f"--sandbox-pool {text}: mem given twice", hint="give mem= once")
        mem = _mem_share(text, value.strip(), node_mem_mib)
    if mem is not None and n == 0:
        raise ConfigError(
            f"--sandbox-pool {text}: mem= sizes pools, and N = 0 turns them off",
            hint="give N > 0 (e.g. --sandbox-pool 8,mem=50%), or leave the flag out for no pools",
        )
    return PoolFlag(n, DEFAULT_MEM_FRACTION if mem is None else mem, text)


def _mem_share(text: str, value: str, node_mem_mib: Callable[[], int]) -> float:
    """``mem=``'s value as a fraction of the node's memory, in (0, 1]."""
    where = f"--sandbox-pool {text}: mem"
    if value.endswith("%"):
        share = _number(value[:-1], where) / 100
    elif _float(value) is not None:
        share = _number(value, where)
        if share > 1:
            raise ConfigError(
                f"{where}: a number without a unit is a fraction of the node's memory, in (0, 1]",
                hint="write a fraction (0.5), a percentage (50%) or a size with its unit (6GiB)",
            )
    else:
        share = _size_share(where, value, node_mem_mib)
    if not 0 < share <= 1:
        raise ConfigError(
            f"{where}: the share must be more than 0 and at most all of the node's memory", hint=_POOL_HINT
        )
    return share


def _size_share(where: str, value: str, node_mem_mib: Callable[[], int]) -> float:
    try:
        mib = parse_size_mib(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}", hint=_POOL_HINT) from None
    offer = node_mem_mib()
    if offer <= 0:
        raise ConfigError(f"{where}: cannot read this machine's memory", hint="give a percentage: mem=50%")
    if mib > offer:
        raise ConfigError(
            f"{where}: more than this machine offers sandboxes ({offer} MiB)",
            hint=f"give at most {offer}MiB, or a percentage (mem=50%)",
        )
    return mib / offer


def _float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def _number(value: str, where: str) -> float:
    x = _float(value)
    if x is None or not math.isfinite(x):
        raise ConfigError(f"{where}: {value!r} is not a finite number", hint=_POOL_HINT)
    return x


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
    return LocalExtras(PoolFlag(policy.max, policy.mem_fraction), jobs)


def _same_jobs(a: tuple[JobConf, ...], b: tuple[JobConf, ...]) -> bool:
    return sorted(a, key=lambda j: j.name) == sorted(b, key=lambda j: j.name)


def differences(running: LocalExtras, wanted: dict[str, object], was: str = "running") -> list[str]:
    """The pool and job flags given (keys ``sandbox_pool``, a PoolFlag, and ``jobs`` of ``wanted``) that
    differ from ``running``, each as ``--sandbox-pool 4 (running: off)`` (``was``: that word);
    flags not given never differ."""
    out = []
    pool = wanted.get("sandbox_pool")
    if isinstance(pool, PoolFlag) and not pool.same(running.pool):
        now = running.pool.word() if running.pool.max else "off"
        out.append(f"--sandbox-pool {pool.word()} ({was}: {now})")
    jobs = wanted.get("jobs")
    if isinstance(jobs, tuple) and not _same_jobs(jobs, running.jobs):
        now = " ".join(f"--job {job_word(j)}" for j in running.jobs) or "no jobs"
        out.append(f"{flag_words(jobs)} ({was}: {now})")
    return out


def flag_words(jobs: tuple[JobConf, ...]) -> str:
    """``--job a=1 --job b=3,cores=4``: the jobs as the user would write them again."""
    return " ".join(f"--job {job_word(j)}" for j in jobs)
