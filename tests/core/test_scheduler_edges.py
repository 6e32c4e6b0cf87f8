"""Scheduler rules pinned where the mutation run of docs/testing.md found them unchecked:
admission details, redefinitions, adoption, the duration model, deadlines, batches and the
views. Each test names the rule it holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_util import call_spec, exec_spec, lease_spec, node
from test_scheduler import make, open_sb, started

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind, duration
from tangram.core.resources import CPU, MEM, Demand
from tangram.core.scheduler import Scheduler
from tangram.core.state import Waiting
from tangram.core.status import Shortfall


def submit(s: Scheduler, spec, now: float = 0.0) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(spec), now)


def test_an_unknown_event_is_a_type_error():
    with pytest.raises(TypeError, match="not an event: 'nope'"):
        Scheduler().handle("nope", 0.0)  # type: ignore[arg-type]


def test_a_service_without_a_valid_chunk_size_runs_on_one_gpu():
    s = make(cores=1, gpus=2)
    s.handle(ev.ServiceDefined("odd", 1_000, (3, 16), load_s=0.0, t_ori=1.0), 0.0)
    assert s.snapshot().services[0]["chunk_sizes"] == [1]


def test_redefining_an_api_with_a_higher_limit_grants_the_waiting_leases():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    submit(s, lease_spec("l1", "search"))
    submit(s, lease_spec("l2", "search"))
    assert s.handle(ev.ApiDefined("search", "concurrency", 2), 1.0) == [cmd.Grant("l2", "search", 301.0)]


def test_a_reservation_belongs_to_its_client_and_is_rejected_when_no_node_can_hold_it():
    s = make(cores=2)
    open_sb(s, "hog")
    submit(s, exec_spec("h", "hog", 2))
    open_sb(s, "pod", reserve=2, now=1.0)  # waits for the cores
    assert s.handle(ev.ClientGone("c"), 2.0)[0] == cmd.Reject("open:pod", "CANCELLED", "client gone")
    out = s.handle(ev.SandboxOpened("wide", client="d", mem_mib=10, reserve=3), 3.0)
    assert out == [
        cmd.Reject(
            "open:wide", "NO_CAPACITY", "no node is large enough", (Shortfall(CPU, 3, 2, 2, "largest node"),)
        )
    ]


def test_a_client_without_sandboxes_can_go():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    submit(s, replace(lease_spec("l", "search"), client="x"))
    assert s.handle(ev.ClientGone("x"), 1.0) == [cmd.Done("l", False, "client gone")]
    assert s.handle(ev.ClientGone("nobody"), 1.0) == []


def test_an_adopted_sandbox_takes_its_queued_actions_to_its_node():
    s = Scheduler()
    s.handle(node("a", 2, mem=10_000), 0.0)
    s.handle(node("b", 2, mem=2_000), 0.0)
    s.handle(ev.SandboxOpened("sb", client="c", mem_mib=500), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("x", "sb", 1)), 0.0, decide=False)
    out = s.handle(ev.SandboxAdopted("sb", "b"), 0.0)  # "a" has more memory, but sb lives on "b"
    assert [(c.action_id, c.node) for c in started(out)] == [("x", "b")]


def test_the_history_scales_a_run_by_its_units_and_their_efficiency():
    s = make(cores=4)
    open_sb(s, "sb")
    submit(s, exec_spec("two", "sb", 2, 2, serial=0.0, action_type="p"), 0.0)
    s.handle(ev.ActionFinished("two"), 3.0)  # 3 s on 2 cores at E = 1: 6 s of work
    el = Elasticity.of_table({1: 0.9, 2: 0.8})
    spec = ActionSpec(
        "one", Kind.EXEC, ((CPU, Demand.fixed(1)),), sandbox="sb", elasticity=el, action_type="q", client="c"
    )
    submit(s, spec, 4.0)
    s.handle(ev.ActionFinished("one"), 6.0)  # one unit: T_ori is what it took, whatever E(1) says
    assert s.history.items() == [("p", 6.0), ("q", 2.0)]


def test_a_node_forgets_only_the_evicted_instance():
    s = make(cores=1, gpus=4)
    s.handle(ev.ServiceDefined("rm", 10_000, (1, 2), load_s=1.0, t_ori=1.0), 0.0)
    s.handle(ev.ServiceDefined("aa", 10_000, (1,), load_s=1.0, t_ori=1.0), 0.0)
    gnode = s.gpu.nodes["n1"]
    for inst in (("rm", 0, 1), ("rm", 1, 1), ("aa", 2, 1), ("rm", 2, 2)):
        gnode.add_resident(inst, 100, 1.0)
    s.handle(ev.ServiceEvicted("n1", "rm", 1), 1.0)
    assert sorted(gnode.resident) == [("aa", 2, 1), ("rm", 0, 1), ("rm", 2, 2)]


def test_the_counters_add_up_over_several_answers():
    s = make(cores=2)
    open_sb(s, "sb")
    for i in range(2):
        submit(s, exec_spec(f"big{i}", "sb", 3))  # NO_CAPACITY, twice
    for i, ok in enumerate((True, True, False, False)):
        submit(s, exec_spec(f"a{i}", "sb", 1), float(i))
        s.handle(ev.ActionFinished(f"a{i}", ok=ok), float(i) + 0.5)
    assert s.counters["rejected"] == 2 and s.counters["finished"] == 2 and s.counters["failed"] == 2


def test_a_bad_elasticity_is_a_bad_request_and_a_good_one_does_not_hide_other_problems():
    s = make(cores=2)
    open_sb(s, "sb")
    bad = replace(exec_spec("a", "sb", 1, 2), elasticity=Elasticity.amdahl(1.5))
    assert submit(s, bad) == [cmd.Reject("a", "BAD_REQUEST", "serial_fraction must be within [0, 1]")]
    good = exec_spec("b", "nope", 1, 2, serial=0.1)
    assert submit(s, good) == [cmd.Reject("b", "BAD_REQUEST", "unknown sandbox 'nope': open it first")]


def test_an_unknown_api_names_the_known_ones():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    s.handle(ev.ApiDefined("pdf", "quota", 1), 0.0)
    assert submit(s, lease_spec("l", "nope")) == [
        cmd.Reject("l", "BAD_REQUEST", "unknown API 'nope' (known: pdf, search)")
    ]


def test_an_id_in_use_by_a_queued_or_held_action_cannot_be_reused():
    s = make(cores=1)
    open_sb(s, "hog")
    submit(s, exec_spec("h", "hog", 1))
    open_sb(s, "sb")
    submit(s, exec_spec("queued", "sb", 1))
    open_sb(s, "pod", reserve=1)
    submit(s, exec_spec("held", "pod", 1))
    for aid in ("queued", "held"):
        assert submit(s, exec_spec(aid, "sb", 1)) == [
            cmd.Reject(aid, "BAD_REQUEST", f"action id {aid!r} is already in use")
        ]


def test_a_demand_above_the_sandboxs_node_counts_as_rejected_at_once():
    s = Scheduler()
    s.handle(node("n1", 4, mem=1_000), 0.0)
    s.handle(node("n2", 2, mem=8_000), 0.0)
    open_sb(s, "sb")
    submit(s, exec_spec("a", "sb", 1))
    assert s.running["a"].node == "n2"
    submit(s, exec_spec("b", "sb", 2), 1.0)  # n2 busy: b would wait there
    assert submit(s, exec_spec("c", "sb", 3), 1.0)[0].code == "NO_CAPACITY"
    assert s.counters["rejected"] == 1


def test_a_batch_decides_every_pool_it_touched():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    open_sb(s, "a")
    open_sb(s, "b")
    submit(s, lease_spec("l", "search"))
    submit(s, exec_spec("x", "a", 1))
    submit(s, exec_spec("y", "b", 1))  # waits
    s.handle(ev.ActionFinished("l"), 1.0, decide=False)  # its API pool has nothing queued
    s.handle(ev.ActionFinished("x"), 1.0, decide=False)
    assert [c.action_id for c in started(s.decide(1.0))] == ["y"]


def test_a_call_with_its_own_t_ori_is_estimated_with_it():
    s = make(cores=1, gpus=1)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=0.0, t_ori=8.0), 0.0)
    out = submit(s, replace(call_spec("g", "rm"), t_ori=2.0))
    assert out[-1] == cmd.Invoke("g", "n1", "rm", 0, 1, 2.0)


def test_submission_order_survives_calls_ending():
    s = make(cores=1, gpus=1)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=0.0, t_ori=8.0), 0.0)
    open_sb(s, "sb")
    open_sb(s, "sc")
    submit(s, call_spec("g", "rm"))
    submit(s, exec_spec("a", "sb", 1))
    submit(s, exec_spec("b", "sc", 1))  # queued behind a
    s.handle(ev.ActionFinished("g"), 1.0)  # a call's end takes a number for its LRU stamp
    submit(s, exec_spec("c", "sb", 1), 2.0)
    seqs = {aid: w.seq for aid, w in s.queues["cpu"].items()}
    assert list(seqs) == ["b", "c"] and seqs["b"] < seqs["c"]


def test_every_due_deadline_is_served_past_stale_ones():
    s = make(cores=1)
    open_sb(s, "a")
    open_sb(s, "b")
    open_sb(s, "c")
    submit(s, exec_spec("big", "a", 1))
    submit(s, exec_spec("x", "b", 1, timeout_s=5.0))
    submit(s, exec_spec("y", "c", 1, timeout_s=6.0))
    s.handle(ev.ActionCancelled("x"), 1.0)  # its deadline entry is stale now
    assert s.handle(ev.Tick(), 7.0) == [cmd.Reject("y", "TIMEOUT", "timed out while queued")]


def test_a_head_that_times_out_lets_the_queue_behind_it_go():
    s = make(cores=2)
    for sb in ("h", "a", "b"):
        open_sb(s, sb)
        s.handle(ev.SandboxAdopted(sb, "n1"), 0.0)
    submit(s, exec_spec("hog", "h", 1))
    submit(s, exec_spec("wide", "a", 2, timeout_s=5.0))  # waits for 2 cores
    submit(s, exec_spec("small", "b", 1))  # fits, but waits behind "wide" (FCFS)
    out = s.handle(ev.Tick(), 5.0)
    assert out[0] == cmd.Reject("wide", "TIMEOUT", "timed out while queued")
    assert [c.action_id for c in started(out)] == ["small"]


def test_a_limited_snapshot_lists_the_oldest_waiting_actions_across_pools():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    open_sb(s, "a")
    open_sb(s, "b")
    res = ((CPU, Demand.range(1, 2)), (MEM, Demand.fixed(100)))
    submit(s, exec_spec("x", "a", 1))  # the cpu pool is created first
    submit(s, lease_spec("l1", "search"))
    submit(s, lease_spec("l2", "search"), 1.0)  # waits: older than "y"
    submit(s, ActionSpec("y", Kind.EXEC, res, sandbox="b", client="c"), 2.0)
    (row,) = s.snapshot(limit=1).queue
    assert row.action_id == "l2"
    assert [r.demand for r in s.snapshot().queue] == ["api:search=1", "cpu=1..2,mem=100"]


def test_a_waiting_actions_view_in_approx_acts_follows_its_t_ori():
    s = make(cores=16)
    spec = exec_spec("a", "sb", 1, 16, t_ori=None, serial=0.0, action_type="t")
    w = Waiting(spec, 1, 0.0, None, need=1)
    assert s._behind_of(w).options == ((1, 1.0), (2, 0.5), (4, 0.25), (8, 0.125), (16, 0.0625))
    s.history.record("t", 8.0)
    assert s._behind_of(w).options == tuple((u, duration(8.0, spec.elasticity, u)) for u in (1, 2, 4, 8, 16))


def test_a_waiting_action_offers_only_the_units_its_demand_allows():
    s = make(cores=16)
    assert [u for u, _ in s._behind(exec_spec("a", "sb", 3, 12, t_ori=8.0, serial=0.0)).options] == [
        3,
        4,
        8,
        12,
    ]
    odd = ActionSpec(
        "b",
        Kind.EXEC,
        ((CPU, Demand.of([1, 6])),),
        sandbox="sb",
        t_ori=8.0,
        elasticity=Elasticity.amdahl(0.0),
        client="c",
    )
    assert [u for u, _ in s._behind(odd).options] == [1, 6]
