"""A decision must not cost more as the queue grows (issue 9, item 4).

No timing here: ``Scheduler.examined`` counts the queued actions each pass reads, and the
queues are swapped for ones that fail when something walks all of them. Every test builds
the same situation with a short and a long queue and asserts the same, bounded, work.
"""
from __future__ import annotations

import pytest
from sched_util import call_spec, exec_spec, lease_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.queues import Lane
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.status import Code

SHORT, LONG = 60, 3000
LIMIT = CoreConfig().behind_limit


class NoWalk(dict):  # type: ignore[type-arg]
    """A pool's queue that may be read and changed by id but never walked whole."""

    def _walked(self, *_: object) -> None:
        raise AssertionError("an event walked a whole queue")

    __iter__ = keys = values = items = _walked  # type: ignore[assignment]


def no_walks(s: Scheduler) -> None:
    for pool in list(s.pending.pools):
        s.pending.pools[pool] = NoWalk(s.pending.pools[pool])


@pytest.fixture(autouse=True)
def lane_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every queued action any code reads out of a ``Lane`` in order, whoever reads it."""
    count = [0]

    def counted(method):  # type: ignore[no-untyped-def]
        def wrapper(self):  # type: ignore[no-untyped-def]
            for w in method(self):
                count[0] += 1
                yield w
        return wrapper

    monkeypatch.setattr(Lane, "__iter__", counted(Lane.__iter__))
    monkeypatch.setattr(Lane, "after_head", counted(Lane.after_head))
    LANE_READS[:] = [count]
    return count


LANE_READS: list[list[int]] = []


def read(s: Scheduler, pool: str, event: object, now: float = 5.0) -> tuple[int, list[cmd.Command]]:
    """What handling ``event`` read of the queues: the pass's own count of ``pool``, checked
    against everything read out of any lane in order."""
    before, lanes_before = s.examined.get(pool, 0), LANE_READS[0][0]
    out = s.handle(event, now)  # type: ignore[arg-type]
    n, lanes = s.examined.get(pool, 0) - before, LANE_READS[0][0] - lanes_before
    assert lanes <= n + 2 * LIMIT + 2, f"{lanes} actions read out of lanes, the pass counted {n}"
    return max(n, lanes), out


def cpu_backlog(queued: int, bound: int = 20) -> Scheduler:
    """One node of 4 cores all taken by "big"; ``queued`` 1-core execs wait: most in the
    ``bound`` sandboxes that already ran on the node, the rest in new sandboxes."""
    s = Scheduler(CoreConfig())
    s.handle(node("n1", 4, mem=1_000_000), 0.0)
    for k in range(bound):
        s.handle(ev.SandboxOpened(f"b{k}", client="c", mem_mib=10), 0.0)
        s.handle(ev.ActionSubmitted(exec_spec(f"warm{k}", f"b{k}", 1, t_ori=1.0)), 0.0)
        s.handle(ev.ActionFinished(f"warm{k}"), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("big", "b0", 4, t_ori=100.0)), 1.0)
    assert "big" in s.running
    for i in range(queued):
        sb = f"b{i % bound}" if i % 4 else f"new{i}"
        if sb.startswith("new"):
            s.handle(ev.SandboxOpened(sb, client=f"c{i % 7}", mem_mib=10), 1.0)
        s.handle(ev.ActionSubmitted(exec_spec(f"q{i}", sb, 1, t_ori=1.0)), 1.0)
    assert len(s.queues["cpu"]) == queued
    return s


def test_an_arrival_behind_a_blocked_head_reads_the_heads_only() -> None:
    reads = []
    for queued in (SHORT, LONG):
        s = cpu_backlog(queued)
        no_walks(s)
        n_bound, _ = read(s, "cpu", ev.ActionSubmitted(exec_spec("late", "b3", 1, t_ori=1.0)))
        s.handle(ev.SandboxOpened("fresh", client="c", mem_mib=10), 5.0)
        n_new, _ = read(s, "cpu", ev.ActionSubmitted(exec_spec("late2", "fresh", 1, t_ori=1.0)))
        reads.append((n_bound, n_new))
    assert reads[0] == reads[1]
    assert max(reads[1]) <= 2  # the node's blocked head and the node-less queue's head


def test_a_completion_reads_what_can_start_plus_the_look_ahead() -> None:
    reads = []
    for queued in (SHORT * 2, LONG):
        s = cpu_backlog(queued)
        no_walks(s)
        n, out = read(s, "cpu", ev.ActionFinished("big"))
        assert len([c for c in out if isinstance(c, cmd.Spawn)]) == 4  # four 1-core execs start
        reads.append(n)
    assert reads[0] == reads[1]
    assert reads[1] <= 4 + 1 + LIMIT + 1  # the starters, the blocked head, its look-ahead, the node-less head


def gpu_backlog(queued: int) -> Scheduler:
    s = Scheduler(CoreConfig())
    s.handle(node("g1", 1, gpus=1), 0.0)
    s.handle(ev.ServiceDefined("rm", 1000, (1,), load_s=0.1, t_ori=1.0), 0.0)
    s.handle(ev.ActionSubmitted(call_spec("first", "rm")), 0.0)
    assert "first" in s.running
    for i in range(queued):
        s.handle(ev.ActionSubmitted(call_spec(f"g{i}", "rm")), 0.0)
    return s


def test_gpu_passes_read_a_bounded_prefix() -> None:
    reads = []
    for queued in (SHORT * 2, LONG):
        s = gpu_backlog(queued)
        no_walks(s)
        arrival, _ = read(s, "gpu", ev.ActionSubmitted(call_spec("late", "rm")))
        done, out = read(s, "gpu", ev.ActionFinished("first"))
        assert [c.action_id for c in out if isinstance(c, cmd.Invoke)] == ["g0"]
        reads.append((arrival, done))
    assert reads[0] == reads[1]
    assert max(reads[1]) <= 2 * LIMIT + 2  # the prefix, the calls behind it, the cache-aware window


def test_an_api_arrival_behind_an_exhausted_limit_reads_one_head() -> None:
    for queued in (SHORT, LONG):
        s = Scheduler(CoreConfig())
        s.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
        for i in range(queued + 1):
            s.handle(ev.ActionSubmitted(lease_spec(f"l{i}", "search")), 0.0)
        assert "l0" in s.running
        no_walks(s)
        n, _ = read(s, "api:search", ev.ActionSubmitted(lease_spec("late", "search")))
        assert n == 1


def test_closing_cancelling_and_losing_look_only_at_what_they_touch() -> None:
    s = cpu_backlog(LONG)
    s.handle(ev.NodeJoined("n2", cpus=tuple(range(4)), numa=(tuple(range(4)),), mem_mib=1_000_000), 1.0)
    no_walks(s)
    out = s.handle(ev.SandboxClosed("b5"), 6.0)
    closed = {c.action_id for c in out if isinstance(c, cmd.Reject)}
    assert closed and all(s.status_of(a) is None for a in closed)
    out = s.handle(ev.ActionCancelled("q1"), 6.0)
    assert [c.code for c in out if isinstance(c, cmd.Reject)] == ["CANCELLED"]
    out = s.handle(ev.ClientGone("c3"), 6.0)
    assert any(isinstance(c, (cmd.DestroySandbox, cmd.Reject)) for c in out)
    # n1 and n2 are alike: losing n1 leaves every shape of demand a home, so only the
    # actions of the sandboxes that lived on n1 go (SANDBOX_LOST)
    out = s.handle(ev.NodeLost("n1"), 7.0)
    codes = {c.code for c in out if isinstance(c, cmd.Reject)}
    assert codes <= {"SANDBOX_LOST"} and "SANDBOX_LOST" in codes


def test_losing_the_largest_node_judges_every_queued_action_again() -> None:
    s = Scheduler(CoreConfig())
    s.handle(node("small", 2), 0.0)
    s.handle(node("large", 8), 0.0)
    s.handle(ev.SandboxOpened("hog", client="c", mem_mib=10), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("hold", "hog", 8, t_ori=9.0)), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("hold2", "hog", 2, t_ori=9.0)), 0.0)
    s.handle(ev.SandboxOpened("wide", client="c", mem_mib=10), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("wants4", "wide", 4, t_ori=1.0)), 0.0)
    assert s.status_of("wants4") is not None and s.status_of("wants4").code is Code.UNSCHEDULABLE
    out = s.handle(ev.NodeLost("large"), 1.0)
    rejected = {c.action_id: c.code for c in out if isinstance(c, cmd.Reject)}
    assert rejected.get("wants4") == "NO_CAPACITY"


def test_a_head_its_sandboxs_node_can_never_hold_is_rejected_not_waited_for() -> None:
    # "a" and "b" queue before their sandbox has a node; "a" then lands on the small node,
    # whose 2 cores can never run "b": it is rejected when it reaches the head rather than
    # block that node's queue for good
    s = Scheduler(CoreConfig())
    s.handle(node("big", 8, mem=1000), 0.0)
    s.handle(node("small", 2, mem=64_000), 0.0)
    s.handle(ev.SandboxOpened("x", client="c", mem_mib=10), 0.0)
    s.handle(ev.SandboxOpened("y", client="c", mem_mib=10), 0.0)
    s.handle(ev.SandboxOpened("filler", client="c", mem_mib=10), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("fill", "filler", 2, t_ori=5.0)), 0.0)  # takes small (more memory)
    s.handle(ev.SandboxOpened("filler2", client="c", mem_mib=10), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("fill2", "filler2", 8, t_ori=5.0)), 0.0)
    assert {"fill", "fill2"} <= set(s.running)
    s.handle(ev.ActionSubmitted(exec_spec("a", "x", 1, t_ori=1.0)), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("b", "x", 4, t_ori=1.0)), 0.0)
    s.handle(ev.ActionSubmitted(exec_spec("c", "y", 1, t_ori=1.0)), 0.0)
    out = s.handle(ev.ActionFinished("fill"), 1.0)  # small frees up: "a" (then "c") land there
    assert {c.action_id: c.node for c in out if isinstance(c, cmd.Spawn)}.get("a") == "small"
    out += s.handle(ev.ActionFinished("a"), 2.0)
    rejected = {c.action_id: c.code for c in out if isinstance(c, cmd.Reject)}
    assert rejected.get("b") == "NO_CAPACITY"
    assert s.status_of("b") is None
