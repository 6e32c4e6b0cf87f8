"""``Lane``'s chunk layout and ``Pending``'s defaults, pinned where the mutation run of
docs/testing.md found nothing that checked them (the FCFS order itself is test_queues.py's)."""

from __future__ import annotations

from test_queues import waiting

from tangram.core.queues import Lane, Pending
from tangram.core.resources import CPU

LOAD = Lane.LOAD


def _sizes(lane: Lane) -> list[int]:
    return [len(c) for c in lane._chunks]


def test_appends_fill_each_chunk_to_twice_the_load_before_opening_the_next():
    lane = Lane()
    n = 4 * LOAD + 100
    for s in range(n):
        lane.add(waiting(s))
    assert _sizes(lane) == [2 * LOAD, 2 * LOAD, 100]
    assert lane._maxes == [2 * LOAD - 1, 4 * LOAD - 1, n - 1]


def test_an_insert_that_fills_a_chunk_to_twice_the_load_splits_it_in_halves():
    lane = Lane()
    for s in range(0, 2 * (2 * LOAD - 1), 2):  # one chunk, one short of full
        lane.add(waiting(s))
    assert _sizes(lane) == [2 * LOAD - 1]
    lane.add(waiting(1))  # an insert (a seq below the last): the chunk reaches 2 * LOAD
    assert _sizes(lane) == [LOAD, LOAD]
    seqs = [w.seq for w in lane]
    assert seqs == sorted(seqs) and len(seqs) == 2 * LOAD
    assert lane._maxes == [lane._chunks[0][-1], lane._chunks[1][-1]]


def test_the_actions_behind_the_head_of_an_empty_lane_are_none():
    assert list(Lane().after_head()) == []
    lane = Lane()
    lane.add(waiting(3))
    assert list(lane.after_head()) == [] and lane.head().seq == 3


def test_a_cpu_action_added_without_a_node_joins_the_nodeless_queue():
    p = Pending()
    w = waiting(1, sandbox="s0")
    p.add(CPU, w)  # a sandbox not bound to a node yet
    assert p.cpu_queues() == [""]
    assert list(p.cpu_queue("")) == [w]
    p.bind("s0", "n1")
    assert p.cpu_queues() == ["n1"] and list(p.cpu_queue("n1")) == [w]
