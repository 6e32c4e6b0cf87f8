"""``Lane`` and ``Pending`` against a plain model: FCFS order per queue through any mix of
submissions, starts, cancellations and sandboxes bound to nodes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.core.actions import ActionSpec, Kind
from tangram.core.queues import Lane, Pending
from tangram.core.resources import CPU, GPU, Demand
from tangram.core.state import Waiting

SANDBOXES = ("s0", "s1", "s2", "s3", "s4")
NODES = ("n1", "n2")


def waiting(seq: int, sandbox: str = "", gpu: bool = False, client: str = "c") -> Waiting:
    if gpu:
        demand = ((GPU, Demand.fixed(1)),)
        spec = ActionSpec(f"a{seq}", Kind.CALL, demand, key=GPU, service="rm", client=client)
    else:
        spec = ActionSpec(f"a{seq}", Kind.EXEC, ((CPU, Demand.fixed(1)),), sandbox=sandbox, client=client)
    return Waiting(spec, seq, 0.0, None, need=1)


def test_lane_keeps_seq_order_through_inserts_and_removals_across_chunks() -> None:
    lane = Lane()
    ws = {s: waiting(s) for s in range(2000)}
    for s in range(0, 2000, 2):  # appends, then inserts into the middle of full chunks
        lane.add(ws[s])
    for s in range(1, 2000, 2):
        lane.add(ws[s])
    assert [w.seq for w in lane] == list(range(2000))
    for s in range(0, 2000, 3):
        lane.remove(ws[s])
    left = [s for s in range(2000) if s % 3]
    assert [w.seq for w in lane] == left and len(lane) == len(left)
    assert lane.head() is ws[1]
    assert [w.seq for w in lane.after_head()] == left[1:]
    lane.remove(ws[0])  # not there: nothing happens
    assert len(lane) == len(left)


ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "add", "remove", "bind"]), st.integers(0, 10**6),
              st.sampled_from(SANDBOXES), st.sampled_from(NODES), st.booleans()),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_pending_reads_each_queue_in_fcfs_order(steps: list[tuple[str, int, str, str, bool]]) -> None:
    p = Pending()
    node_of: dict[str, str] = {}  # the model: sandbox -> node ("" until bound)
    queued: dict[str, Waiting] = {}
    seq = 0
    for op, pick, sandbox, node, gpu in steps:
        if op == "add":
            seq += 1
            w = waiting(seq, sandbox, gpu, client=f"c{seq % 3}")
            p.add(GPU if gpu else CPU, w, "" if gpu else node_of.get(sandbox, ""))
            queued[w.spec.action_id] = w
        elif op == "remove" and queued:
            aid = sorted(queued)[pick % len(queued)]
            assert p.remove(aid) is queued.pop(aid)
            assert p.remove(aid) is None
        elif op == "bind" and sandbox not in node_of:
            node_of[sandbox] = node
            p.bind(sandbox, node)
    cpu = [w for w in queued.values() if w.spec.kind is Kind.EXEC]
    for key in ("", *NODES):
        want = sorted((w for w in cpu if node_of.get(w.spec.sandbox, "") == key), key=lambda w: w.seq)
        assert list(p.cpu_queue(key)) == want
        assert (key in p.cpu_queues()) == bool(want)
    assert [w.seq for w in p.lane(GPU)] == sorted(w.seq for w in queued.values() if w.spec.kind is Kind.CALL)
    for sandbox in SANDBOXES:
        mine = sorted((w for w in cpu if w.spec.sandbox == sandbox), key=lambda w: w.seq)
        assert p.of_sandbox(sandbox) == mine
    rank = {pool: i for i, pool in enumerate(p.pools)}
    for client in ("c0", "c1", "c2"):
        mine = [w for w in queued.values() if w.spec.client == client]
        want_order = sorted(mine, key=lambda w: (rank[GPU if w.spec.kind is Kind.CALL else CPU], w.seq))
        assert p.of_client(client) == want_order
    assert all(p.get(aid) is w for aid, w in queued.items())
    assert sum(len(q) for q in p.pools.values()) == len(queued)
