from __future__ import annotations

import io

import pytest

from tangram.clock import VirtualClock, WallClock
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Elasticity, Kind
from tangram.core.resources import CPU, Demand
from tangram.journal import Journal, diff, encode, read


def _spec(aid: str = "a") -> ActionSpec:
    return ActionSpec(
        aid, Kind.EXEC, ((CPU, Demand.range(1, 4)),), elasticity=Elasticity.amdahl(0.1), t_ori=1 / 3
    )


def test_encoding_is_canonical_and_rounds_floats():
    a = encode(ev.ActionSubmitted(_spec()))
    assert a["type"] == "ActionSubmitted"
    assert a["spec"]["kind"] == "exec"
    assert a["spec"]["t_ori"] == 0.333333333
    assert a["spec"]["demand"] == [["cpu", {"type": "Demand", "lo": 1, "hi": 4, "choices": []}]]
    j = Journal(source="test")
    j.append(0.1 + 0.2, ev.Tick(), [cmd.Done("a", True)])
    line = j.lines[1]
    assert (
        line == '{"commands":[{"action_id":"a","ok":true,"reason":"","type":"Done"}],'
        '"event":{"type":"Tick"},"seq":1,"t":0.3}'
    )


def test_write_read_round_trip_and_diff(tmp_path):
    p = tmp_path / "j.jsonl"
    j = Journal.to_path(p, source="test", seed=3)
    j.append(1.0, ev.ActionSubmitted(_spec("a")), [cmd.Spawn("a", "n", "sb", (0, 1), 2, 1.5)])
    j.append(2.5, ev.ActionFinished("a"), [cmd.Done("a", True)])
    j.close()
    header, records = read(p)
    assert header == {"journal": "tangram", "version": 1, "source": "test", "seed": 3}
    assert [r["seq"] for r in records] == [1, 2]
    assert records[0]["commands"][0]["cores"] == [0, 1]
    assert diff(records, records) is None
    other = [dict(records[0]), dict(records[1], t=2.6)]
    d = diff(records, other)
    assert d is not None
    assert d.index == 1
    assert d.a["t"] == 2.5
    assert d.b["t"] == 2.6
    d = diff(records, records[:1])
    assert d is not None
    assert d.index == 1
    assert d.b is None


def test_stream_and_memory_journals_agree():
    buf = io.StringIO()
    a, b = Journal(buf, source="x"), Journal(source="x")
    for j in (a, b):
        j.append(1.0, ev.Tick(), [])
    assert buf.getvalue() == b.text()


def test_read_rejects_a_non_journal():
    with pytest.raises(ValueError, match="not a tangram journal"):
        read(['{"x": 1}'])


def test_virtual_clock_moves_forward_only():
    c = VirtualClock()
    c.advance_to(2.0)
    assert c.now() == 2.0
    assert c.until(5.0) == 3.0
    assert c.until(None) is None
    assert c.until(1.0) == 0.0
    with pytest.raises(ValueError, match="backwards"):
        c.advance_to(1.0)
    w = WallClock()
    assert 0.0 <= w.now() < 5.0
