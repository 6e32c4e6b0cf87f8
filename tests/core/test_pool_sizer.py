"""Scenario tests for warm sandbox pool sizing (issue 14, item 1; ``tangram/core/pool.py``): targets
follow the largest recent burst of opens per node and shape, within [min, max] and the node's
unreserved memory; the scheduler's own ``CreateSandbox`` commands drive it as the controller does."""

from __future__ import annotations

from sched_util import exec_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.pool import NodeRoom, PoolPolicy, PoolShape, PoolSizer, peak
from tangram.core.scheduler import CoreConfig, Scheduler

DEFAULT = PoolShape()
BIG = PoolShape("swe:1", 8192)
ROOM = NodeRoom(mem_total_mib=1 << 20, mem_free_mib=1 << 20, default_mem_mib=1024)


def test_peak_counts_the_densest_window() -> None:
    assert peak([], 10.0) == 0
    assert peak([0.0, 1.0, 2.0, 20.0], 10.0) == 3
    assert peak([0.0, 10.0, 20.0], 10.0) == 1  # a window is [t, t + window_s)
    assert peak([0.0, 9.9, 10.0, 10.5, 19.0], 10.0) == 4


def test_a_burst_sizes_its_node_and_shape_only() -> None:
    s = PoolSizer(PoolPolicy(min=1, max=64))
    for i in range(5):
        s.opened("n1", BIG, 100.0 + i * 0.1)
    s.opened("n2", BIG, 100.0)
    assert s.node_targets("n1", 101.0, ROOM) == {BIG: 5, DEFAULT: 1}
    assert s.node_targets("n2", 101.0, ROOM) == {BIG: 1, DEFAULT: 1}
    assert s.node_targets("n3", 101.0, ROOM) == {DEFAULT: 1}  # min: the configured shape only


def test_max_caps_and_min_floors() -> None:
    s = PoolSizer(PoolPolicy(min=2, max=3))
    assert s.node_targets("n1", 0.0, ROOM) == {DEFAULT: 2}
    for _ in range(10):
        s.opened("n1", DEFAULT, 1.0)
    assert s.node_targets("n1", 2.0, ROOM) == {DEFAULT: 3}


def test_bursts_are_forgotten_after_the_history() -> None:
    pol = PoolPolicy(min=0, max=64, window_s=5.0, history_s=60.0)
    s = PoolSizer(pol)
    for i in range(8):
        s.opened("n1", BIG, 10.0 + i)  # 8 opens over 8 s: at most 5 in one 5 s window
    assert s.node_targets("n1", 20.0, ROOM) == {BIG: 5}
    assert s.node_targets("n1", 65.0, ROOM) == {BIG: 5}  # the densest window is still within 60 s
    assert s.node_targets("n1", 75.5, ROOM) == {BIG: 2}  # only the opens at 16.0 and 17.0 are left
    assert s.node_targets("n1", 80.0, ROOM) == {}  # all aged out: the shape has no pool


def test_memory_bounds_pools_and_larger_targets_go_first() -> None:
    s = PoolSizer(PoolPolicy(min=0, max=64, mem_fraction=0.5))
    for _ in range(4):
        s.opened("n1", BIG, 0.0)  # 4 x 8 GiB
    for _ in range(6):
        s.opened("n1", DEFAULT, 0.0)  # 6 x the default 1 GiB
    room = NodeRoom(mem_total_mib=40_000, mem_free_mib=30_000, default_mem_mib=1024)
    # budget = min(0.5 * 40000, 30000) = 20000: DEFAULT (6, larger target) first: 6144; BIG: 13856 // 8192 = 1
    assert s.node_targets("n1", 1.0, room) == {DEFAULT: 6, BIG: 1}
    full = NodeRoom(mem_total_mib=40_000, mem_free_mib=500, default_mem_mib=1024)
    assert s.node_targets("n1", 1.0, full) == {}  # trajectories hold the memory: no pools


def test_off_means_no_pools_and_no_history() -> None:
    s = PoolSizer(PoolPolicy(min=0, max=0))
    s.opened("n1", DEFAULT, 0.0)
    assert s.targets(1.0, {"n1": ROOM}) == {"n1": {}}
    assert not s._opens


def test_policy_problems_name_the_field() -> None:
    assert PoolPolicy().problem() is None
    assert "min" in (PoolPolicy(min=5, max=2).problem() or "")
    assert "window_s" in (PoolPolicy(window_s=0).problem() or "")
    assert "mem_fraction" in (PoolPolicy(mem_fraction=2.0).problem() or "")


def test_node_gone_forgets_its_opens() -> None:
    s = PoolSizer(PoolPolicy(min=0, max=8))
    s.opened("n1", BIG, 0.0)
    s.node_gone("n1")
    assert s.node_targets("n1", 1.0, ROOM) == {}


def test_the_schedulers_creations_size_the_pools_of_the_nodes_they_land_on() -> None:
    """Six trajectories open at once on two equal nodes: placement balances memory, so each node
    creates three sandboxes, and the sizer asks each node for a pool of three of that shape."""
    core = Scheduler(CoreConfig())
    core.handle(node("n1", 8, mem=64_000), 0.0)
    core.handle(node("n2", 8, mem=64_000), 0.0)
    sizer = PoolSizer(PoolPolicy(min=0, max=16))
    for i in range(6):
        core.handle(ev.SandboxOpened(f"sb{i}", "c", 4096, "swe:1"), 0.0)
    creates: list[cmd.CreateSandbox] = []
    for i in range(6):
        out = core.handle(ev.ActionSubmitted(exec_spec(f"a{i}", f"sb{i}", 1, t_ori=1.0)), 0.5)
        creates += [c for c in out if isinstance(c, cmd.CreateSandbox)]
    for c in creates:
        sizer.opened(c.node, PoolShape(c.image, c.mem_mib), 0.5)
    assert sorted(c.node for c in creates) == ["n1"] * 3 + ["n2"] * 3
    shape = PoolShape("swe:1", 4096)
    rooms = {n: NodeRoom(64_000, core.cpu.nodes[n].mem_free) for n in ("n1", "n2")}
    assert sizer.targets(1.0, rooms) == {"n1": {shape: 3}, "n2": {shape: 3}}
