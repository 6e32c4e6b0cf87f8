"""Workloads: seeded trajectory plans from the YAML files shipped in ``sim/workloads/``.

A trajectory is a client-side process: LLM generation (``think_s``) -> one action -> wait
for it -> next turn; its last action is the reward. A step is a batch of trajectories that
start together; it ends when the last one finishes, then training runs (``train_s``) with
no external calls. Every plan is drawn from a per-trajectory ``Random`` seeded with
``"<seed>:<workload>:<index>"``, so every policy sees the same trajectories (common random
numbers) and the plan does not depend on the batch size or on PYTHONHASHSEED.

YAML schema (every value is documented in the files themselves)::

    name, description, train_s, sandbox_mem_gib, pod_cores, noise_sigma
    turns: DIST                 # tool turns per trajectory
    think_s: DIST               # generation before each action
    tools: [{name, weight, kind: exec|api|call, t_ori_s: DIST, cores: [lo, hi] | api | service ...,
             tokens: DIST (api: what the provider charges a call, for keys with a TPM limit)}]
    reward: {same fields as a tool}
    services: [{name, count, pick: zipf|uniform, zipf_s, model_gb, chunk_sizes, serial_fraction, static_gpus}]
    apis: [{name, mode: quota|concurrency, limit, period_s,
            keys: [{name, rpm, tpm, concurrency}]}]  # a key pool (limit 0: only the keys' limits)
    cluster: {gpu_nodes: [..]}  # optional override of the cluster spec
    mix: [{workload, share, job, start_s}]  # a composite workload (mopd+search); ``job``: the part is
                                # an RL job of its own, its trajectories start ``start_s`` late
    jobs: {NAME: {weight, caps: {cpu, gpu, api, api:<name>}}}  # the jobs' weights and caps

DIST is a number, or ``{dist: lognormal, median, sigma[, lo, hi]}``, ``{dist: uniform, lo,
hi}``, ``{dist: uniform_int, lo, hi}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from random import Random
from typing import Any

import yaml

from tangram.core.jobs import JobSpec
from tangram.core.managers.keys import ApiKey
from tangram.errors import ConfigError

NAMES = ("coding", "deepsearch", "deepsearch-keys", "mopd", "mopd+search", "coding-jobs", "coding-burst")
_FILES = {
    "mopd+search": "mopd_search",
    "deepsearch-keys": "deepsearch_keys",
    "coding-jobs": "coding_jobs",
    "coding-burst": "coding_burst",
}


@dataclass(frozen=True)
class Dist:
    kind: str
    a: float = 0.0
    b: float = 0.0
    lo: float = -math.inf
    hi: float = math.inf

    def draw(self, rng: Random) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "uniform_int":
            return float(rng.randint(int(self.a), int(self.b)))
        x = self.a * math.exp(rng.gauss(0.0, self.b))  # lognormal: median a, sigma b
        return min(max(x, self.lo), self.hi)

    def mean(self) -> float:
        if self.kind == "const":
            return self.a
        if self.kind in ("uniform", "uniform_int"):
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b * self.b / 2)


def parse_dist(v: Any, where: str) -> Dist:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return Dist("const", float(v))
    if not isinstance(v, dict) or "dist" not in v:
        raise ConfigError(
            f"{where}: expected a number or a {{dist: ...}} mapping, got {v!r}",
            hint="see the schema in tangram/sim/workloads.py",
        )
    kind = v["dist"]
    try:
        if kind == "lognormal":
            return Dist(
                kind,
                float(v["median"]),
                float(v["sigma"]),
                float(v.get("lo", -math.inf)),
                float(v.get("hi", math.inf)),
            )
        if kind in ("uniform", "uniform_int"):
            return Dist(kind, float(v["lo"]), float(v["hi"]))
    except KeyError as exc:
        raise ConfigError(
            f"{where}: {kind} needs {exc.args[0]!r}", hint="see tangram/sim/workloads.py"
        ) from None
    raise ConfigError(f"{where}: unknown dist {kind!r}", hint="use lognormal, uniform or uniform_int")


@dataclass(frozen=True)
class ActionKind:
    """One kind of action a trajectory may submit."""

    name: str
    kind: str  # exec | api | call
    t_ori: Dist
    weight: float = 1.0
    cores: tuple[int, int] = (1, 1)
    serial_fraction: float | None = None
    profiled: bool = False
    api: str = ""
    service: str = ""  # a service group name
    gpus: tuple[int, ...] = (1,)
    tokens: Dist | None = None  # api: tokens the provider charges a call (None: none)


@dataclass(frozen=True)
class ServiceGroup:
    name: str
    count: int
    model_gb: float
    chunk_sizes: tuple[int, ...]
    serial_fraction: float | None
    static_gpus: int
    pick: str = "uniform"
    zipf_s: float = 1.0

    def members(self) -> list[str]:
        return [self.name] if self.count == 1 else [f"{self.name}-{i}" for i in range(self.count)]

    def weights(self) -> list[float]:
        if self.pick == "zipf":
            return [1.0 / (i + 1) ** self.zipf_s for i in range(self.count)]
        return [1.0] * self.count


@dataclass(frozen=True)
class ApiSpec:
    name: str
    mode: str
    limit: int
    period_s: float = 60.0
    keys: tuple[ApiKey, ...] = ()


@dataclass(frozen=True)
class Workload:
    name: str
    description: str = ""
    turns: Dist = Dist("const", 1.0)
    think_s: Dist = Dist("const", 1.0)
    tools: tuple[ActionKind, ...] = ()
    reward: ActionKind | None = None
    services: tuple[ServiceGroup, ...] = ()
    apis: tuple[ApiSpec, ...] = ()
    train_s: float = 0.0
    sandbox_mem_mib: int = 0
    pod_cores: int = 4
    noise_sigma: float = 0.1
    cluster: dict[str, Any] = field(default_factory=dict)
    mix: tuple[tuple[Workload, float], ...] = ()
    job: str = ""  # the RL job its trajectories belong to ("": the default job)
    start_s: float = 0.0  # its trajectories start this long after the step does
    jobs: tuple[JobSpec, ...] = ()  # the jobs' weights and caps (a composite of jobs)
    fair: bool = True  # False: the core hears of no job (every action in the default job)

    def parts(self) -> list[tuple[Workload, float]]:
        return list(self.mix) if self.mix else [(self, 1.0)]

    def all_services(self) -> list[ServiceGroup]:
        seen: dict[str, ServiceGroup] = {}
        for w, _ in self.parts():
            for s in w.services:
                seen.setdefault(s.name, s)
        return list(seen.values())

    def all_apis(self) -> list[ApiSpec]:
        seen: dict[str, ApiSpec] = {}
        for w, _ in self.parts():
            for a in w.apis:
                seen.setdefault(a.name, a)
        return list(seen.values())


@dataclass(slots=True)
class ActionPlan:
    think_s: float  # generation before this action
    kind: str  # exec | api | call
    category: str  # env | reward
    action_type: str
    t_ori: float  # true single-unit duration (noise included)
    lo: int = 1
    hi: int = 1
    gpus: tuple[int, ...] = (1,)
    serial: float | None = None
    profiled: bool = False
    service: str = ""
    api: str = ""
    profile: float | None = None  # what profiling says T_ori is (the draw before run noise)
    tokens: int = 0  # api: what the provider charges the call (the lease declares it)


@dataclass(slots=True)
class TrajPlan:
    tid: str
    task: str
    mem_mib: int
    pod_cores: int
    sandboxed: bool
    actions: list[ActionPlan]
    job: str = ""  # its RL job ("": the default)
    start_s: float = 0.0  # its first action comes this long after the step starts (plus think time)


# -- loading ---------------------------------------------------------------------------------
def _action(d: dict[str, Any], where: str) -> ActionKind:
    kind = d.get("kind")
    if kind not in ("exec", "api", "call"):
        raise ConfigError(
            f"{where}: kind must be exec, api or call, got {kind!r}", hint="fix the workload file"
        )
    cores = d.get("cores", [1, 1])
    return ActionKind(
        name=str(d.get("name", kind)),
        kind=kind,
        t_ori=parse_dist(d.get("t_ori_s"), f"{where}.t_ori_s"),
        weight=float(d.get("weight", 1.0)),
        cores=(int(cores[0]), int(cores[1])),
        serial_fraction=None if d.get("serial_fraction") is None else float(d["serial_fraction"]),
        profiled=bool(d.get("profiled", False)),
        api=str(d.get("api", "")),
        service=str(d.get("service", "")),
        gpus=tuple(int(g) for g in d.get("gpus", [1])),
        tokens=parse_dist(d["tokens"], f"{where}.tokens") if d.get("tokens") is not None else None,
    )


def _keys(raw: Any) -> tuple[ApiKey, ...]:
    return tuple(
        ApiKey(str(k["name"]), int(k.get("rpm", 0)), int(k.get("tpm", 0)), int(k.get("concurrency", 0)))
        for k in raw
    )


def from_dict(doc: dict[str, Any], where: str = "workload") -> Workload:
    if "mix" in doc:
        mix = tuple((_part(m), float(m["share"])) for m in doc["mix"])
        return Workload(
            name=str(doc["name"]),
            description=str(doc.get("description", "")),
            mix=mix,
            train_s=float(doc.get("train_s", 0.0)),
            cluster=dict(doc.get("cluster") or {}),
            jobs=_jobs(doc.get("jobs") or {}, f"{where}.jobs"),
        )
    services = tuple(
        ServiceGroup(
            str(s["name"]),
            int(s.get("count", 1)),
            float(s["model_gb"]),
            tuple(int(c) for c in s.get("chunk_sizes", [1])),
            None if s.get("serial_fraction") is None else float(s["serial_fraction"]),
            int(s.get("static_gpus", 1)),
            str(s.get("pick", "uniform")),
            float(s.get("zipf_s", 1.0)),
        )
        for s in doc.get("services") or []
    )
    apis = tuple(
        ApiSpec(
            str(a["name"]),
            str(a.get("mode", "concurrency")),
            int(a.get("limit", 0)),
            float(a.get("period_s", 60.0)),
            _keys(a.get("keys") or ()),
        )
        for a in doc.get("apis") or []
    )
    tools = tuple(_action(t, f"{where}.tools[{i}]") for i, t in enumerate(doc.get("tools") or []))
    reward = _action(doc["reward"], f"{where}.reward") if doc.get("reward") else None
    return Workload(
        name=str(doc["name"]),
        description=str(doc.get("description", "")),
        turns=parse_dist(doc.get("turns", 0), f"{where}.turns"),
        think_s=parse_dist(doc.get("think_s", 0), f"{where}.think_s"),
        tools=tools,
        reward=reward,
        services=services,
        apis=apis,
        train_s=float(doc.get("train_s", 0.0)),
        sandbox_mem_mib=int(float(doc.get("sandbox_mem_gib", 0)) * 1024),
        pod_cores=int(doc.get("pod_cores", 4)),
        noise_sigma=float(doc.get("noise_sigma", 0.1)),
        cluster=dict(doc.get("cluster") or {}),
    )


def _part(m: dict[str, Any]) -> Workload:
    """A part of a composite; one with a ``job`` is renamed ``<job>-<workload>`` (its own
    trajectories, ids and duration history) and may start ``start_s`` late."""
    w = load(m["workload"])
    job = str(m.get("job", ""))
    if not job:
        return w
    return replace(w, name=f"{job}-{w.name}", job=job, start_s=float(m.get("start_s", 0.0)))


def _jobs(raw: dict[str, Any], where: str) -> tuple[JobSpec, ...]:
    out = []
    for name, d in sorted(raw.items()):
        caps = tuple(sorted((str(k), int(v)) for k, v in (d.get("caps") or {}).items()))
        spec = JobSpec(str(name), float(d.get("weight", 1.0)), caps)
        if (problem := spec.problem()) is not None:
            raise ConfigError(
                f"{where}.{name}: {problem}", hint="weights are numbers > 0; caps: cpu, gpu, api"
            )
        out.append(spec)
    return tuple(out)


def without_jobs(w: Workload) -> Workload:
    """The same workload as the scheduler without jobs sees it: one FCFS queue per pool. Its
    trajectories keep their job names, for the figures only."""
    return replace(w, name=f"{w.name}-no-jobs", fair=False)


def load(name_or_path: str) -> Workload:
    """A shipped workload by name (``coding``, ``deepsearch``, ``mopd``, ``mopd+search``) or a YAML path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        text, where = p.read_text(), str(p)
    else:
        fname = _FILES.get(name_or_path, name_or_path) + ".yaml"
        try:
            text = resources.files("tangram.sim").joinpath("workloads", fname).read_text()
        except (FileNotFoundError, OSError):
            raise ConfigError(
                f"unknown workload {name_or_path!r}",
                hint=f"use one of {', '.join(NAMES)} or a path to a .yaml file",
            ) from None
        where = fname
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}", hint="fix the workload file") from None
    try:
        return from_dict(doc, where)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: bad workload: {exc!r}", hint="see the schema in tangram/sim/workloads.py"
        ) from None


# -- generation --------------------------------------------------------------------------------
def _pick(rng: Random, items: list[Any], weights: list[float]) -> Any:
    x = rng.random() * sum(weights)
    for item, w in zip(items, weights, strict=True):
        x -= w
        if x < 0:
            return item
    return items[-1]


def _plan_action(
    w: Workload, a: ActionKind, rng: Random, think: float, category: str, services: dict[str, str]
) -> ActionPlan:
    noise = math.exp(rng.gauss(0.0, w.noise_sigma)) if w.noise_sigma > 0 else 1.0
    base = max(1e-3, a.t_ori.draw(rng))
    t_ori = base * noise
    service = services.get(a.service, "") if a.kind == "call" else ""
    sg = next((s for s in w.services if s.name == a.service), None)
    serial = a.serial_fraction if a.serial_fraction is not None else (sg.serial_fraction if sg else None)
    gpus = sg.chunk_sizes if sg is not None else a.gpus
    tokens = max(1, round(a.tokens.draw(rng))) if a.tokens is not None else 0  # drawn last: others unchanged
    return ActionPlan(
        think,
        a.kind,
        category,
        f"{w.name}/{a.name}",
        t_ori,
        a.cores[0],
        a.cores[1],
        gpus,
        serial,
        a.profiled,
        service,
        a.api,
        base if a.profiled else None,
        tokens,
    )


def plan_trajectory(w: Workload, seed: int, index: int) -> TrajPlan:
    rng = Random(f"{seed}:{w.name}:{index}")
    services = {s.name: _pick(rng, s.members(), s.weights()) for s in w.services}  # a trajectory's domain
    n = int(w.turns.draw(rng))
    actions = []
    weights = [t.weight for t in w.tools]
    for _ in range(n if w.tools else 0):
        tool = _pick(rng, list(w.tools), weights)
        actions.append(_plan_action(w, tool, rng, w.think_s.draw(rng), "env", services))
    if w.reward is not None:
        actions.append(_plan_action(w, w.reward, rng, w.think_s.draw(rng), "reward", services))
    sandboxed = any(a.kind == "exec" for a in actions)
    return TrajPlan(
        f"{w.name}-{index}", w.name, w.sandbox_mem_mib, w.pod_cores, sandboxed, actions, w.job, w.start_s
    )


def generate(w: Workload, batch: int, seed: int, step: int = 0) -> list[TrajPlan]:
    """``batch`` trajectory plans for step ``step`` (a composite splits the batch by share)."""
    parts = w.parts()
    total = sum(s for _, s in parts)
    out: list[TrajPlan] = []
    left = batch
    for i, (part, share) in enumerate(parts):
        n = left if i == len(parts) - 1 else round(batch * share / total)
        left -= n
        base = step * 1_000_000
        out.extend(plan_trajectory(part, seed, base + k) for k in range(n))
    return out
