"""The controller's state file (tangram_cli/controller/ledger.py): replay, compaction, bad lines."""

from __future__ import annotations

import json
from pathlib import Path

from tangram_cli.controller import ledger as lg
from tangram_cli.controller.ledger import Ledger, load

A, B = b"\x01" * 16, b"\x02" * 16


class Wall:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_replay_keeps_live_sandboxes_answers_and_unanswered_runs(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=7, wall=wall)
    assert led.restore().empty
    led.opened("sb-1", A, "img", 256, 0)
    led.placed("sb-1", "n1")
    led.opened("sb-2", B, "", 0, 0)
    led.gone(["sb-2"])
    led.ran(A, 5, "exec")
    led.answered(A, 5, "exec", [b"frame", b"\x00\xff"])
    led.ran(A, 6, "exec", "n1", "x6")  # running when the controller died: no answer
    led.answered(B, 9, "get", [b"not kept"])  # gets and puts are not kept: they can be repeated
    r = load(str(path), now=wall())
    assert list(r.sandboxes) == ["sb-1"] and r.sandboxes["sb-1"].node == "n1"
    assert r.sandboxes["sb-1"].ident == A and r.sandboxes["sb-1"].mem_mib == 256
    assert r.answers == {(A, 5): ("exec", 1000.0, [b"frame", b"\x00\xff"])}
    assert r.ran == {(A, 6): ("exec", "n1", "x6")}
    assert r.epochs == 1 and r.skipped == 0


def test_restore_compacts_under_a_new_header_and_appends_after_it(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    for i in range(50):
        led.opened(f"sb-{i}", A, "", 0, 0)
        led.gone([f"sb-{i}"])
    led.opened("sb-live", A, "", 0, 0)
    led.close()
    assert len(path.read_text().splitlines()) == 1 + 101
    second = Ledger(str(path), epoch=2, wall=wall)
    r = second.restore()
    assert list(r.sandboxes) == ["sb-live"]
    lines = _lines(path)
    assert lines[0]["journal"] == "tangram-state" and lines[0]["epoch"] == 2
    assert [x.get("sb") for x in lines[1:]] == ["sb-live"]  # the 50 closed ones are gone
    second.ran(B, 1, "call")
    second.close()
    assert _lines(path)[-1] == {
        "f": "run",
        "ident": B.hex(),
        "rid": 1,
        "kind": "call",
        "node": "",
        "action": "",
    }
    assert load(str(path), now=wall()).ran == {(B, 1): ("call", "", "")}


def test_answers_expire_with_the_reply_cache(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    led.answered(A, 1, "exec", [b"old"])
    wall.t += lg.ANSWER_TTL_S - 1
    led.answered(A, 2, "exec", [b"young"])
    led.close()
    wall.t += 2
    r = load(str(path), now=wall())
    assert set(r.answers) == {(A, 2)}


def test_a_torn_last_line_is_skipped_and_counted(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    led.opened("sb-1", A, "", 0, 0)
    led.close()
    with open(path, "a") as fh:
        fh.write('{"f":"open","sb":"sb-2","ident":"')  # a write cut short
    r = load(str(path), now=wall())
    assert list(r.sandboxes) == ["sb-1"] and r.skipped == 1


def test_an_answer_too_large_is_kept_as_finished_without_its_result(tmp_path: Path) -> None:
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    led.answered(A, 3, "exec", [b"x" * (lg.MAX_ANSWER_BYTES + 1)])
    led.close()
    assert load(str(path), now=wall()).answers == {(A, 3): ("exec", 1000.0, None)}
    assert path.stat().st_size < 4096


def test_the_file_is_compacted_when_it_grows_past_the_limit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lg, "COMPACT_BYTES", 4096)
    path, wall = tmp_path / "state.jsonl", Wall()
    led = Ledger(str(path), epoch=1, wall=wall)
    led.restore()
    for i in range(200):
        led.opened(f"sb-{i}", A, "", 0, 0)
        led.gone([f"sb-{i}"])
    led.opened("sb-last", A, "", 0, 0)
    led.close()
    assert path.stat().st_size <= 4096 + 200
    assert list(load(str(path), now=wall()).sandboxes) == ["sb-last"]


def test_without_a_path_nothing_is_written(tmp_path: Path) -> None:
    led = Ledger(None, epoch=1)
    assert led.restore().empty and not led.enabled
    led.opened("sb-1", A, "", 0, 0)
    led.ran(A, 1, "exec")
    led.answered(A, 1, "exec", [b"x"])
    led.close()
    assert led.written == 0 and list(tmp_path.iterdir()) == []
