"""The simulated cluster: node inventory, and the model that turns start commands into
finish events at the right virtual time.

Defaults are the paper's external pool: 15 CPU nodes x 256 cores (2 NUMA domains), 2.4 TB
each; 5 GPU nodes x 8 GPUs with 3 TB host memory. Times and rates come from published or
measured figures; each field names its row. § numbers here are sections of docs/simulator.md,
whose §6 writes down these sources:

* a command's action runs for ``T_ori / (E(m) m)`` with its *true* T_ori (noise is drawn
  with the plan, so every policy sees the same work);
* ``Invoke`` after a ``Load`` of the same chunk in the same command list first restores the
  service: ``restore_t0_s + bytes per GPU / h2d_gb_s`` (§6.3, restore model);
  a ``Load`` with no ``Invoke`` after it (a pre-wake) restores on its own, and a later
  ``Invoke`` on those GPUs starts when that restore ends (the node runs them in order): what
  is left of the restore then lies on the call's path (``Run.restore_s``), and the pre-wake's
  GPU-seconds are counted apart (``prewake_gpu_s``);
* ``CreateSandbox`` takes ``sandbox_create_s`` and each node creates at most
  ``sandbox_create_per_s`` containers per second (§6.2, the docker rows); with warm sandbox
  pools (``pool_max > 0``, pool.py) a ready pooled one is claimed in ``sandbox_claim_s`` instead;
* the Kubernetes baseline talks to the API server through **one FIFO request queue**
  (the job's sandbox manager's API client): a pod create (``Reserve``) holds it for
  ``1 / pod_api_per_s`` (§6.2: pod scheduling tops out near 70 pods/s with
  agent-sandbox) and the pod is Ready ``pod_ready_s`` after its turn (EKS create -> Ready); every
  action run in a pod is an exec API request (``POST .../pods/NAME/exec``) that holds it
  for ``1 / pod_exec_api_qps`` (the client's default ``--kube-api-qps=50``, same row), so
  pod start and exec latency grow with the number of concurrent trajectories. The exec
  request joins the queue when the action is started (``Spawn``), and the action runs once
  its request has had its turn and the pod is Ready, plus the exec's own latency;
* every ``Spawn`` pays a per-action control cost before it runs: the direct path's 3.7 ms
  (§6.2) in a Tangram sandbox, an exec through the container runtime (~68 ms, §6.2) in a
  Kubernetes pod (after its turn in the API queue above);
* a staged ``Spawn`` (``after``: ``tangram/core/staging.py``) begins when the run it follows
  ends, as the agent starts it; a follower of a run killed early still begins at that run's
  planned end (kills are timeouts and cancels: rare in the workloads);
* ``Kill`` finishes the action at once with ``ok=False``;
* a ``Grant`` of an API with keys is a call with that key to a provider that enforces each
  key's limits (``KeyedProvider``): over a limit it answers HTTP 429 (the rollout code sees
  it, reports it with ``ApiReported`` and leases again); otherwise the call runs its time and
  its holder reports the tokens the provider counted before releasing the lease.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import Elasticity, duration
from tangram.core.managers.keys import WINDOW_S, ApiKey
from tangram.errors import ConfigError
from tangram.sim.pool import SimPools

GIB = 1024


@dataclass(frozen=True)
class ClusterSpec:
    cpu_nodes: int = 15  # §6.1
    cores_per_node: int = 256  # §6.1 (AMD, 2 sockets -> 2 NUMA domains: assumption)
    numa_per_node: int = 2
    cpu_mem_gib: float = 2235.0  # 2.4 TB = 2235 GiB (§6.1)
    gpu_nodes: tuple[int, ...] = (8, 8, 8, 8, 8)  # GPUs per GPU node (§6.1)
    gpu_mem_gib: float = 80.0  # Hopper H100 80 GB: assumption (the paper says "Hopper")
    host_mem_gib: float = 2794.0  # 3 TB per GPU node (§6.1): parks every service
    restore_t0_s: float = 0.15  # §6.3 restore model: t0 = 0.1-0.2 s
    h2d_gb_s: float = 50.0  # §6.3: pinned H2D 53-57 GB/s; ServerlessLLM ~50 GB/s
    sandbox_create_s: float = 0.5  # §6.2: docker run, 8-core host, 0.5 s
    sandbox_create_per_s: float = 8.0  # §6.2: 500 containers in 60-75 s (~7-8/s)
    # Warm sandbox pools (pool.py; the controller's `sandbox_pool`): pool_max 0 = none. A claim costs
    # the agent's CreateSandbox round trip with a pooled container, measured live (docs/scheduler.md).
    sandbox_claim_s: float = 0.002
    pool_min: int = 0
    pool_max: int = 0
    pool_window_s: float = 10.0
    pool_history_s: float = 600.0
    pool_mem_fraction: float = 0.25
    pod_ready_s: float = 0.85  # §6.2: EKS create -> Ready 0.8-0.9 s, image pre-pulled
    pod_api_per_s: float = 70.0  # §6.2: pod scheduling tops out near 70 pods/s
    exec_overhead_s: float = 0.0037  # §6.2: direct path (cgroup write + nsenter + write back)
    pod_exec_overhead_s: float = 0.068  # §6.2: docker exec / SDK exec_run p50 ~68 ms; a pod exec
    # goes through the API server and kubelet as well, so this is a lower bound
    pod_exec_api_qps: float = 50.0  # §6.2 agent-sandbox row: the default client
    # `--kube-api-qps=50`. Every action in a pod is one exec API request (a lower bound: `kubectl exec`
    # also GETs the pod first) from the job's one sandbox-manager client (assumption), FIFO in the same
    # queue as the pod creates above; no burst allowance (assumption). The kube-apiserver itself does not
    # throttle exec (a long-running request, exempt from API Priority and Fairness and from
    # --max-requests-inflight: kubernetes.io "API Priority and Fairness"), so this is a client limit.
    # 0 = no client limit (e.g. a client without a rate limiter): execs then never queue.
    static_gpus: tuple[tuple[str, int], ...] = ()  # per-service override of static GPUs

    @property
    def total_cores(self) -> int:
        return self.cpu_nodes * self.cores_per_node

    @property
    def total_gpus(self) -> int:
        return sum(self.gpu_nodes)

    def with_gpus(self, total: int) -> ClusterSpec:
        """The same cluster with ``total`` GPUs, packed into 8-GPU nodes."""
        sizes = [8] * (total // 8) + ([total % 8] if total % 8 else [])
        return replace(self, gpu_nodes=tuple(sizes))

    def overridden(self, doc: dict[str, Any], where: str) -> ClusterSpec:
        names = {f.name for f in fields(self)}
        kw: dict[str, Any] = {}
        for k, v in doc.items():
            if k not in names:
                raise ConfigError(
                    f"{where}: unknown cluster field {k!r}", hint=f"known fields: {', '.join(sorted(names))}"
                )
            if k == "gpu_nodes":
                v = tuple(int(x) for x in v)
            elif k == "static_gpus":
                v = tuple(sorted((str(a), int(b)) for a, b in dict(v).items()))
            elif isinstance(getattr(self, k), int):
                v = int(v)
            else:
                v = float(v)
            kw[k] = v
        return replace(self, **kw)

    def node_events(self) -> list[ev.NodeJoined]:
        out = []
        per = self.cores_per_node // max(1, self.numa_per_node)
        cpus = tuple(range(self.cores_per_node))
        numa = tuple(cpus[i : i + per] for i in range(0, self.cores_per_node, per))
        for i in range(self.cpu_nodes):
            out.append(
                ev.NodeJoined(f"cpu-{i:02d}", cpus=cpus, numa=numa, mem_mib=int(self.cpu_mem_gib * GIB))
            )
        for i, g in enumerate(self.gpu_nodes):
            out.append(ev.NodeJoined(f"gpu-{i:02d}", gpus=g, gpu_mem_mib=int(self.gpu_mem_gib * GIB)))
        return out

    def restore_s(self, model_gb: float, size: int) -> float:
        return self.restore_t0_s + model_gb / max(1, size) / self.h2d_gb_s


def load_cluster(path: str | Path | None) -> ClusterSpec:
    if path is None:
        return ClusterSpec()
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(
            f"cannot read cluster file {path}: {exc.strerror}", hint="check the --cluster path"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}", hint="fix the cluster file") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of cluster fields", hint="e.g. `cpu_nodes: 4`")
    return ClusterSpec().overridden(doc, str(path))


@dataclass(slots=True)
class Truth:
    """What the cluster knows about an action that the core only estimates."""

    t_ori: float
    elasticity: Elasticity | None
    model_gb: float = 0.0  # CALL: the service's size, for restores
    tokens: int = 0  # LEASE: what the provider counts for the call
    api: str = ""  # LEASE: the API


@dataclass(slots=True)
class Run:
    """One started action, for the metrics."""

    start: float  # when it really began (after sandbox creation / restore wait)
    end: float
    units: int
    resource: str  # cpu | gpu | api
    restore_s: float = 0.0
    alloc: float = 0.0  # when the units were handed over (the start command)
    api_wait: float = 0.0  # k8s: time the exec request waited in the API-server queue


class ClusterModel:
    def __init__(
        self, spec: ClusterSpec, truth: Callable[[str], Truth], model_gb: Callable[[str], float] | None = None
    ) -> None:
        self.spec = spec
        self.truth = truth
        self.model_gb = model_gb  # service -> size, for a Load with no Invoke after it (pre-wake)
        self.providers: dict[str, KeyedProvider] = {}  # API -> its provider, for APIs with keys
        self.error_s = 0.2  # a 429 answer takes one round trip (as RetryPolicy.error_s)
        self.limited: set[str] = set()  # leases whose call got a 429
        self.ready: dict[str, float] = {}  # sandbox -> ready time
        self._create_free: dict[str, float] = {}  # node -> container-create server free at
        self._api_free = 0.0  # the Kubernetes API-server request queue (FIFO): free at
        self.runs: dict[str, Run] = {}
        self.pods: dict[str, tuple[float, int]] = {}  # sandbox -> (ready, cores) of a reservation
        self.restores = 0
        self.prewakes = 0
        self.prewake_gpu_s = 0.0
        self._loading: dict[tuple[str, int], float] = {}  # (node, GPU) -> a pre-wake restore ends at
        self.pools = SimPools(spec) if spec.pool_max > 0 else None

    def apply(self, commands: Sequence[cmd.Command], now: float) -> list[tuple[float, ev.Event]]:
        out: list[tuple[float, ev.Event]] = []
        loaded: set[tuple[str, str, int]] = set()
        called = {(c.node, c.service, c.start) for c in commands if type(c) is cmd.Invoke}
        for c in commands:
            t = type(c)
            if t is cmd.Spawn:
                out.append(self._spawn(c, now))  # type: ignore[arg-type]
            elif t is cmd.Invoke:
                tr = self.truth(c.action_id)
                size = c.end - c.start
                restore = (
                    self.spec.restore_s(tr.model_gb, size) if (c.node, c.service, c.start) in loaded else 0.0
                )
                self.restores += restore > 0
                left = max((self._loading.get((c.node, g), now) for g in range(c.start, c.end)), default=now)
                restore += max(0.0, left - now)  # the rest of a pre-wake restore of these GPUs
                end = now + restore + duration(tr.t_ori, tr.elasticity, size)
                self.runs[c.action_id] = Run(now, end, size, "gpu", restore, now)
                out.append((end, ev.ActionFinished(c.action_id)))
            elif t is cmd.Load:
                loaded.add((c.node, c.service, c.start))
                if (c.node, c.service, c.start) not in called:
                    self._prewake(c, now)
            elif t is cmd.Grant:
                out.extend(self._grant(c, now))
            elif t is cmd.CreateSandbox:
                free = self._create_free.get(c.node, 0.0)
                claimed = self.pools.create(c, now, free) if self.pools is not None else None
                if claimed is not None:
                    self.ready[c.sandbox] = claimed
                    continue
                begin = max(now, self._create_free.get(c.node, 0.0))
                self._create_free[c.node] = begin + 1.0 / self.spec.sandbox_create_per_s
                self.ready[c.sandbox] = begin + self.spec.sandbox_create_s
            elif t is cmd.Reserve:
                begin = self._api_request(now, 1.0 / self.spec.pod_api_per_s)
                self.ready[c.sandbox] = begin + self.spec.pod_ready_s
                self.pods[c.sandbox] = (now, len(c.cores))
            elif t is cmd.Kill:
                r = self.runs.get(c.action_id)
                if r is not None:
                    r.start, r.end = min(r.start, now), now
                out.append((now, ev.ActionFinished(c.action_id, ok=False, reason=c.reason or "killed")))
            elif t is cmd.DestroySandbox:
                self.ready.pop(c.sandbox, None)
                if self.pools is not None:
                    self.pools.destroyed(c.sandbox)
        return out

    def _spawn(self, c: cmd.Spawn, now: float) -> tuple[float, ev.Event]:
        tr = self.truth(c.action_id)
        wait, before = 0.0, self.runs.get(c.after) if c.after else None
        alloc = max(now, before.end) if before is not None else now  # staged: when that one ends
        if c.sandbox in self.pods:
            qps = self.spec.pod_exec_api_qps
            turn = self._api_request(now, 1.0 / qps) if qps > 0 else now
            wait = turn - now
            start = max(turn, self.ready.get(c.sandbox, now)) + self.spec.pod_exec_overhead_s
        else:
            start = max(alloc, self.ready.get(c.sandbox, now)) + self.spec.exec_overhead_s
        end = start + duration(tr.t_ori, tr.elasticity, c.dop)
        self.runs[c.action_id] = Run(start, end, len(c.cores), "cpu", 0.0, alloc, wait)
        return end, ev.ActionFinished(c.action_id)

    def pool_counters(self) -> dict[str, int]:
        """Opens served from a warm pool and cold ones (none without pools)."""
        if self.pools is None:
            return {}
        return {"pool_claims": self.pools.claims, "pool_colds": self.pools.colds}

    def _grant(self, c: cmd.Grant, now: float) -> list[tuple[float, ev.Event]]:
        tr = self.truth(c.action_id)
        provider = self.providers.get(c.api) if c.key else None
        end = now + tr.t_ori
        if provider is not None and not provider.call(c.key, tr.tokens, now, end):
            t = now + self.error_s  # HTTP 429: reported, the lease given back
            self.limited.add(c.action_id)
            reset = provider.reset_s(c.key, now)
            self.runs[c.action_id] = Run(now, t, 1, "api", 0.0, now)
            return [(t, ev.ApiReported(c.action_id, -1, True, reset)),
                    (t, ev.ActionFinished(c.action_id, ok=False, reason="rate limited"))]
        self.runs[c.action_id] = Run(now, end, 1, "api", 0.0, now)
        if provider is None:
            return [(end, ev.ActionFinished(c.action_id))]
        return [(end, ev.ApiReported(c.action_id, tr.tokens)), (end, ev.ActionFinished(c.action_id))]

    def _prewake(self, c: cmd.Load, now: float) -> None:
        """A restore ahead of its call: the GPUs load until it ends."""
        size = c.end - c.start
        gb = self.model_gb(c.service) if self.model_gb is not None else 0.0
        begin = max([now] + [self._loading.get((c.node, g), now) for g in range(c.start, c.end)])
        ready = begin + self.spec.restore_s(gb, size)
        for g in range(c.start, c.end):
            self._loading[(c.node, g)] = ready
        self.prewakes += 1
        self.prewake_gpu_s += size * (ready - begin)

    def _api_request(self, now: float, cost_s: float) -> float:
        """One request through the API-server queue (FIFO; ``now`` never decreases): when
        its turn begins. It holds the queue for ``cost_s``."""
        begin = max(self._api_free, now)
        self._api_free = begin + cost_s
        return begin


class ApiProvider:
    """A third-party API as seen by clients that call it directly (the api-retry baseline):
    over the limit, a call is refused (HTTP 429) instead of queued."""

    def __init__(self, mode: str, limit: int, period_s: float) -> None:
        self.mode, self.limit, self.period_s = mode, limit, period_s
        self.in_flight = 0
        self.window_start: float | None = None
        self.used = 0
        self.refused = 0  # calls answered HTTP 429

    def try_call(self, now: float, tokens: int = 0, end: float | None = None) -> bool:
        if self.mode == "quota":
            if self.window_start is not None and now >= self.window_start + self.period_s:
                self.window_start += int((now - self.window_start) // self.period_s) * self.period_s
                self.used = 0
            if self.used >= self.limit:
                self.refused += 1
                return False
            if self.window_start is None:
                self.window_start = now
            self.used += 1
            return True
        if self.in_flight >= self.limit:
            self.refused += 1
            return False
        self.in_flight += 1
        return True

    def done(self) -> None:
        if self.mode != "quota":
            self.in_flight -= 1


class KeyedProvider:
    """A provider that limits each of an API's keys (issue 14, item 4): requests per minute,
    tokens per minute (on a sliding minute, charged when the call arrives) and calls in
    flight. A call over any limit of its key is refused (HTTP 429); ``refused`` counts them.
    Direct callers (the api-retry baseline) take the keys in turn (``try_call``)."""

    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self.keys = {k.name: k for k in keys}
        self._log: dict[str, deque[tuple[float, int]]] = {k.name: deque() for k in keys}
        self._tokens: dict[str, int] = {k.name: 0 for k in keys}  # in the window
        self._ends: dict[str, list[float]] = {k.name: [] for k in keys}  # calls in flight end at
        self._turn = 0
        self.refused = 0
        self.served: list[tuple[float, int]] = []  # (time, tokens) of every served call

    def _roll(self, key: str, now: float) -> deque[tuple[float, int]]:
        log = self._log[key]
        while log and log[0][0] <= now - WINDOW_S:
            self._tokens[key] -= log.popleft()[1]
        ends = self._ends[key]
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        return log

    def call(self, key: str, tokens: int, now: float, end: float) -> bool:
        """One call with ``key`` from ``now`` to ``end``: served, or refused (429)."""
        k, log = self.keys[key], self._roll(key, now)
        over = (
            (k.rpm > 0 and len(log) + 1 > k.rpm)
            or (k.tpm > 0 and self._tokens[key] + tokens > k.tpm)
            or (k.concurrency > 0 and len(self._ends[key]) >= k.concurrency)
        )
        if over:
            self.refused += 1
            return False
        log.append((now, tokens))
        self._tokens[key] += tokens
        heapq.heappush(self._ends[key], end)
        self.served.append((now, tokens))
        return True

    def reset_s(self, key: str, now: float) -> float:
        """What the 429 says: seconds until the key's oldest call in the window ages out."""
        log = self._roll(key, now)
        return max(0.0, log[0][0] + WINDOW_S - now) if log else 1.0

    def try_call(self, now: float, tokens: int = 0, end: float | None = None) -> bool:
        """A direct call (no lease): the next key in turn."""
        names = sorted(self.keys)
        key = names[self._turn % len(names)]
        self._turn += 1
        return self.call(key, tokens, now, now if end is None else end)

    def done(self) -> None:
        """A direct call ended (its end was given to ``try_call``)."""
