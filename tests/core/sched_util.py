"""Helpers shared by the scheduler tests: tiny spec builders and an invariant checker."""
from __future__ import annotations

from collections.abc import Sequence

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.approx import Behind, Timeline
from tangram.core.resources import CPU, GPU, Demand, api_resource
from tangram.core.scheduler import Scheduler


def approx_acts(cand_total: float, cand_plan: Sequence[tuple[int, float]],
                running: Sequence[tuple[float, int]], behind: Sequence[Behind], capacity_free: int,
                depth: int = 2) -> float:
    """ApproxACTs of one plan (``Timeline.objective`` over ``running``'s (time left, units))."""
    return Timeline(running).objective(cand_total, cand_plan, behind, capacity_free, depth)


def exec_spec(aid: str, sandbox: str, lo: int, hi: int | None = None, t_ori: float | None = None,
              serial: float | None = None, timeout_s: float = 0.0, action_type: str = "") -> ActionSpec:
    hi = lo if hi is None else hi
    el = Elasticity.amdahl(serial) if serial is not None else None
    return ActionSpec(aid, Kind.EXEC, ((CPU, Demand.range(lo, hi)),), sandbox=sandbox, t_ori=t_ori,
                      elasticity=el, timeout_s=timeout_s, action_type=action_type, client="c")


def call_spec(aid: str, service: str, sizes: tuple[int, ...] = (1,), serial: float | None = None) -> ActionSpec:
    el = Elasticity.amdahl(serial) if serial is not None else None
    return ActionSpec(aid, Kind.CALL, ((GPU, Demand.of(list(sizes))),), key=GPU, service=service, elasticity=el,
                      client="c")


def lease_spec(aid: str, api: str, timeout_s: float = 0.0) -> ActionSpec:
    res = api_resource(api)
    return ActionSpec(aid, Kind.LEASE, ((res, Demand.fixed(1)),), key=res, api=api, timeout_s=timeout_s, client="c")


def node(name: str, cores: int, mem: int = 64_000, gpus: int = 0, gpu_mem: int = 80_000, numa: int = 1) -> ev.NodeJoined:
    cpus = tuple(range(cores))
    per = max(1, cores // numa)
    domains = tuple(cpus[i:i + per] for i in range(0, cores, per))
    return ev.NodeJoined(name, cpus=cpus, numa=domains, mem_mib=mem, gpus=gpus, gpu_mem_mib=gpu_mem)


class Ledger:
    """Follows the commands of one scheduler and checks that nothing is over-committed."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.cores: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.chunks: dict[str, tuple[str, int, int]] = {}
        self.leases: dict[str, str] = {}
        self.started: set[str] = set()
        self.rejected: dict[str, str] = {}
        self.done: set[str] = set()
        self.reserved_execs: set[str] = set()

    def apply(self, out: list[cmd.Command]) -> None:
        for c in out:
            if isinstance(c, cmd.Spawn):
                self.started.add(c.action_id)
                sb = self.sched.sandboxes.get(c.sandbox)
                if sb is not None and sb.reserve:
                    self.reserved_execs.add(c.action_id)
                else:
                    self.cores[c.action_id] = (c.node, c.cores)
            elif isinstance(c, cmd.Reserve):
                self.started.add(c.action_id)
                self.cores[c.action_id] = (c.node, c.cores)
            elif isinstance(c, cmd.Invoke):
                self.started.add(c.action_id)
                self.chunks[c.action_id] = (c.node, c.start, c.end)
            elif isinstance(c, cmd.Grant):
                self.started.add(c.action_id)
                self.leases[c.action_id] = c.api
            elif isinstance(c, cmd.Done):
                self.done.add(c.action_id)
                self.cores.pop(c.action_id, None)
                self.chunks.pop(c.action_id, None)
                self.leases.pop(c.action_id, None)
                self.reserved_execs.discard(c.action_id)
            elif isinstance(c, cmd.Reject):
                self.rejected.setdefault(c.action_id, c.code)
        self.check()

    def check(self) -> None:
        seen: dict[tuple[str, int], str] = {}
        for aid, (n, cores) in self.cores.items():
            for core in cores:
                assert (n, core) not in seen, f"core {core} on {n} given to {seen[(n, core)]} and {aid}"
                seen[(n, core)] = aid
                cpu_node = self.sched.cpu.nodes.get(n)
                if cpu_node is not None:
                    assert cpu_node.all_mask >> core & 1, f"core {core} is not on {n}"
        gpus: dict[tuple[str, int], str] = {}
        for aid, (n, a, b) in self.chunks.items():
            size = b - a
            assert size & (size - 1) == 0 and a % size == 0, f"chunk [{a},{b}) is not aligned"
            for g in range(a, b):
                assert (n, g) not in gpus, f"GPU {g} on {n} given to {gpus[(n, g)]} and {aid}"
                gpus[(n, g)] = aid
        for name, gnode in self.sched.gpu.nodes.items():
            assert all(m <= gnode.mem_mib for m in gnode.used_mem), f"GPU memory over budget on {name}"
        for name, api in self.sched.basic.apis.items():
            held = sum(1 for a in self.leases.values() if a == name)
            if api.mode == "concurrency":
                assert held <= api.limit, f"API {name}: {held} leases over limit {api.limit}"
