"""Why an action is rejected or waits (the ``Shortfall`` reasons a client sees), and the
read-only views (``snapshot``, ``status_of``): pinned field by field, where the mutation
run of docs/testing.md found only "some reason" or nothing checked."""

from __future__ import annotations

from sched_util import call_spec, exec_spec, lease_spec, node
from test_scheduler import make, open_sb

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.resources import CPU, GPU, MEM, Demand, api_resource
from tangram.core.scheduler import Scheduler
from tangram.core.state import QueueRow
from tangram.core.status import ADMITTED, Code, Shortfall, Status


def submit(s: Scheduler, spec, now: float = 0.0) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(spec), now)


def two_nodes() -> Scheduler:
    s = Scheduler()
    s.handle(node("n1", 4, mem=8_000), 0.0)
    s.handle(node("n2", 2, mem=16_000), 0.0)
    return s


# -- rejected at admission: NO_CAPACITY ---------------------------------------------------------
def test_more_cores_than_any_node_has():
    s = two_nodes()
    open_sb(s, "sb")
    assert submit(s, exec_spec("a", "sb", 5)) == [
        cmd.Reject("a", "NO_CAPACITY", "no node is large enough", (Shortfall(CPU, 5, 4, 4, "largest node"),))
    ]


def test_more_trajectory_memory_than_any_node_has():
    s = two_nodes()
    s.handle(ev.SandboxOpened("fat", client="c", mem_mib=20_000), 0.0)
    assert submit(s, exec_spec("a", "fat", 1)) == [
        cmd.Reject(
            "a",
            "NO_CAPACITY",
            "no node is large enough",
            (Shortfall(MEM, 20_000, 16_000, 16_000, "largest node"),),
        )
    ]


def test_more_cores_than_the_sandboxs_node_has():
    s = two_nodes()
    open_sb(s, "sb")
    assert submit(s, exec_spec("a", "sb", 1))[0] == cmd.CreateSandbox("n2", "sb", 1000)  # most free memory
    s.handle(ev.ActionFinished("a"), 1.0)
    out = submit(s, exec_spec("b", "sb", 3), 2.0)
    assert out == [
        cmd.Reject("b", "NO_CAPACITY", "its sandbox's node is too small", (Shortfall(CPU, 3, 2, 2, "n2"),))
    ]


def test_a_gpu_chunk_no_node_has():
    s = make(cores=1, gpus=2)
    s.handle(ev.ServiceDefined("rm", 10_000, (1, 2, 4), load_s=0.0, t_ori=1.0), 0.0)
    assert submit(s, call_spec("g", "rm", (4,))) == [
        cmd.Reject(
            "g",
            "NO_CAPACITY",
            "no node has 4 GPUs with 10000 MiB each",
            (Shortfall(GPU, 4, 2, 2, "largest node"),),
        )
    ]
    assert submit(s, call_spec("h", "nope", (1,))) == [
        cmd.Reject("h", "NO_CAPACITY", "unknown service 'nope'", (Shortfall(GPU, 1, 2, 2, "largest node"),))
    ]


def test_more_api_units_than_the_limit():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 2), 0.0)
    res = api_resource("search")
    spec = ActionSpec("l", Kind.LEASE, ((res, Demand.fixed(3)),), key=res, api="search", client="c")
    assert submit(s, spec) == [
        cmd.Reject("l", "NO_CAPACITY", "above the API limit", (Shortfall(res, 3, 2, 2, "search"),))
    ]
    assert submit(s, lease_spec("ok", "search")) == [cmd.Grant("ok", "search", 300.0)]


# -- waiting: UNSCHEDULABLE with the shortfall --------------------------------------------------
def _fill(s: Scheduler, node_name: str, cores: int, now: float = 0.0) -> None:
    """Bind a sandbox to ``node_name`` and run a ``cores``-core action there."""
    sb = f"fill-{node_name}-{cores}"
    s.handle(ev.SandboxOpened(sb, client="c", mem_mib=0), now)
    s.handle(ev.SandboxAdopted(sb, node_name), now)
    out = submit(s, exec_spec(sb, sb, cores), now)
    assert [c.node for c in out if isinstance(c, cmd.Spawn)] == [node_name]


def test_a_new_trajectory_waits_with_the_cores_and_memory_it_lacks():
    s = two_nodes()
    _fill(s, "n1", 3)  # n1: 1 core free, 8000 MiB
    _fill(s, "n2", 2)  # n2: no core free, 16000 MiB
    s.handle(ev.SandboxOpened("t1", client="c", mem_mib=1_000), 1.0)
    assert submit(s, exec_spec("a", "t1", 2), 1.0) == []
    message = "no node has the cores and the trajectory's memory free together"
    assert s.status_of("a") == Status(Code.UNSCHEDULABLE, (Shortfall(CPU, 2, 1, 4, "any node"),), message)


def test_a_new_trajectory_lacking_only_memory_names_only_memory():
    s = two_nodes()
    _fill(s, "n1", 3)
    _fill(s, "n2", 2)
    s.handle(ev.ActionFinished("fill-n2-2"), 1.0)  # n2: 2 cores free again
    s.handle(ev.SandboxOpened("t", client="c", mem_mib=16_000), 1.0)
    s.handle(ev.SandboxOpened("u", client="c", mem_mib=16_000), 1.0)
    assert [type(c) for c in submit(s, exec_spec("a", "t", 2), 1.0)] == [cmd.CreateSandbox, cmd.Spawn]
    s.handle(ev.ActionFinished("a"), 2.0)  # n2 keeps t's 16000 MiB; 2 cores free
    assert submit(s, exec_spec("b", "u", 2), 2.0) == []  # cores: 2 of 2 free on n2; memory: 8000 at most
    message = "no node has the cores and the trajectory's memory free together"
    assert s.status_of("b") == Status(
        Code.UNSCHEDULABLE, (Shortfall(MEM, 16_000, 8_000, 16_000, "any node"),), message
    )


def test_a_new_trajectory_lacking_only_cores_names_only_cores():
    s = two_nodes()
    _fill(s, "n1", 3)  # n1: 1 free
    _fill(s, "n2", 2)  # n2: none free
    s.handle(ev.SandboxOpened("t", client="c", mem_mib=16_000), 1.0)  # as much as n2 has free: enough
    assert submit(s, exec_spec("a", "t", 2), 1.0) == []
    message = "no node has the cores and the trajectory's memory free together"
    assert s.status_of("a") == Status(Code.UNSCHEDULABLE, (Shortfall(CPU, 2, 1, 4, "any node"),), message)


# -- views ---------------------------------------------------------------------------------------
def _busy_scheduler() -> Scheduler:
    s = Scheduler()
    s.handle(node("n1", 4, mem=8_000, gpus=2, gpu_mem=40_000), 0.0)
    s.handle(node("g", 0, gpus=1, gpu_mem=40_000), 0.0)  # a GPU-only node
    s.handle(ev.ServiceDefined("rm", 10_000, (4, 1), load_s=2.0, t_ori=1.0), 0.0)
    s.handle(ev.ServiceDefined("aa", 5_000, (1,), load_s=1.0, t_ori=1.0), 0.0)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    s.handle(ev.ApiDefined("pdf", "quota", 3, period_s=10.0), 0.0)
    open_sb(s, "sb", mem=1_000)
    open_sb(s, "sc", mem=2_000)
    submit(s, exec_spec("e1", "sb", 3), 1.0)
    submit(s, exec_spec("e2", "sc", 2, 4), 2.0)  # waits: 1 core free
    submit(s, call_spec("g1", "rm", (1,)), 2.5)  # on "g": the smallest block that holds it
    submit(s, call_spec("g2", "aa", (1,)), 2.6)
    submit(s, lease_spec("l1", "search"), 3.0)
    submit(s, lease_spec("l2", "search"), 4.0)  # waits
    return s


def test_a_snapshot_shows_nodes_services_apis_and_the_queue_in_fcfs_order():
    s = _busy_scheduler()
    s.handle(ev.Tick(), 10.0)
    snap = s.snapshot()
    assert snap.now == 10.0
    g, n1 = snap.nodes  # by name
    assert n1 == {
        "node": "n1",
        "cpus_total": 4,
        "cpus_used": 3,
        "mem_total_mib": 8_000,
        "mem_reserved_mib": 1_000,
        "sandboxes": 1,
        "gpus_total": 2,
        "gpus_busy": 1,
        "gpu_mem_used_mib": [5_000, 0],
        "resident": ["aa@0+1"],
    }
    assert g == {
        "node": "g",
        "cpus_total": 0,
        "cpus_used": 0,
        "mem_total_mib": 0,
        "mem_reserved_mib": 0,
        "sandboxes": 0,
        "gpus_total": 1,
        "gpus_busy": 1,
        "gpu_mem_used_mib": [10_000],
        "resident": ["rm@0+1"],
    }
    assert snap.services == (
        {"service": "aa", "gpu_mem_mib": 5_000, "chunk_sizes": [1], "load_s": 1.0},
        {"service": "rm", "gpu_mem_mib": 10_000, "chunk_sizes": [1, 4], "load_s": 2.0},
    )
    assert snap.apis == (
        {"api": "pdf", "mode": "quota", "limit": 3, "in_flight": 0, "used": 0, "queued": 0, "keys": []},
        {"api": "search", "mode": "concurrency", "limit": 1, "in_flight": 1, "used": 0, "queued": 1,
         "keys": []},
    )
    e2, l2 = snap.queue
    assert e2 == QueueRow("e2", "cpu", "exec", "c", 8.0, "cpu=2..4", str(s.status_of("e2")))
    assert l2 == QueueRow("l2", "api:search", "lease", "c", 6.0, "api:search=1", str(s.status_of("l2")))
    assert "requested 2, free 1 of 4" in e2.status and "requested 1, free 0 of 1" in l2.status
    assert (snap.queued, snap.running) == (2, 4)
    assert snap.counters == (("loads", 2), ("started", 3), ("submitted", 6))
    head = s.snapshot(limit=1)
    assert head.queue == (e2,) and head.queued == 2
    assert s.snapshot(limit=0).queue == () and s.snapshot(limit=-1).queue == ()


def test_a_queued_action_that_no_pass_has_read_shows_pending():
    s = make(cores=1)
    open_sb(s, "a")
    open_sb(s, "b")
    submit(s, exec_spec("x", "a", 1))
    s.handle(ev.ActionSubmitted(exec_spec("y", "b", 1)), 1.0, decide=False)
    assert s.status_of("y") is ADMITTED and s.status_of("x") is ADMITTED and s.status_of("zz") is None
    (row,) = s.snapshot().queue
    assert row.status == "pending"


def test_a_service_evicted_by_its_node_is_forgotten_unless_a_call_uses_it():
    s = make(cores=1, gpus=2)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=1.0, t_ori=1.0), 0.0)
    submit(s, call_spec("a", "rm"))  # rm on GPU 0, in use
    submit(s, call_spec("b", "rm"))  # rm on GPU 1, in use
    s.handle(ev.ActionFinished("b"), 2.0)
    s.handle(ev.ServiceEvicted("n1", "rm", 0), 3.0)  # in use: kept
    s.handle(ev.ServiceEvicted("n1", "rm", 1), 3.0)
    s.handle(ev.ServiceEvicted("nope", "rm", 1), 3.0)  # unknown node: nothing
    gnode = s.gpu.nodes["n1"]
    assert sorted(gnode.resident) == [("rm", 0, 1)] and gnode.used_mem == [10_000, 0]


def test_quota_spent_before_a_restart_is_restored():
    s = make(cores=1)
    s.handle(ev.ApiDefined("pdf", "quota", 3, period_s=10.0), 0.0)
    s.handle(ev.ApiUsed("pdf", used=2, window_age_s=4.0), 100.0)  # a window that began at 96
    s.handle(ev.ApiUsed("nope", used=2, window_age_s=4.0), 100.0)  # unknown API: nothing
    assert submit(s, lease_spec("l1", "pdf"), 100.0) == [cmd.Grant("l1", "pdf", 400.0)]
    assert submit(s, lease_spec("l2", "pdf"), 100.0) == []  # 3 of 3 used
    assert s.next_deadline() == 106.0
