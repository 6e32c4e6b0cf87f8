"""The state file's API key-pool facts (ledger.py): a lease's key and charge, token reports,
cool-downs, their compaction to the last minute on rewrite, and the `KeyUsed` events a
restarted controller makes of them (recovery.py `key_events`)."""

from __future__ import annotations

import json
from pathlib import Path

from tangram.core import events as ev
from tangram_cli.controller.ledger import ChargeFact, LeaseFact, Ledger, load
from tangram_cli.controller.recovery import key_events

A = b"\x01" * 16


class Wall:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _granted(led: Ledger, action: str, key: str, t: float, tokens: int = 0) -> None:
    led.lease(LeaseFact(action, "llm", 1, A, 1, t + 300.0, key), ChargeFact("llm", key, t, 1, tokens))


def test_replay_keeps_each_key_s_minute_its_cool_down_and_the_key_a_live_lease_holds(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    _granted(led, "l0", "a", 900.0)  # more than a minute before `now`: no longer counts
    _granted(led, "l1", "a", 950.0, tokens=500)
    _granted(led, "l2", "b", 990.0)
    led.charged("l1", 120)  # its holder's report
    led.lease_end("l1")
    led.cooled("llm", "a", 1030.0)
    led.cooled("llm", "b", 999.0)  # over by `now`
    led.close()
    r = load(str(path), now=1000.0)
    assert list(r.leases) == ["l0", "l2"] and r.leases["l2"].key == "b"
    assert r.charges == {
        "l1": ChargeFact("llm", "a", 950.0, 1, 120),
        "l2": ChargeFact("llm", "b", 990.0, 1, 0),
    }
    assert r.cools == {("llm", "a"): 1030.0}
    assert list(key_events(r, {"l2"}, 1000.0)) == [
        ev.KeyUsed("llm", "a", ((50.0, 1, 120, ""),), 30.0),
        ev.KeyUsed("llm", "b", ((10.0, 1, 0, "l2"),), 0.0),
    ]


def test_a_rewrite_keeps_one_line_per_key_with_the_last_minute_only(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    for i in range(30):  # a charge every 5 s over 150 s: only the last minute's stay
        wall.t = 1000.0 + 5 * i
        _granted(led, f"l{i}", "a", wall.t)
        led.lease_end(f"l{i}")
    led.cooled("llm", "b", wall.t + 20.0)
    led.close()
    wall.t += 1.0
    second = Ledger(str(path), epoch=2, wall=wall)
    r = second.restore()
    assert len(r.charges) == 12 and min(c.t for c in r.charges.values()) > wall.t - 60.0
    keys = [json.loads(x) for x in path.read_text().splitlines() if '"f":"keys"' in x]
    got = [(k["key"], len(k["charges"]), k["cool"]) for k in keys]
    assert got == [("a", 12, 0.0), ("b", 0, wall.t + 19.0)]
    second.close()
    assert load(str(path), now=wall.t).charges == r.charges  # the rewritten file replays the same


def test_bad_key_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    path.write_text(
        '{"f":"keys","api":"llm","key":"a","cool":0,"charges":[["l1",990.0,1]]}\n'  # a row too short
        '{"f":"cool","api":"llm","key":"a"}\n'  # no until
        '{"f":"tok","action":"nobody","tok":5}\n'  # an unknown lease's report: nothing to change
    )
    r = load(str(path), now=1000.0)
    assert r.skipped == 2 and r.charges == {} and r.cools == {}
