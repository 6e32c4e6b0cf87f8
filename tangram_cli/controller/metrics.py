"""What the controller measures per action, for its Prometheus endpoint (metrics_http.py).

`Metrics.on_commands(commands, now)` sees every batch of the core's commands as the controller
dispatches it (daemon.py, driver task only), before the gateway answers and forgets the actions:

- a start (`Spawn` exec, `Invoke` call, `Grant` lease, `Reserve` reserved sandbox): its queue wait
  (start minus submission) and the units granted (cores, GPUs, API units; an exec in a reserved
  sandbox runs on the reservation's cores, which count once, for the sandbox);
- an end (`Done`, or `Reject` of an action that never ended otherwise): its outcome, the agent's
  run time and the overhead around it (exec, call; a lease's run time is the time it was held),
  and the resource-seconds it held (units times the time from its start to its end, as the
  controller saw them) by client, by API and by GPU service;
- `Load` and `Evict`: GPU restores and evictions by service.

The hot path is plain Python: ints and floats in dicts, histogram buckets in lists (`Hist`), no
locks (one task writes; scrapes read on the same event loop) and no prometheus-client object.
Labels stay bounded: kinds, outcomes and resources are fixed sets, services and APIs come from
the configuration, and clients are named by their owner (the CURVE key's name, else the name the
client gave): the first `max_clients` names keep their own label, every later one is counted
under "other" (a label never moves, so every series only grows).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from tangram.core import commands as cmd
from tangram.outcomes import ExecOutcome
from tangram_cli.controller.state import ActionRecord

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIME_BUCKETS += (300.0, 900.0, 3600.0)
UNIT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # ints: the values are ints (int-float compares cost)
KINDS = ("exec", "call", "lease", "open")
RESOURCES = ("cpu", "gpu", "api")
OUTCOMES = ("ok", "error", "cancelled", "timeout", "rejected")
OTHER = "other"
UNNAMED = "unnamed"
MAX_NAME = 64


class Hist:
    """A histogram's buckets (Prometheus ``le`` semantics: a value counts in the first bucket whose
    bound it does not exceed; the last bucket is +Inf)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """[(le, cumulative count), ...] ending with ("+Inf", count), as exposition wants."""
        out, seen = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(seen)))
        return out


class ClientLabels:
    """Unit-seconds by client label: its owner's name; the first ``cap`` names keep theirs, later
    ones share "other". Found by the core's client key, cached from the action's start (a client
    that left by its end is gone from the gateway)."""

    def __init__(self, cap: int, name_of: Callable[[bytes], str]) -> None:
        self.cap = cap
        self.name_of = name_of
        self.seconds: dict[str, dict[str, float]] = {}  # label -> resource -> unit-seconds
        self.by_key: dict[str, dict[str, float]] = {}  # the core's client key -> its label's row

    def usage(self, rec: ActionRecord) -> dict[str, float]:
        """The row of ``rec``'s client: ``{"cpu": core-s, "gpu": GPU-s, "api": unit-s}``."""
        row = self.by_key.get(rec.client)
        if row is None:
            row = self._row((self.name_of(rec.ident) or UNNAMED)[:MAX_NAME])
            if len(self.by_key) >= 65536:  # sessions come and go; the names stay assigned
                self.by_key.clear()
            self.by_key[rec.client] = row
        return row

    def _row(self, name: str) -> dict[str, float]:
        if name not in self.seconds and len(self.seconds) >= self.cap:
            name = OTHER
        row = self.seconds.get(name)
        if row is None:
            row = self.seconds[name] = dict.fromkeys(RESOURCES, 0.0)
        return row


class Metrics:
    """The per-action numbers; read by `metrics_http.MetricsCollector` at scrape time."""

    def __init__(
        self, actions: dict[str, ActionRecord], name_of: Callable[[bytes], str], max_clients: int = 20
    ) -> None:
        self.actions = actions  # Registry.actions: the live records, read here, never changed
        self.labels = ClientLabels(max_clients, name_of)
        self.wait = {k: Hist(TIME_BUCKETS) for k in KINDS}
        self.run = {k: Hist(TIME_BUCKETS) for k in KINDS if k != "open"}
        self.overhead = {k: Hist(TIME_BUCKETS) for k in ("exec", "call")}
        self.units = {r: Hist(UNIT_BUCKETS) for r in RESOURCES}
        self.finished = {k: dict.fromkeys(OUTCOMES, 0) for k in KINDS}  # kind -> outcome -> actions
        self.api_seconds: dict[str, float] = {}  # API -> unit-seconds of its leases
        self.service_seconds: dict[str, float] = {}  # GPU service -> GPU-seconds of its calls
        self.restores: dict[str, int] = {}  # service -> Load commands
        self.evictions: dict[str, int] = {}  # service -> Evict commands
        self.leases: dict[str, str] = {}  # granted lease -> its API, until it ends
        self.reserved: dict[str, tuple[float, int]] = {}  # reserved sandbox's open action -> (start, cores)
        self.reserved_sandboxes: set[str] = set()  # their execs run on the reservation's cores: not again
        self._ended: set[str] = set()  # actions ended in the batch being read (a Done, then a Reject)
        self._on: dict[type, Callable[[Any, float], None]] = {
            cmd.Spawn: self._spawn,
            cmd.Invoke: self._invoke,
            cmd.Grant: self._grant,
            cmd.Reserve: self._reserve,
            cmd.Load: self._load,
            cmd.Evict: self._evict,
            cmd.Done: self._done,
            cmd.Reject: self._reject,
        }

    def on_commands(self, commands: Iterable[cmd.Command], now: float) -> None:
        on = self._on
        for c in commands:
            handler = on.get(type(c))
            if handler is not None:
                handler(c, now)
        if self._ended:
            self._ended.clear()

    # ------------------------------------------------------------ starts
    def _started(self, rec: ActionRecord, kind: str, now: float, resource: str | None, units: float) -> None:
        """A start: its queue wait, the units it was granted (``resource`` None: counted already,
        for its reserved sandbox) and its client's row. The hottest path (every exec's and call's
        start) updates the `Hist` buckets inline: the same two lines as `Hist.observe`, without a
        method call each."""
        h, wait = self.wait[kind], now - rec.submitted
        h.counts[bisect_left(h.bounds, wait)] += 1
        h.total += wait
        if resource is not None:
            h = self.units[resource]
            h.counts[bisect_left(h.bounds, units)] += 1
            h.total += units
        self.labels.usage(rec)

    def _spawn(self, c: cmd.Spawn, now: float) -> None:
        rec = self.actions.get(c.action_id)
        if rec is not None:
            reserved = c.sandbox in self.reserved_sandboxes
            self._started(rec, "exec", now, None if reserved else "cpu", len(c.cores))

    def _invoke(self, c: cmd.Invoke, now: float) -> None:
        rec = self.actions.get(c.action_id)
        if rec is not None:
            self._started(rec, "call", now, "gpu", c.end - c.start)

    def _grant(self, c: cmd.Grant, now: float) -> None:
        rec = self.actions.get(c.action_id)
        if rec is not None and not rec.final_sent:
            self._started(rec, "lease", now, "api", rec.units)
            self.leases[c.action_id] = c.api

    def _reserve(self, c: cmd.Reserve, now: float) -> None:
        rec = self.actions.get(c.action_id)
        if rec is not None and not rec.final_sent:
            self._started(rec, "open", now, "cpu", len(c.cores))
            self.reserved[c.action_id] = (now, len(c.cores))
            self.reserved_sandboxes.add(c.sandbox)

    def _load(self, c: cmd.Load, now: float) -> None:
        self.restores[c.service] = self.restores.get(c.service, 0) + 1

    def _evict(self, c: cmd.Evict, now: float) -> None:
        self.evictions[c.service] = self.evictions.get(c.service, 0) + 1

    # ------------------------------------------------------------ ends
    def _done(self, c: cmd.Done, now: float) -> None:
        rec = self.actions.get(c.action_id)
        if rec is None:
            return
        self._ended.add(c.action_id)
        kind = rec.kind
        if kind == "exec" or kind == "call":
            out = rec.outcome
            res = out.result if out is not None and out.error is None else None
            ok = res is not None and not rec.kill_reason and not (kind == "exec" and res.timed_out)
            self.finished[kind]["ok" if ok else _outcome(rec, res)] += 1
            if rec.started is not None:
                self._held(rec, kind, now - rec.started, res)
        else:
            self.finished[kind][
                "ok" if c.ok else "timeout" if c.reason == "lease expired" else "cancelled"
            ] += 1
            self._held_other(rec, now)

    def _reject(self, c: cmd.Reject, now: float) -> None:
        if c.action_id in self._ended:  # its Done was counted (a lost node, an expired lease)
            return
        rec = self.actions.get(c.action_id)
        if rec is None:
            return
        started = rec.started is not None or c.action_id in self.reserved
        outcome = "rejected" if not started else "timeout" if c.code == "TIMEOUT" else "error"
        self.finished[rec.kind][outcome] += 1
        if rec.kind == "exec" or rec.kind == "call":
            if rec.started is not None:
                self._held(rec, rec.kind, now - rec.started, None)
        else:
            self._held_other(rec, now)

    def _held(self, rec: ActionRecord, kind: str, held: float, res: Any) -> None:
        """An exec's or call's run time, overhead and unit-seconds (``res``: the agent's outcome)."""
        if res is not None:
            h, run = self.run[kind], res.run_s
            h.counts[bisect_left(h.bounds, run)] += 1
            h.total += run
            h, over = self.overhead[kind], (held - run if held > run else 0.0)
            h.counts[bisect_left(h.bounds, over)] += 1
            h.total += over
        usage = self.labels.by_key.get(rec.client) or self.labels.usage(rec)
        if kind == "exec":
            if rec.sandbox not in self.reserved_sandboxes:
                usage["cpu"] += len(rec.cores) * held
        else:
            gpu_s = len(rec.gpus) * held
            usage["gpu"] += gpu_s
            self.service_seconds[rec.service] = self.service_seconds.get(rec.service, 0.0) + gpu_s

    def _held_other(self, rec: ActionRecord, now: float) -> None:
        """A lease's time held and unit-seconds; a reserved sandbox's core-seconds."""
        if rec.kind == "lease":
            api = self.leases.pop(rec.action_id, None)
            if api is None or rec.started is None:
                return
            held = now - rec.started
            self.run["lease"].observe(held)
            self.labels.usage(rec)["api"] += rec.units * held
            self.api_seconds[api] = self.api_seconds.get(api, 0.0) + rec.units * held
        else:
            start = self.reserved.pop(rec.action_id, None)
            self.reserved_sandboxes.discard(rec.sandbox)
            if start is not None:
                self.labels.usage(rec)["cpu"] += start[1] * (now - start[0])


def _outcome(rec: ActionRecord, res: Any) -> str:
    """An exec's or call's end as the client's final reply will say it (answers.py): ok, error,
    cancelled (killed for another reason than its timeout) or timeout."""
    if rec.kill_reason and not (isinstance(res, ExecOutcome) and not res.killed and not res.timed_out):
        return "timeout" if rec.kill_reason == "timeout" else "cancelled"
    if res is None:
        return "error"
    return "timeout" if isinstance(res, ExecOutcome) and res.timed_out else "ok"
