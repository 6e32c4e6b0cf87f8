"""Parity guard (docs/architecture.md, "The path of one action"): one trace through the simulator and
through the controller's
driver gives equal journal records.

The trace is a fixed list of (virtual time, event) inputs from nodes and clients: nodes
joining (one late), a GPU service and two APIs defined, sandboxes opened and closed, exec,
call and lease submissions, a cancel, and timeouts and a quota window so that ``Tick``s do
work. What the nodes report back (``ActionFinished``) is not in the trace: on both sides
``tangram.sim.cluster.ClusterModel`` turns the core's start commands into finish events at
the same virtual times, from the same per-action truths.

(a) Simulator: ``tangram.sim.engine.Engine.run`` on an empty workload (no trajectories, no
    nodes from the cluster spec) with the trace pushed onto its heap and its cluster model
    given the trace's truths.
(b) Controller: ``tangram_cli.controller.driver.Driver.run`` -- the real loop (next event
    or deadline -> ``Tick`` -> core.handle -> journal -> dispatch) -- on an asyncio loop
    whose time is a ``VirtualClock``: instead of sleeping, the loop jumps the clock to its
    next timer. An in-process stand-in for agents and clients posts the trace's events and
    the cluster model's finish events with ``Driver.post`` at their virtual times (no
    sockets), the way ``AgentLink`` and ``Gateway`` do in the daemon.

A perturbed run (one client event delivered out of order) must make ``journal.diff``
non-empty, so the guard can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import selectors
from collections.abc import Callable
from typing import Any

from tangram import journal as jr
from tangram.clock import VirtualClock
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.resources import CPU, GPU, Demand, api_resource
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterModel, ClusterSpec, Truth
from tangram.sim.engine import EVENT, Engine
from tangram.sim.workloads import Workload
from tangram_cli.controller import driver as driver_module
from tangram_cli.controller.config import ControllerConfig
from tangram_cli.controller.daemon import Options
from tangram_cli.controller.driver import Driver

GIB = 1024
SEED = Options().seed
# No nodes from the spec (the trace brings them); the timing fields are the defaults.
SPEC = ClusterSpec(cpu_nodes=0, gpu_nodes=())

MAX_EVENTS = 10_000  # the driver side stops after this many events, so a livelock fails fast
Trace = list[tuple[float, ev.Event]]


# ------------------------------------------------------------------ the trace
def _exec(aid: str, sandbox: str, lo: int, hi: int, t_ori: float, timeout_s: float = 0.0) -> ActionSpec:
    return ActionSpec(
        aid,
        Kind.EXEC,
        ((CPU, Demand.range(lo, hi)),),
        CPU,
        "tool",
        sandbox,
        "task",
        "c1",
        sandbox,
        elasticity=Elasticity.amdahl(0.1),
        t_ori=t_ori,
        timeout_s=timeout_s,
    )


def _call(aid: str, service: str, sizes: tuple[int, ...], t_ori: float) -> ActionSpec:
    return ActionSpec(
        aid,
        Kind.CALL,
        ((GPU, Demand.of(sizes)),),
        GPU,
        "judge",
        "",
        "task",
        "c1",
        service=service,
        elasticity=Elasticity.amdahl(0.2),
        t_ori=t_ori,
    )


def _lease(aid: str, api: str, timeout_s: float) -> ActionSpec:
    res = api_resource(api)
    return ActionSpec(
        aid,
        Kind.LEASE,
        ((res, Demand.fixed(1)),),
        res,
        "search",
        "",
        "task",
        "c1",
        api=api,
        timeout_s=timeout_s,
    )


def _trace() -> tuple[Trace, dict[str, Truth]]:
    """(time, event) inputs in delivery order, and what the cluster knows about each action.

    Every deadline the core ever reports is still live when it comes (a lease outlives its
    TTL, a timeout fires, a lease with the default TTL ends while an earlier deadline is
    pending): the simulator ticks at every deadline it was ever told, the driver only at
    the current one (see ``test_stale_deadline``)."""
    cpus = tuple(range(8))
    trace: Trace = [
        (0.0, ev.NodeJoined("cpu-a", cpus=cpus, numa=(cpus[:4], cpus[4:]), mem_mib=64 * GIB)),
        (0.0, ev.NodeJoined("gpu-a", gpus=2, gpu_mem_mib=80 * GIB)),
        (0.0, ev.ServiceDefined("judge", 30 * GIB, (1, 2), 0.6, 2.0)),
        (0.0, ev.ApiDefined("search", "concurrency", 1, 60.0)),
        (0.0, ev.ApiDefined("quota", "quota", 1, 4.0)),
        (0.0, ev.ApiDefined("kv", "concurrency", 4, 60.0)),
        (0.5, ev.SandboxOpened("sb1", "c1", 2 * GIB, "img", 0, "task")),
        (0.75, ev.SandboxOpened("sb2", "c1", 2 * GIB, "img", 0, "task")),
        (1.0, ev.ActionSubmitted(_exec("x1", "sb1", 1, 4, 4.0))),
        (1.25, ev.ActionSubmitted(_exec("x2", "sb2", 2, 8, 6.0))),
        (1.5, ev.ActionSubmitted(_call("g1", "judge", (1, 2), 2.0))),
        (1.75, ev.ActionSubmitted(_exec("x3", "sb1", 4, 4, 9.0, timeout_s=3.0))),  # killed at its deadline
        (2.0, ev.ActionSubmitted(_lease("l1", "search", 1.5))),  # held 3 s: expires
        (2.125, ev.ActionSubmitted(_lease("l2", "search", 3.0))),  # granted when l1 expires; expires
        (2.25, ev.ActionSubmitted(_call("g2", "judge", (2,), 1.5))),
        (2.375, ev.ActionSubmitted(_lease("k1", "kv", 0.0))),  # default TTL, released at once
        (2.5, ev.ActionSubmitted(_lease("q1", "quota", 2.0))),  # opens the quota window; expires
        (2.625, ev.ActionSubmitted(_lease("q2", "quota", 6.0))),  # granted at the next window (Tick)
        (2.75, ev.ActionSubmitted(_exec("x4", "sb2", 8, 8, 5.0, timeout_s=1.0))),  # times out queued
        (3.0, ev.ActionSubmitted(_exec("x5", "sb2", 2, 6, 20.0))),
        (3.375, ev.NodeJoined("cpu-b", cpus=cpus, numa=(cpus[:4], cpus[4:]), mem_mib=64 * GIB)),
        (4.375, ev.ActionCancelled("x5", "client cancelled")),
        (5.5, ev.ActionSubmitted(_call("g3", "judge", (1,), 1.0))),
        (6.0, ev.ActionSubmitted(_exec("x6", "sb1", 1, 8, 3.0))),
        (6.0, ev.ActionSubmitted(_exec("x7", "sb2", 1, 8, 3.0))),  # one batch with x6: decided together
        (14.0, ev.SandboxClosed("sb2")),
        (15.0, ev.SandboxClosed("sb1")),
    ]
    truths = {
        "x1": Truth(4.2, Elasticity.amdahl(0.1)),
        "x2": Truth(5.7, Elasticity.amdahl(0.1)),
        "x3": Truth(9.0, Elasticity.amdahl(0.1)),
        "x4": Truth(5.0, Elasticity.amdahl(0.1)),
        "x5": Truth(20.0, Elasticity.amdahl(0.1)),
        "x6": Truth(3.3, Elasticity.amdahl(0.1)),
        "x7": Truth(2.9, Elasticity.amdahl(0.1)),
        "g1": Truth(2.1, Elasticity.amdahl(0.2), 24.0),
        "g2": Truth(1.4, Elasticity.amdahl(0.2), 24.0),
        "g3": Truth(0.9, Elasticity.amdahl(0.2), 24.0),
        "l1": Truth(3.0, None),
        "l2": Truth(4.0, None),
        "k1": Truth(0.5, None),
        "q1": Truth(2.3, None),
        "q2": Truth(7.0, None),
    }
    return trace, truths


# ------------------------------------------------------------------ (a) the simulator
def simulate(trace: Trace, truths: dict[str, Truth]) -> list[dict[str, Any]]:
    journal = jr.Journal(driver="sim")
    engine = Engine(
        Workload("parity"), parse_policy("tangram"), spec=SPEC, batch=0, seed=SEED, journal=journal
    )
    engine.cluster = ClusterModel(SPEC, truths.__getitem__)
    for t, e in trace:
        engine.push(t, EVENT, e)
    engine.run()
    return jr.read(journal.lines)[1]


# ------------------------------------------------------------------ (b) the controller driver
class _Delay(float):
    """A delay from ``VirtualClock.until``: it remembers its deadline, because
    ``now + (deadline - now)`` can miss ``deadline`` by one ulp and a ``Tick`` a hair early
    changes nothing in the core (and then repeats)."""

    deadline: float


class _Clock(VirtualClock):
    def until(self, deadline: float | None) -> float | None:
        delay = super().until(deadline)
        if delay is None or deadline is None:
            return delay
        out = _Delay(delay)
        out.deadline = max(deadline, self.now())
        return out


class _JumpSelector(selectors.DefaultSelector):
    """Never blocks: where the loop would sleep, the virtual clock jumps to the next timer;
    where it would sleep forever, the run is over (``loop.quiet``)."""

    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        when = self.loop.next_timer()
        if when is None:
            if not self.loop.quiet.done():
                self.loop.quiet.set_result(None)
        else:
            self.loop.clock.advance_to(max(when, self.loop.clock.now()))
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._n = 0
        selector = _JumpSelector()
        selector.loop = self
        super().__init__(selector)
        self.quiet: asyncio.Future[None] = self.create_future()

    def time(self) -> float:
        return self.clock.now()

    def call_later(
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        when = delay.deadline if isinstance(delay, _Delay) else self.time() + delay
        return self.call_at(when, callback, *args, context=context)

    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        handle = super().call_at(when, callback, *args, context=context)
        self._n += 1
        heapq.heappush(self._timers, (when, self._n, handle))
        return handle

    def next_timer(self) -> float | None:
        while self._timers and self._timers[0][2].cancelled():
            heapq.heappop(self._timers)
        while self._timers and self._timers[0][0] <= self.clock.now():
            heapq.heappop(self._timers)  # due: already handed to the ready queue
        return self._timers[0][0] if self._timers else None


class World:
    """The in-process stand-in for agents and clients: posts trace events at their times,
    and turns the driver's start commands into finish events through the cluster model.
    Ties at one instant keep insertion order, as in the simulator's heap."""

    def __init__(self, loop: VirtualTimeLoop, cluster: ClusterModel) -> None:
        self.loop, self.cluster = loop, cluster
        self.driver: Driver | None = None
        self._heap: list[tuple[float, int, ev.Event]] = []
        self._n = 0

    def push(self, t: float, event: ev.Event) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, event))
        self.loop.call_at(t, self._deliver)

    def _deliver(self) -> None:
        now = self.loop.clock.now()
        while self._heap and self._heap[0][0] <= now:
            assert self.driver is not None
            self.driver.post(heapq.heappop(self._heap)[2])

    def dispatch(self, event: ev.Event, commands: list[Any]) -> None:
        for t, finished in self.cluster.apply(commands, self.loop.clock.now()):
            self.push(t, finished)
        if self.driver is not None and self.driver.handled >= MAX_EVENTS and not self.loop.quiet.done():
            self.loop.quiet.set_result(None)  # a driver that livelocks (e.g. ticks early) ends here


def drive(trace: Trace, truths: dict[str, Truth]) -> list[dict[str, Any]]:
    clock = _Clock()
    loop = VirtualTimeLoop(clock)
    world = World(loop, ClusterModel(SPEC, truths.__getitem__))
    journal = jr.Journal(driver="controller")
    core = Scheduler(CoreConfig(depth=ControllerConfig().depth), seed=SEED)  # as Controller builds it
    world.driver = Driver(core, clock, journal, world.dispatch)
    for t, e in trace:
        world.push(t, e)

    async def main() -> None:
        task = asyncio.ensure_future(world.driver.run())
        await loop.quiet
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return jr.read(journal.lines)[1]


# ------------------------------------------------------------------ the guard
def _show(d: jr.Difference | None) -> str:
    return "" if d is None else f"record {d.index}:\n  sim:    {d.a}\n  driver: {d.b}"


def test_same_core_config() -> None:
    assert parse_policy("tangram").core == CoreConfig(depth=ControllerConfig().depth)


def test_parity() -> None:
    trace, truths = _trace()
    sim = simulate(trace, truths)
    live = drive(trace, truths)
    d = jr.diff(sim, live)
    assert d is None, _show(d)
    # the trace exercises what it claims to
    kinds = [r["event"]["type"] for r in sim]
    commands = {c["type"] for r in sim for c in r["commands"]}
    assert kinds.count("Tick") >= 3
    assert kinds.count("ActionFinished") >= 8
    assert {
        "CreateSandbox",
        "Spawn",
        "Load",
        "Invoke",
        "Grant",
        "Kill",
        "Reject",
        "Done",
        "DestroySandbox",
    } <= commands, commands
    assert any(c["type"] == "Reject" and c.get("code") == "TIMEOUT" for r in sim for c in r["commands"])


def test_perturbed_driver_differs() -> None:
    trace, truths = _trace()
    sim = simulate(trace, truths)
    # one client event out of order: the driver sees g2's submission before l2's
    i = next(
        k for k, (_, e) in enumerate(trace) if isinstance(e, ev.ActionSubmitted) and e.spec.action_id == "l2"
    )
    swapped = list(trace)
    (t1, e1), (t2, e2) = swapped[i], swapped[i + 1]
    swapped[i], swapped[i + 1] = (t1, e2), (t2, e1)
    d = jr.diff(sim, drive(swapped, truths))
    assert d is not None
    assert d.a is not None
    assert d.a["event"]["spec"]["action_id"] == "l2"


def test_unbatched_driver_differs(monkeypatch: Any) -> None:
    """x6 and x7 arrive at one instant: one decision, journaled with x7, the batch's last event
    (the core weighs both; here ApproxACTs gives x6 the whole node and x7 waits). A driver that
    decided after each event would journal x6's start with x6: the guard sees the difference."""
    trace, truths = _trace()
    sim = simulate(trace, truths)
    x6 = next(r for r in sim if r["event"].get("spec", {}).get("action_id") == "x6")
    x7 = next(r for r in sim if r["event"].get("spec", {}).get("action_id") == "x7")
    assert x6["commands"] == []  # applied only: its decision came with x7's
    started = {c["action_id"] for c in x7["commands"] if c["type"] == "Spawn"}
    assert "x6" in started
    monkeypatch.setattr(driver_module, "BATCH_MAX", 1)
    d = jr.diff(sim, drive(trace, truths))
    assert d is not None
    assert d.a is not None and d.a["event"]["spec"]["action_id"] == "x6"


def test_stale_deadline() -> None:
    """A deadline that went away (the action finished first) makes no Tick on either side."""
    cpus = tuple(range(4))
    trace: Trace = [
        (0.0, ev.NodeJoined("cpu-a", cpus=cpus, numa=(cpus,), mem_mib=8 * GIB)),
        (0.5, ev.SandboxOpened("sb1", "c1", GIB, "img", 0, "task")),
        (1.0, ev.ActionSubmitted(_exec("x1", "sb1", 1, 4, 2.0, timeout_s=10.0))),  # done at ~2
        (20.0, ev.SandboxClosed("sb1")),
    ]
    truths = {"x1": Truth(2.0, Elasticity.amdahl(0.1))}
    d = jr.diff(simulate(trace, truths), drive(trace, truths))
    assert d is None, _show(d)
