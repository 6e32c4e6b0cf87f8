"""The policies the simulator compares, each an honest model of what people run today.
PURE (a guard test checks it): no clock, no I/O, no global random.

* ``tangram[:D]``: the real scheduler, ``CoreConfig(depth=D)`` (default 2, the paper's).
* ``k8s[:K]``: a Kubernetes pod per trajectory. The sandbox opens with ``reserve=K`` (the
  workload's ``pod_cores`` unless K is given): the core holds K cores for the trajectory's
  whole life, places it when K cores and its memory are free (trajectories queue FCFS when
  the cluster is full), and runs every action of the trajectory on those cores (tests with
  ``pytest -n K``). Pod start latency (API-server rate, create -> Ready) is the cluster
  model's (``sim/cluster.py``), so it grows with load.
* ``static``: every GPU service pinned to its own GPUs for the whole job (SGLang-style
  deployments), no sharing across services or tasks: ``StaticGpu`` below, a per-service
  FCFS allocator over dedicated replicas; everything else goes to a core ``Scheduler``.
* ``serverless``: GPU services loaded on demand into free GPUs with no cache-aware placement
  (``CoreConfig(cache_aware=False)``) and a fixed tensor-parallel size (the service's
  smallest chunk): ServerlessLLM-style scale-from-host-memory, without its locality-aware
  placement (see docs/simulator.md).
* ``fixed-dop:K``: Tangram's machinery, every elastic action gets exactly K units.
* ``api-retry``: clients call APIs directly; an over-quota call fails (429) and is retried
  with exponential backoff (``RetryPolicy``); no leases. Modelled in the client (engine).
* ``no-prewake``: Tangram without GPU pre-wake (``CoreConfig(prewake=False)``): restores start
  only when a call is chosen to run. ``tangram+no-prewake`` reproduces the results from before
  pre-wake existed; printed beside ``tangram`` it shows what pre-wake changes.
* ``staged``: Tangram with staged starts (``CoreConfig(stage=True)``, ``tangram/core/staging.py``),
  as the live controller runs it: a blocked node's next fixed-size exec is decided before the
  cores it takes are free and starts the moment they are. ``tangram+staged`` beside ``tangram``
  shows what deciding early costs when a decision takes no time (as here): a mis-guessed end.
* Combinations join with ``+``: ``api-retry+static`` is the paper's DeepSearch baseline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from random import Random

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind, duration
from tangram.core.resources import Demand
from tangram.core.scheduler import FIXED, MAX, MIN, CoreConfig, Scheduler
from tangram.errors import ConfigError

NAMES = ("tangram", "k8s", "static", "serverless", "fixed-dop:K", "api-retry", "no-prewake", "staged", "min",
         "max")


@dataclass(frozen=True)
class RetryPolicy:
    """Direct API calls: ROLL-style retries (docs/simulator.md §6.5: max 3 retries, backoff 2.0)."""

    max_attempts: int = 4  # the first call + 3 retries
    base_s: float = 1.0  # assumption: first backoff 1 s
    factor: float = 2.0
    cap_s: float = 30.0  # assumption
    error_s: float = 0.2  # assumption: a 429 answer takes one round trip
    reissues: int = 5  # assumption: after the retries fail, the agent sees the error, generates
    # again and re-issues the same call, at most this many times, before moving on

    def backoff(self, attempt: int, rng: Random) -> float:
        """Wait before retry ``attempt`` (1-based): capped exponential with equal jitter."""
        b = min(self.cap_s, self.base_s * self.factor ** (attempt - 1))
        return b / 2 + rng.random() * b / 2


@dataclass(frozen=True)
class Policy:
    name: str
    core: CoreConfig = field(default_factory=CoreConfig)
    reserve: int | None = None  # k8s: cores per pod (0: the workload's pod_cores)
    static: bool = False
    serverless: bool = False
    api_direct: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)


def _int_arg(part: str, arg: str) -> int:
    try:
        n = int(arg)
    except ValueError:
        raise ConfigError(
            f"policy {part!r}: {arg!r} is not a whole number", hint="e.g. fixed-dop:16"
        ) from None
    if n < 1:
        raise ConfigError(f"policy {part!r}: the number must be >= 1", hint="e.g. fixed-dop:16")
    return n


def parse_policy(text: str) -> Policy:
    """``tangram``, ``tangram:3``, ``k8s``, ``k8s:4``, ``static``, ``serverless``,
    ``fixed-dop:16``, ``api-retry``, ``no-prewake``, ``staged``, ``min``, ``max``, joined with ``+``."""
    depth, policy, fixed = 2, "tangram", 0
    reserve: int | None = None
    static = serverless = direct = False
    prewake, stage = True, False
    for part in text.strip().lower().split("+"):
        name, _, arg = part.partition(":")
        if name == "tangram":
            depth = _int_arg(part, arg) if arg else 2
        elif name == "k8s":
            reserve = _int_arg(part, arg) if arg else 0
        elif name == "static" and not arg:
            static = True
        elif name == "serverless" and not arg:
            serverless = True
        elif name == "api-retry" and not arg:
            direct = True
        elif name == "no-prewake" and not arg:
            prewake = False
        elif name == "staged" and not arg:
            stage = True
        elif name == "fixed-dop":
            if not arg:
                raise ConfigError("policy fixed-dop needs K", hint="e.g. fixed-dop:16")
            policy, fixed = FIXED, _int_arg(part, arg)
        elif name in (MIN, MAX) and not arg:
            policy = name
        else:
            raise ConfigError(
                f"unknown policy {part!r}", hint=f"use one of {', '.join(NAMES)}, joined with '+'"
            )
    core = CoreConfig(
        depth=depth, policy=policy, fixed_dop=fixed, cache_aware=not serverless, prewake=prewake, stage=stage
    )
    return Policy(text.strip().lower(), core, reserve, static, serverless, direct)


def call_demand(policy: Policy, sizes: tuple[int, ...]) -> Demand:
    """A GPU call's demand: its chunk sizes, or only the smallest for serverless/static."""
    if policy.serverless or policy.static:
        return Demand.fixed(min(sizes))
    return Demand.of(list(sizes))


Replica = tuple[str, int, int]  # (node, start, size)


def static_layout(
    wants: list[tuple[str, int, int]], nodes: list[tuple[str, int]]
) -> dict[str, list[Replica]]:
    """Pin each service (name, GPUs, replica size) to its own GPUs, node by node, in order."""
    free = [(n, c, 0) for n, c in nodes]  # (node, count, next free GPU)
    out: dict[str, list[Replica]] = {}
    i = 0
    for service, gpus, size in wants:
        reps: list[Replica] = []
        for _ in range(gpus // size):
            while i < len(free) and free[i][2] + size > free[i][1]:
                i += 1
            if i == len(free):
                have = sum(c for _, c in nodes)
                need = sum(g for _, g, _ in wants)
                raise ConfigError(
                    f"static deployment needs {need} GPUs, the cluster has {have}",
                    hint="give the cluster more GPU nodes or lower the services' static_gpus",
                )
            node, count, nxt = free[i]
            reps.append((node, nxt, size))
            free[i] = (node, count, nxt + size)
        out[service] = reps
    return out


class StaticGpu:
    """GPU calls on dedicated per-service replicas (FCFS per service, no loads, no sharing);
    every other event goes to ``inner``. Same contract as ``Scheduler``."""

    def __init__(self, inner: Scheduler, layout: dict[str, list[Replica]]) -> None:
        self.inner = inner
        self.layout = layout
        self.free: dict[str, list[int]] = {s: list(range(len(r))) for s, r in layout.items()}
        self.queue: dict[str, deque[ActionSpec]] = {s: deque() for s in layout}
        self.running: dict[str, tuple[str, int]] = {}

    @property
    def config(self) -> CoreConfig:
        return self.inner.config

    def handle(self, event: ev.Event, now: float, decide: bool = True) -> list[cmd.Command]:
        out = self._own(event)
        if out is None:
            return self.inner.handle(event, now, decide)
        if decide:  # what earlier events of the batch left to the inner passes
            out.extend(self.inner.decide(now))
        return out

    def decide(self, now: float) -> list[cmd.Command]:
        return self.inner.decide(now)

    def _own(self, event: ev.Event) -> list[cmd.Command] | None:
        """The commands for an event the static deployments handle themselves, else None."""
        if isinstance(event, ev.ActionSubmitted) and event.spec.kind is Kind.CALL:
            return self._submit(event.spec)
        if isinstance(event, ev.ActionFinished) and event.action_id in self.running:
            service, rep = self.running.pop(event.action_id)
            self.free[service].append(rep)
            self.free[service].sort()
            return [cmd.Done(event.action_id, event.ok, event.reason), *self._dispatch(service)]
        if isinstance(event, ev.ActionCancelled):
            for q in self.queue.values():
                for spec in q:
                    if spec.action_id == event.action_id:
                        q.remove(spec)
                        return [cmd.Reject(spec.action_id, "CANCELLED", event.reason)]
            if event.action_id in self.running:
                node = self.layout[self.running[event.action_id][0]][self.running[event.action_id][1]][0]
                return [cmd.Kill(event.action_id, node, event.reason)]
        return None

    def _submit(self, spec: ActionSpec) -> list[cmd.Command]:
        if spec.service not in self.layout:
            return [cmd.Reject(spec.action_id, "NO_CAPACITY", f"no static deployment of {spec.service!r}")]
        self.queue[spec.service].append(spec)
        return self._dispatch(spec.service)

    def _dispatch(self, service: str) -> list[cmd.Command]:
        out: list[cmd.Command] = []
        q, free = self.queue[service], self.free[service]
        while q and free:
            spec = q.popleft()
            rep = free.pop(0)
            node, start, size = self.layout[service][rep]
            t = spec.t_ori if spec.t_ori is not None else self.inner.config.default_duration_s
            self.running[spec.action_id] = (service, rep)
            out.append(
                cmd.Invoke(
                    spec.action_id, node, service, start, start + size, duration(t, spec.elasticity, size)
                )
            )
        return out

    def next_deadline(self) -> float | None:
        return self.inner.next_deadline()

    def snapshot(self) -> object:
        return self.inner.snapshot()


def make_core(
    policy: Policy, seed: int, layout: dict[str, list[Replica]] | None = None
) -> Scheduler | StaticGpu:
    inner = Scheduler(policy.core, seed)
    if policy.static:
        return StaticGpu(inner, layout or {})
    return inner
