"""Many RL jobs in the core (tangram/core/jobs.py): fair order, weighted shares, caps, views.

Each scenario is events in, commands out; a `Ledger` checks after every event that no core,
GPU or lease is given twice."""

from __future__ import annotations

from random import Random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_util import Ledger, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.jobs import Fair, JobBook, JobSpec
from tangram.core.resources import CPU, GPU, Demand, api_resource
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.status import Code


def _exec(
    aid: str,
    client: str,
    lo: int = 1,
    hi: int | None = None,
    t_ori: float | None = 10.0,
    serial: float | None = None,
) -> ActionSpec:
    el = Elasticity.amdahl(serial) if serial is not None else None
    return ActionSpec(
        aid,
        Kind.EXEC,
        ((CPU, Demand.range(lo, lo if hi is None else hi)),),
        sandbox=f"sb-{client}",
        client=client,
        t_ori=t_ori,
        elasticity=el,
    )


def _sched(
    cores: int = 4,
    jobs: dict[str, float] | None = None,
    caps: dict[str, dict[str, int]] | None = None,
    clients: dict[str, str] | None = None,
    gpus: int = 0,
) -> tuple[Scheduler, Ledger]:
    """One node; the jobs' weights and caps; each client (and its sandbox sb-<client>) in its job."""
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", cores, mem=100_000, gpus=gpus), 0.0)
    for job in sorted(set(jobs or {}) | set(caps or {})):
        s.handle(
            ev.JobDefined(job, (jobs or {}).get(job, 1.0), tuple(sorted((caps or {}).get(job, {}).items()))),
            0.0,
        )
    for client, job in (clients or {}).items():
        s.handle(ev.JobJoined(client, job), 0.0)
        s.handle(ev.SandboxOpened(f"sb-{client}", client=client, mem_mib=100), 0.0)
    return s, led


def _batch(s: Scheduler, led: Ledger, specs: list[ActionSpec], now: float) -> list[str]:
    """Submit ``specs`` as one batch (decided once, as the drivers do); the ids started."""
    out: list[cmd.Command] = []
    for i, spec in enumerate(specs):
        out += s.handle(ev.ActionSubmitted(spec), now, decide=i == len(specs) - 1)
    led.apply(out)
    return [c.action_id for c in out if isinstance(c, (cmd.Spawn, cmd.Invoke, cmd.Grant))]


def _finish(s: Scheduler, led: Ledger, aid: str, now: float) -> list[str]:
    out = s.handle(ev.ActionFinished(aid), now)
    led.apply(out)
    return [c.action_id for c in out if isinstance(c, (cmd.Spawn, cmd.Invoke, cmd.Grant))]


def test_a_job_under_its_share_is_not_queued_behind_another_jobs_burst():
    s, led = _sched(4, clients={"ca": "a", "cb": "b"})
    assert _batch(s, led, [_exec(f"a{i}", "ca") for i in range(8)], 0.0) == ["a0", "a1", "a2", "a3"]
    assert _batch(s, led, [_exec("b0", "cb")], 1.0) == []  # every core is a's
    assert _finish(s, led, "a0", 2.0) == ["b0"]  # b (0 cores) goes before a's earlier burst (3)
    assert _finish(s, led, "a1", 3.0) == ["a4"]


def test_without_jobs_the_same_trace_is_plain_fcfs():
    s, led = _sched(4)
    for c in ("ca", "cb"):
        s.handle(ev.SandboxOpened(f"sb-{c}", client=c, mem_mib=100), 0.0)
    _batch(s, led, [_exec(f"a{i}", "ca") for i in range(8)], 0.0)
    _batch(s, led, [_exec("b0", "cb")], 1.0)
    assert _finish(s, led, "a0", 2.0) == ["a4"]  # FCFS: the burst came first


def test_cores_split_by_weight_while_both_jobs_wait():
    s, led = _sched(8, jobs={"a": 1, "b": 3}, clients={"ca": "a", "cb": "b"})
    started = _batch(
        s, led, [_exec(f"a{i}", "ca") for i in range(30)] + [_exec(f"b{i}", "cb") for i in range(30)], 0.0
    )
    assert sum(x.startswith("a") for x in started) == 2 and len(started) == 8
    running = list(started)
    for step in range(
        20
    ):  # ends alternate between the jobs; every freed core goes to the job below its share
        victim = next(x for x in running if x.startswith("ab"[step % 2]))
        running.remove(victim)
        running += _finish(s, led, victim, 1.0 + step)
        assert s.jobs.held[CPU] == {"a": 2, "b": 6}


def test_defined_jobs_with_no_client_in_them_change_no_decision():
    def trace(define: bool) -> list[list[cmd.Command]]:
        s, _ = _sched(4, jobs={"x": 5.0} if define else None, caps={"x": {"cpu": 1}} if define else None)
        s.handle(ev.SandboxOpened("sb-c", client="c", mem_mib=100), 0.0)
        outs = [
            s.handle(ev.ActionSubmitted(_exec(f"a{i}", "c", 1, 4, t_ori=5.0, serial=0.1)), 0.1 * i)
            for i in range(6)
        ]
        return outs + [s.handle(ev.ActionFinished(f"a{i}"), 2.0 + i) for i in range(6)]

    assert trace(True) == trace(False)


def test_a_cap_holds_a_job_without_blocking_the_others():
    s, led = _sched(8, caps={"a": {"cpu": 2}}, clients={"ca": "a", "cb": "b"})
    got = _batch(s, led, [_exec(f"a{i}", "ca") for i in range(4)] + [_exec("b0", "cb")], 0.0)
    assert sorted(got) == ["a0", "a1", "b0"]
    st = s.status_of("a2")
    assert st is not None and st.code is Code.UNSCHEDULABLE and "job a is at its cap of 2 cores" in str(st)
    assert _finish(s, led, "a0", 1.0) == ["a2"]


def test_an_action_above_its_jobs_cap_is_rejected_at_once():
    s, led = _sched(8, caps={"a": {"cpu": 2}}, clients={"ca": "a"})
    out = s.handle(ev.ActionSubmitted(_exec("big", "ca", 3)), 0.0)
    (rej,) = [c for c in out if isinstance(c, cmd.Reject)]
    assert rej.code == "NO_CAPACITY" and "capped at 2 cores" in rej.message
    assert rej.reasons[0].where == "job a"


def test_elastic_grants_stop_at_the_jobs_cap():
    s, led = _sched(8, caps={"a": {"cpu": 3}}, clients={"ca": "a"})
    out = s.handle(ev.ActionSubmitted(_exec("t", "ca", 1, 8, t_ori=60.0, serial=0.0)), 0.0)
    (spawn,) = [c for c in out if isinstance(c, cmd.Spawn)]
    assert spawn.dop == 3 and len(spawn.cores) == 3


def test_elastic_grants_stop_at_the_weighted_share_while_another_job_waits():
    s, led = _sched(8, clients={"ca": "a", "cb": "b"})
    _batch(s, led, [_exec("b0", "cb"), _exec("b1", "cb")], 0.0)  # b holds 2 cores
    out: list[cmd.Command] = []
    out += s.handle(ev.ActionSubmitted(_exec("b2", "cb")), 1.0, decide=False)
    out += s.handle(ev.ActionSubmitted(_exec("t", "ca", 1, 8, t_ori=60.0, serial=0.0)), 1.0)
    led.apply(out)
    dop = {c.action_id: c.dop for c in out if isinstance(c, cmd.Spawn)}
    assert dop == {"t": 4, "b2": 1}  # a's share of 8 at 1:1 is 4, though 5 were free for it


def test_elastic_grants_are_not_bounded_when_one_job_alone_waits():
    s, led = _sched(8, clients={"ca": "a", "cb": "b"})
    _batch(s, led, [_exec("b0", "cb")], 0.0)  # b holds a core and waits for nothing
    out = s.handle(ev.ActionSubmitted(_exec("t", "ca", 1, 8, t_ori=60.0, serial=0.0)), 1.0)
    (spawn,) = [c for c in out if isinstance(c, cmd.Spawn)]
    assert spawn.dop == 7  # work-conserving: all that is free


def _trajectories(s: Scheduler, job: str, names: list[str], mem: int, now: float = 0.0) -> None:
    """One client (and its sandbox sb-<name>, ``mem`` MiB) per trajectory, in ``job``."""
    for name in names:
        s.handle(ev.JobJoined(name, job), now)
        s.handle(ev.SandboxOpened(f"sb-{name}", client=name, mem_mib=mem), now)


def test_a_new_trajectory_waits_behind_one_of_the_job_below_its_share_that_found_no_node():
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", 8, mem=10_000), 0.0)
    trajectories = (("cb", "b", 1_000), ("ca", "a", 2_000), ("ca2", "a", 8_000), ("cb2", "b", 1_000))
    for client, job, mem in trajectories:
        _trajectories(s, job, [client], mem)
    assert sorted(_batch(s, led, [_exec("b0", "cb"), _exec("b1", "cb"), _exec("a0", "ca")], 0.0)) == [
        "a0",
        "b0",
        "b1",
    ]
    # dominant shares (cores or memory, of 8 cores and 10,000 MiB): a max(1/8, 0.2) = 0.2 is
    # below b max(2/8, 0.1) = 0.25, so a's new trajectory is placed first and finds no memory;
    # b's, which would fit, waits behind it rather than take the memory a waits for
    assert _batch(s, led, [_exec("a1", "ca2"), _exec("b2", "cb2")], 1.0) == []
    st = s.status_of("b2")
    assert st is not None and "behind a1" in str(st)
    assert "memory free" in str(s.status_of("a1"))


def test_new_trajectories_are_placed_by_weighted_dominant_share_of_cores_and_memory():
    """Rule 4, event by event, on 8 cores and 10,000 MiB (10 sandboxes of 1,000): a job's
    dominant share is max(cores / 8, MiB / 10,000) / weight, with what the pass placed so far.
    By cores alone b (weight 3, no cores held) would get every new sandbox here."""
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", 8, mem=10_000), 0.0)
    s.handle(ev.JobDefined("a", 1.0, ()), 0.0)
    s.handle(ev.JobDefined("b", 3.0, ()), 0.0)
    _trajectories(s, "b", [f"tb{i}" for i in range(11)], 1_000)
    _trajectories(s, "a", [f"ta{i}" for i in range(4)], 1_000)
    assert len(_batch(s, led, [_exec(f"b{i}", f"tb{i}") for i in range(8)], 0.0)) == 8  # b alone: FCFS
    for i in range(8):
        assert _finish(s, led, f"b{i}", 1.0) == []
    assert s.jobs.mem == {"b": 8_000} and s.jobs.held[CPU] == {}  # b keeps its 8 sandboxes, no cores
    assert _batch(s, led, [_exec("a0", "ta0", t_ori=60.0)], 2.0) == ["a0"]
    # one sandbox's memory left; b's new trajectory came first and b holds no cores, but
    # a: max(1/8, 0.1) / 1 = 0.125 is below b: max(0, 0.8) / 3 = 0.27
    assert _batch(s, led, [_exec("b8", "tb8"), _exec("a1", "ta1")], 3.0) == ["a1"]
    assert "memory free" in str(s.status_of("b8"))
    assert s.jobs.mem == {"a": 2_000, "b": 8_000} and s.cpu.nodes["n1"].mem_free == 0
    assert _finish(s, led, "a1", 4.0) == []  # a core frees, no memory
    out = s.handle(ev.SandboxClosed("sb-ta1"), 5.0)  # memory frees: b's is the only new trajectory
    led.apply(out)
    assert [c.action_id for c in out if isinstance(c, cmd.Spawn)] == ["b8"]
    for sb in ("sb-tb0", "sb-tb1"):  # two sandboxes' memory frees
        led.apply(s.handle(ev.SandboxClosed(sb), 6.0))
    # a: 0.125 < b: max(1/8, 0.7) / 3 = 0.23 -> a2; then a: max(2/8, 0.2) = 0.25 > b -> b9;
    # then b: max(2/8, 0.8) / 3 = 0.27 > a -> a3, which finds no memory; b10 waits behind it
    batch = [_exec("b9", "tb9"), _exec("b10", "tb10"), _exec("a2", "ta2"), _exec("a3", "ta3")]
    assert _batch(s, led, batch, 7.0) == ["a2", "b9"]
    assert "memory free" in str(s.status_of("a3")) and "behind a3" in str(s.status_of("b10"))
    assert s.cpu.nodes["n1"].mem_free == 0 and s.jobs.mem == {"a": 2_000, "b": 8_000}


def test_a_new_trajectory_passed_over_for_another_jobs_does_not_hold_its_jobs_placed_ones():
    """A new trajectory that is not its job's turn (another job with new trajectories is
    further below its dominant share) is read after that job's; meanwhile its job's actions in
    placed sandboxes, submitted after it, are read in the cores' fair order (FCFS in a job holds
    within each of the two lines)."""
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", 4, mem=4_000), 0.0)
    _trajectories(s, "a", ["ta0", "ta1", "ta2"], 1_000)
    _trajectories(s, "b", ["tb0", "tb1"], 1_000)
    first = [_exec("a0", "ta0"), _exec("a1", "ta1"), _exec("b0", "tb0", t_ori=60.0)]
    assert len(_batch(s, led, first, 0.0)) == 3
    for aid in ("a0", "a1"):
        assert _finish(s, led, aid, 1.0) == []
    # a: no cores, 2 sandboxes (dominant 0.5); b: 1 core, 1 sandbox (0.25); left: 3 cores, 1 sandbox
    got = _batch(s, led, [_exec("a2", "ta2"), _exec("b1", "tb1"), _exec("a0b", "ta0")], 2.0)
    assert got == ["a0b", "b1"]  # a's placed one by cores (a holds none), then b's new one
    assert "memory free" in str(s.status_of("a2"))


def test_a_pass_counts_the_memory_of_the_trajectories_it_places():
    """Two new trajectories in one pass and one sandbox's memory free: one is placed, the other
    waits (the pass used to check each against the memory free before it, and reserve both)."""
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", 8, mem=1_500), 0.0)
    _trajectories(s, "", ["t0", "t1"], 1_000)
    assert _batch(s, led, [_exec("x0", "t0"), _exec("x1", "t1")], 0.0) == ["x0"]
    assert s.cpu.nodes["n1"].mem_reserved == 1_000 and s.jobs.mem == {"": 1_000}
    st = s.status_of("x1")
    assert st is not None and any(r.resource == "mem" and r.free == 500 for r in st.reasons)


@pytest.mark.parametrize("mems", [(0, 0), (0, 64), (64, 0), (64, 64, 0), (0, 0, 0)])
def test_sandboxes_without_a_memory_limit_close_cleanly(mems: tuple[int, ...]):
    """Sandboxes of one job, some with no memory limit (0 MiB), placed and then closed one by one:
    each close destroys its sandbox on its node and the job's memory ends at nothing. (Closing a
    second 0-MiB sandbox used to raise in the job book's hook, after the sandbox had left the CPU
    manager: the core's handler stopped there, and its `DestroySandbox` never went out.)"""
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", 8, mem=1_000), 0.0)
    names = [f"t{i}" for i in range(len(mems))]
    for name, mem in zip(names, mems, strict=True):
        s.handle(ev.SandboxOpened(f"sb-{name}", client=name, mem_mib=mem), 0.0)
    assert _batch(s, led, [_exec(f"x-{n}", n) for n in names], 0.0) == [f"x-{n}" for n in names]
    assert s.jobs.mem == ({"": sum(mems)} if sum(mems) else {})
    for n in names:
        _finish(s, led, f"x-{n}", 1.0)
    for k, n in enumerate(names):
        out = s.handle(ev.SandboxClosed(f"sb-{n}"), 2.0)
        assert [(c.node, c.sandbox) for c in out if isinstance(c, cmd.DestroySandbox)] == [("n1", f"sb-{n}")]
        assert s.jobs.mem.get("", 0) == sum(mems[k + 1:])
    assert s.jobs.mem == {} and s.cpu.nodes["n1"].mem_reserved == 0


def test_gpu_calls_are_read_in_fair_order_and_capped():
    s, led = _sched(1, caps={"a": {"gpu": 2}}, clients={"ca": "a", "cb": "b"}, gpus=8)
    s.handle(ev.ServiceDefined("svc", 1000, (1,), 0.0, t_ori=5.0), 0.0)

    def call(aid: str, client: str) -> ActionSpec:
        return ActionSpec(aid, Kind.CALL, ((GPU, Demand.fixed(1)),), key=GPU, service="svc", client=client)

    got = _batch(
        s, led, [call(f"a{i}", "ca") for i in range(4)] + [call(f"b{i}", "cb") for i in range(8)], 0.0
    )
    assert sorted(got) == ["a0", "a1"] + [f"b{i}" for i in range(6)]  # a stops at its cap; b is not blocked
    assert "at its cap of 2 GPUs" in str(s.status_of("a2"))
    assert _finish(s, led, "b0", 1.0) == ["b6"]  # a (2, capped) does not take the freed GPU
    assert _finish(s, led, "a0", 2.0) == ["a2"]


def test_api_leases_are_granted_in_fair_order():
    s, led = _sched(1, jobs={"a": 1, "b": 1}, clients={"ca": "a", "cb": "b"})
    s.handle(ev.ApiDefined("search", "concurrency", 2), 0.0)
    res = api_resource("search")

    def lease(aid: str, client: str) -> ActionSpec:
        return ActionSpec(aid, Kind.LEASE, ((res, Demand.fixed(1)),), key=res, api="search", client=client)

    assert _batch(s, led, [lease(f"a{i}", "ca") for i in range(4)], 0.0) == ["a0", "a1"]
    assert _batch(s, led, [lease("b0", "cb")], 1.0) == []
    assert _finish(s, led, "a0", 2.0) == ["b0"]
    assert _finish(s, led, "a1", 3.0) == ["a2"]


def test_snapshot_rows_show_each_jobs_weight_holdings_and_core_seconds():
    s, led = _sched(4, jobs={"a": 1, "b": 3}, caps={"a": {"cpu": 3}}, clients={"ca": "a", "cb": "b"})
    _batch(s, led, [_exec("a0", "ca"), _exec("a1", "ca"), _exec("b0", "cb")], 0.0)
    _finish(s, led, "a0", 10.0)
    rows = {r["job"]: r for r in s.snapshot().jobs}
    assert rows["a"]["weight"] == 1.0 and rows["a"]["caps"] == {"cpu": 3} and rows["b"]["weight"] == 3.0
    assert rows["a"]["held"] == {"cpu": 1} and rows["a"]["share"] == {"cpu": 0.25}
    assert rows["a"]["clients"] == 1 and rows["a"]["started"] == 2
    s.handle(ev.Tick(), 20.0)
    rows = {r["job"]: r for r in s.snapshot().jobs}
    assert rows["a"]["unit_s"]["cpu"] == pytest.approx(10.0 + 20.0)  # a0 held 1 for 10 s, a1 1 for 20 s
    assert rows["b"]["unit_s"]["cpu"] == pytest.approx(20.0)


def test_snapshot_rows_show_each_jobs_memory_and_the_dominant_share_the_core_orders_by():
    """``mem_mib`` is ``JobBook.mem``; ``dominant_share`` is max(cores / 8, MiB / 10,000), what
    ``Fair.dominant`` orders new trajectories by (before the weight, outside a pass)."""
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    s.handle(node("n1", 8, mem=10_000), 0.0)
    s.handle(ev.JobDefined("b", 3.0, ()), 0.0)
    _trajectories(s, "a", ["ta0"], 1_000)
    _trajectories(s, "b", ["tb0", "tb1", "tb2"], 2_000)
    batch = [_exec("a0", "ta0", lo=4)] + [_exec(f"b{i}", f"tb{i}") for i in range(3)]
    assert len(_batch(s, led, batch, 0.0)) == 4
    _finish(s, led, "b0", 1.0)
    rows = {r["job"]: r for r in s.snapshot().jobs}
    assert (rows["a"]["mem_mib"], rows["a"]["dominant_share"]) == (1_000, 0.5)  # cores: 4 of 8
    assert (rows["b"]["mem_mib"], rows["b"]["dominant_share"]) == (6_000, 0.6)  # memory: 6,000 of 10,000
    fair = Fair(s.jobs, CPU, 8, ("a", "b"), 10_000)
    for job, w in (("a", 1.0), ("b", 3.0)):
        assert rows[job]["dominant_share"] == pytest.approx(fair.dominant(job) * w / 8)
    led.apply(s.handle(ev.SandboxClosed("sb-tb1"), 2.0))
    rows = {r["job"]: r for r in s.snapshot().jobs}
    assert (rows["b"]["mem_mib"], rows["b"]["dominant_share"]) == (4_000, 0.4)


def test_a_gone_client_leaves_its_job():
    s, _ = _sched(4, clients={"ca": "a"})
    assert s.jobs.job_of("ca") == "a"
    s.handle(ev.ClientGone("ca"), 1.0)
    assert s.jobs.job_of("ca") == ""


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (JobSpec("x", -1.0), "weight must be a number > 0"),
        (JobSpec("x", float("nan")), "weight must be a number > 0"),
        (JobSpec("x", 1.0, (("memory", 4),)), "unknown resource 'memory' in caps"),
        (JobSpec("x", 1.0, (("cpu", -2),)), "cap of cpu must be an integer >= 0"),
        (JobSpec("x", 1.0, (("api:", 2),)), "unknown resource 'api:'"),
    ],
)
def test_bad_job_specs_name_the_problem(spec: JobSpec, problem: str):
    assert problem in (spec.problem() or "")
    assert JobSpec("x", 2.0, (("cpu", 4), ("api", 2), ("api:llm", 1))).problem() is None


def test_api_caps_fall_back_to_the_any_api_cap():
    book = JobBook()
    book.define(JobSpec("x", 1.0, (("api", 5), ("api:llm", 1))))
    assert book.cap("x", "api:llm") == 1 and book.cap("x", "api:search") == 5 and book.cap("x", "cpu") is None
    assert Fair(book, "cpu").room("y") is None


def _random_jobs_trace(seed: int, steps: int = 100) -> tuple[Ledger, set[str], int]:
    """Random clients in random jobs (weights, caps) submitting execs, calls and leases; every
    event checks the ledger and that no job holds more than its cap. Returns the ledger, the
    ids submitted and the largest number of jobs that had actions queued at once."""
    rng = Random(seed)
    s = Scheduler(CoreConfig())
    led = Ledger(s)
    now, most = 0.0, 0
    caps = {"j0": {"cpu": rng.randint(1, 4), "gpu": 2, "api": 1}, "j1": {}, "j2": {"api:search": 1}}

    def feed(event: ev.Event) -> None:
        nonlocal most
        led.apply(s.handle(event, now))
        most = max(most, len(s.pending.by_job))
        for pool, held in s.jobs.held.items():
            for job, n in held.items():
                cap = s.jobs.cap(job, pool)
                assert cap is None or n <= cap, f"{job} holds {n} of {pool}, over its cap {cap}"

    feed(node("n1", rng.choice([4, 8]), mem=8000, gpus=4, gpu_mem=40_000))
    feed(ev.ServiceDefined("rm", 10_000, (1, 2), load_s=0.2, t_ori=1.0))
    feed(ev.ApiDefined("search", "concurrency", 2))
    for job, weight in (("j0", 1.0), ("j1", 3.0), ("j2", 2.0)):
        feed(ev.JobDefined(job, weight, tuple(sorted(caps[job].items()))))
    for c in range(4):
        feed(ev.JobJoined(f"c{c}", ["j0", "j1", "j2", ""][c]))
        feed(ev.SandboxOpened(f"sb-c{c}", client=f"c{c}", mem_mib=500))
    submitted: set[str] = set()
    for step in range(steps):
        now += rng.choice([0.0, 0.1, 1.0])
        client, roll, running = f"c{rng.randrange(4)}", rng.random(), sorted(s.running)
        if roll < 0.5:
            aid = f"x{step}"
            submitted.add(aid)
            if roll < 0.3:
                spec = _exec(aid, client, 1, rng.choice([1, 4]), t_ori=2.0, serial=0.1)
            elif roll < 0.4:
                spec = ActionSpec(
                    aid, Kind.CALL, ((GPU, Demand.of([1, 2])),), key=GPU, service="rm", client=client
                )
            else:
                res = api_resource("search")
                spec = ActionSpec(
                    aid, Kind.LEASE, ((res, Demand.fixed(1)),), key=res, api="search", client=client
                )
            feed(ev.ActionSubmitted(spec))
        elif roll < 0.9 and running:
            feed(ev.ActionFinished(rng.choice(running)))
        else:
            feed(ev.Tick())
    for _ in range(1000):  # drain
        if not s.running and not any(s.queues.values()):
            break
        now += 1.0
        feed(ev.ActionFinished(sorted(s.running)[0]) if s.running else ev.Tick())
    return led, submitted, most


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6))
def test_random_traces_with_jobs_never_overcommit_pass_a_cap_or_strand_anyone(seed: int) -> None:
    led, submitted, _ = _random_jobs_trace(seed)
    for aid in submitted:
        assert aid in led.started or aid in led.rejected, f"{aid} was neither started nor rejected"
    assert not led.cores and not led.chunks and not led.leases


def test_random_traces_do_mix_jobs_in_one_queue() -> None:
    assert max(_random_jobs_trace(seed)[2] for seed in range(5)) >= 2  # the property above is not vacuous
