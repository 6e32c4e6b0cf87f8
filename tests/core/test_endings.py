"""How actions end when something else ends: a node lost, a sandbox closed, an action
cancelled, a client gone. Each test pins the exact commands, in order (the contract the
controller and the simulator replay), and what is left in the core afterwards.

Written against the survivors of the mutation run in docs/testing.md: before these, no test
of the fast subset looked at the order, codes, messages or leftovers of these endings."""

from __future__ import annotations

from dataclasses import replace

from sched_util import call_spec, exec_spec, lease_spec, node
from test_scheduler import make, open_sb

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.resources import GPU
from tangram.core.scheduler import Scheduler
from tangram.core.status import ADMITTED, Shortfall


def submit(s: Scheduler, spec, now: float) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(spec), now)


# -- a node lost ------------------------------------------------------------------------------
def _two_nodes(twin: bool = False) -> Scheduler:
    """n1: 4 cores and one GPU; n2: 4 cores (with ``twin``, n3: the same as n1, its GPU
    busy with "b"). "z" (exec, started first) and "a" (call) run on n1; "q" (of z's
    sandbox) and "g2" (a call) wait."""
    s = Scheduler()
    s.handle(node("n1", 4, gpus=1), 0.0)
    s.handle(node("n2", 4), 0.0)
    if twin:
        s.handle(node("n3", 4, gpus=1), 0.0)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=0.0, t_ori=5.0), 0.0)
    open_sb(s, "sb1")
    assert [type(c) for c in submit(s, exec_spec("z", "sb1", 1), 0.0)] == [cmd.CreateSandbox, cmd.Spawn]
    assert s.running["z"].node == "n1"
    submit(s, call_spec("a", "rm"), 1.0)
    if twin:
        submit(s, call_spec("b", "rm"), 1.0)
    assert s.running["a"].node == "n1"
    assert submit(s, exec_spec("q", "sb1", 4), 1.5) == []
    assert submit(s, call_spec("g2", "rm"), 1.6) == []
    return s


# What losing n1 of `_two_nodes` ends first, in either shape: its runs in start order (the exec in
# sb1, then the call), then the exec queued for sb1.
N1_LOST = [
    cmd.Done("z", False, "power"),
    cmd.Reject("z", "SANDBOX_LOST", "n1: power"),
    cmd.Done("a", False, "power"),
    cmd.Reject("a", "NODE_LOST", "n1: power"),
    cmd.Reject("q", "SANDBOX_LOST", "sandbox sb1 was on n1: power"),
]


def test_a_lost_node_ends_its_actions_in_start_order_then_judges_every_queue_again():
    s = _two_nodes()
    out = s.handle(ev.NodeLost("n1", reason="power"), 2.0)
    # n1 was the only GPU node: every queued action is judged again
    short = Shortfall(GPU, 1, 0, 0, "largest node")
    assert out == [*N1_LOST, cmd.Reject("g2", "NO_CAPACITY", "no GPU node has joined", (short,))]
    assert not s.running and not s.queues.get("cpu") and not s.queues.get("gpu")
    assert set(s.gpu.nodes) == set() and set(s.cpu.nodes) == {"n2"}
    assert s.sandboxes["sb1"].lost
    # a lost sandbox is closed without a DestroySandbox (its node is gone)
    assert s.handle(ev.SandboxClosed("sb1"), 3.0) == []


def test_a_lost_node_of_a_common_shape_drops_only_its_sandboxes_actions():
    s = _two_nodes(twin=True)
    out = s.handle(ev.NodeLost("n1", reason="power"), 2.0)
    assert out == N1_LOST
    assert list(s.queues["gpu"]) == ["g2"]  # n3 can still hold it: it waits for "b"
    out = s.handle(ev.ActionFinished("b"), 3.0)
    assert [(c.action_id, c.node) for c in out if isinstance(c, cmd.Invoke)] == [("g2", "n3")]


# -- a sandbox closed -------------------------------------------------------------------------
def test_closing_a_sandbox_cancels_its_queue_kills_its_runs_in_start_order_and_destroys_it():
    s = make(cores=4)
    open_sb(s, "sb")
    submit(s, exec_spec("zz", "sb", 1, timeout_s=10.0), 0.0)
    submit(s, exec_spec("aa", "sb", 1), 1.0)
    submit(s, exec_spec("q", "sb", 3), 2.0)  # two cores free: it waits
    assert set(s.running) == {"zz", "aa"}
    out = s.handle(ev.SandboxClosed("sb"), 3.0)
    assert out == [
        cmd.Reject("q", "CANCELLED", "sandbox sb closed"),
        cmd.Kill("zz", "n1", "sandbox closed"),
        cmd.Kill("aa", "n1", "sandbox closed"),
        cmd.DestroySandbox("n1", "sb"),
    ]
    assert "sb" not in s.sandboxes and s.cpu.nodes["n1"].mem_reserved == 0
    assert s.handle(ev.Tick(), 10.0) == []  # killed once: its timeout does not kill it again
    out = s.handle(ev.ActionFinished("zz", ok=False, reason="killed"), 10.5)
    assert out == [cmd.Done("zz", False, "killed")]


def test_a_cancelled_run_is_not_killed_again_when_its_sandbox_closes():
    s = make(cores=2)
    open_sb(s, "sb")
    submit(s, exec_spec("x", "sb", 1), 0.0)
    assert s.status_of("x") is ADMITTED
    assert s.handle(ev.ActionCancelled("x", reason="user"), 1.0) == [cmd.Kill("x", "n1", "user")]
    assert s.handle(ev.ActionCancelled("x", reason="again"), 1.5) == []
    assert s.handle(ev.SandboxClosed("sb"), 2.0) == [cmd.DestroySandbox("n1", "sb")]


def test_closing_a_reserved_sandbox_ends_its_reservation_and_cancels_the_execs_it_held():
    s = make(cores=2)
    open_sb(s, "full")
    submit(s, exec_spec("hog", "full", 2), 0.0)
    open_sb(s, "pod", reserve=2, now=0.5)  # waits for the cores "hog" holds
    assert submit(s, exec_spec("x", "pod", 1), 1.0) == []  # held for the reservation
    assert s.handle(ev.SandboxClosed("pod"), 2.0) == [
        cmd.Reject("open:pod", "CANCELLED", "sandbox pod closed"),
        cmd.Reject("x", "CANCELLED", "sandbox pod closed"),
    ]
    open_sb(s, "again")  # the ids are free again
    assert submit(s, exec_spec("x", "again", 1), 3.0) == []  # queued, not BAD_REQUEST
    open_sb(s, "pod2", reserve=1, now=4.0)
    s.handle(ev.ActionFinished("hog"), 5.0)
    out = s.handle(ev.SandboxClosed("pod2"), 6.0)
    assert out[0] == cmd.Done("open:pod2", True, "closed")
    assert cmd.DestroySandbox("n1", "pod2") in out


def test_the_last_sandbox_of_a_client_leaves_no_index_behind():
    s = make(cores=2)
    open_sb(s, "a")
    open_sb(s, "b")
    s.handle(ev.SandboxClosed("a"), 1.0)
    assert s._client_sandboxes == {"c": {"b": None}}
    s.handle(ev.SandboxClosed("b"), 2.0)
    assert s._client_sandboxes == {}
    assert s.handle(ev.SandboxClosed("b"), 3.0) == []  # closing twice: nothing


# -- cancelling -------------------------------------------------------------------------------
def test_cancelling_one_held_exec_leaves_the_others_to_run_on_the_reservation():
    s = make(cores=2)
    open_sb(s, "full")
    submit(s, exec_spec("hog", "full", 2), 0.0)
    open_sb(s, "pod", reserve=2, now=0.5)
    submit(s, exec_spec("x", "pod", 1), 1.0)
    submit(s, exec_spec("y", "pod", 1), 1.1)
    assert s.handle(ev.ActionCancelled("y", reason="user"), 1.5) == [cmd.Reject("y", "CANCELLED", "user")]
    assert s.handle(ev.ActionCancelled("y", reason="user"), 1.6) == []
    out = s.handle(ev.ActionFinished("hog"), 2.0)
    assert [c.action_id for c in out if isinstance(c, cmd.Spawn)] == ["x"]
    open_sb(s, "s2")
    assert submit(s, exec_spec("y", "s2", 1), 2.5) == []  # queued (the pod holds the cores)


def test_cancelling_a_granted_lease_ends_it_at_once():
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    submit(s, lease_spec("l1", "search"), 0.0)
    submit(s, lease_spec("l2", "search"), 0.0)
    out = s.handle(ev.ActionCancelled("l1", reason="user"), 1.0)
    assert out == [cmd.Done("l1", False, "user"), cmd.Grant("l2", "search", 301.0)]


# -- a client gone ----------------------------------------------------------------------------
def _as(spec, client: str):
    return replace(spec, client=client)


def test_a_client_gone_cancels_its_queue_ends_its_leases_and_closes_its_sandboxes():
    s = make(cores=2, gpus=1)
    s.handle(ev.ApiDefined("search", "concurrency", 2), 0.0)
    s.handle(ev.ServiceDefined("rm", 10_000, (1,), load_s=0.0, t_ori=5.0), 0.0)
    s.handle(ev.SandboxOpened("sb", client="c", mem_mib=1000), 0.0)
    s.handle(ev.SandboxOpened("sd", client="d", mem_mib=1000), 0.0)
    submit(s, lease_spec("zl", "search"), 0.0)  # granted first
    submit(s, lease_spec("al", "search"), 1.0)  # granted second
    submit(s, _as(lease_spec("dl", "search"), "d"), 1.0)  # d's: waits for a slot
    submit(s, exec_spec("e", "sb", 1), 1.0)
    submit(s, _as(exec_spec("de", "sd", 1), "d"), 1.0)
    submit(s, _as(call_spec("dg", "rm"), "d"), 1.0)
    submit(s, call_spec("g", "rm"), 1.1)  # waits for the GPU
    submit(s, exec_spec("q", "sb", 1), 1.2)  # waits for a core
    assert set(s.running) == {"zl", "al", "e", "de", "dg"}
    out = s.handle(ev.ClientGone("c"), 2.0)
    assert out == [
        cmd.Reject("q", "CANCELLED", "client gone"),
        cmd.Reject("g", "CANCELLED", "client gone"),
        cmd.Done("zl", False, "client gone"),
        cmd.Done("al", False, "client gone"),
        cmd.Kill("e", "n1", "sandbox closed"),
        cmd.DestroySandbox("n1", "sb"),
        cmd.Grant("dl", "search", 302.0),
    ]
    assert set(s.running) == {"e", "de", "dg", "dl"} and set(s.sandboxes) == {"sd"}
    assert s._client_sandboxes == {"d": {"sd": None}}


# -- API leases -------------------------------------------------------------------------------
def test_a_grant_runs_until_its_timeout_or_the_lease_ttl_and_a_full_api_says_why():
    s = make(cores=1, lease_ttl_s=50.0)
    s.handle(ev.ApiDefined("search", "concurrency", 2), 0.0)
    assert submit(s, lease_spec("l1", "search", timeout_s=7.0), 1.0) == [cmd.Grant("l1", "search", 8.0)]
    assert s.examined["api:search"] == 1  # the pass read one head
    assert submit(s, lease_spec("l2", "search"), 2.0) == [cmd.Grant("l2", "search", 52.0)]
    r = s.running["l2"]
    assert (r.node, r.units, r.started, r.est_end, r.deadline) == ("search", 1, 2.0, 52.0, 52.0)
    before = s.examined.get("api:search", 0)
    assert submit(s, lease_spec("l3", "search"), 3.0) == []
    assert s.examined["api:search"] == before + 1  # one head read
    st = s.status_of("l3")
    assert st is not None and st.reasons == (Shortfall("api:search", 1, 0, 2, "search"),)
    assert s.next_deadline() == 8.0
    out = s.handle(ev.Tick(), 8.0)
    assert out == [
        cmd.Done("l1", False, "lease expired"),
        cmd.Reject("l1", "TIMEOUT", "lease not released before its deadline: reclaimed"),
        cmd.Grant("l3", "search", 58.0),
    ]


def test_an_idle_core_has_no_deadline_and_one_lease_is_its_only_one():
    s = make(cores=1)
    assert s.next_deadline() is None
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    submit(s, lease_spec("l1", "search"), 0.0)
    assert s.next_deadline() == 300.0


def test_submission_order_survives_grants():
    # a grant takes a number from the same sequence as submissions: later ones stay later
    s = make(cores=1)
    s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    open_sb(s, "sb")
    open_sb(s, "sc")
    submit(s, lease_spec("l1", "search"), 0.0)
    submit(s, lease_spec("l2", "search"), 0.0)
    submit(s, exec_spec("a", "sb", 1), 0.0)
    submit(s, exec_spec("b", "sc", 1), 0.1)  # queued behind "a"
    s.handle(ev.ActionFinished("l1"), 1.0)  # l2 granted
    submit(s, exec_spec("c", "sb", 1), 2.0)
    seqs = {aid: w.seq for aid, w in s.queues["cpu"].items()}
    assert list(seqs) == ["b", "c"] and seqs["b"] < seqs["c"]
    s.handle(ev.ActionFinished("a"), 3.0)
    assert "b" in s.running and "c" not in s.running


def test_an_old_deadline_of_a_reused_id_does_not_kill_the_new_action():
    s = make(cores=2)
    open_sb(s, "s1")
    open_sb(s, "s2")
    submit(s, exec_spec("hog", "s1", 2), 0.0)
    submit(s, exec_spec("x", "s2", 1, timeout_s=5.0), 0.0)  # queued, deadline 5
    s.handle(ev.ActionCancelled("x"), 1.0)
    s.handle(ev.ActionFinished("hog"), 1.5)
    submit(s, exec_spec("x", "s2", 1, timeout_s=100.0), 2.0)  # runs, deadline 102
    assert s.next_deadline() == 102.0
    assert s.handle(ev.Tick(), 5.0) == []
