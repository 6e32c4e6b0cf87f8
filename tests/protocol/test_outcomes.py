"""The typed action outcomes (tangram/outcomes.py): round trips, defaults, strict types, and the
docs table that lists their keys."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tangram import protocol as p
from tangram.errors import ProtocolError
from tangram.outcomes import CallOutcome, ExecOutcome

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_exec_outcome_round_trips_through_a_result_frame() -> None:
    out = ExecOutcome(exit_code=3, truncated=True, run_s=0.25, cores=(2, 3), action="x1", attempt=2, node="n1")
    env = p.decode(p.encode(p.Result(out.to_body()), 7, [b"out", b"err"]))
    assert ExecOutcome.from_body(env.msg.body) == out  # type: ignore[attr-defined]


def test_call_outcome_round_trips() -> None:
    out = CallOutcome(run_s=1.5, service="reward", gpus=(0, 1), loaded=True, queued_s=0.5)
    assert CallOutcome.from_body(out.to_body()) == out


def test_the_controller_adds_its_fields_to_the_body_without_a_second_outcome() -> None:
    out = ExecOutcome(exit_code=0, run_s=0.5, cores=(1,), node="agent")
    body = out.to_body(cores=[4, 5], dop=2, queued_s=0.25, node="n2")
    want = dataclasses.replace(out, cores=(4, 5), dop=2, queued_s=0.25, node="n2")
    assert ExecOutcome.from_body(body) == want
    assert out.to_body()["cores"] == [1]  # the outcome itself is unchanged; tuples travel as lists
    with pytest.raises(TypeError, match="gpus"):
        out.to_body(gpus=[0])  # a field of CallOutcome, not of ExecOutcome


def test_missing_keys_take_defaults_and_unknown_keys_are_ignored() -> None:
    out = ExecOutcome.from_body({"exit_code": 0, "some_future_key": [1, 2]})
    assert out == ExecOutcome(exit_code=0)
    assert ExecOutcome.from_body({}).exit_code == -1  # no exit code: not a success


def test_ints_are_accepted_as_floats_but_not_the_reverse() -> None:
    assert ExecOutcome.from_body({"run_s": 2}).run_s == 2.0
    with pytest.raises(ProtocolError, match=r"ExecOutcome\.exit_code: expected int, got float"):
        ExecOutcome.from_body({"exit_code": 0.0})


@pytest.mark.parametrize(
    ("key", "value"),
    [("exit_code", True), ("killed", 1), ("cores", [1, "2"]), ("node", 5), ("run_s", float("nan"))],
)
def test_a_wrong_type_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ProtocolError, match=key):
        ExecOutcome.from_body({key: value})


@pytest.mark.parametrize(("cls", "row"), [(ExecOutcome, "`EXEC`, `SPAWN`"), (CallOutcome, "`CALL`, `INVOKE`")])
def test_docs_list_every_outcome_key(cls: type, row: str) -> None:
    text = DOC.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row}"))
    listed = set(re.findall(r"`([a-z_]+)`", line.split("|")[2]))
    fields = {f.name for f in dataclasses.fields(cls)}
    assert fields == listed, (fields - listed, listed - fields)


@pytest.mark.parametrize(
    "msg",
    [
        p.Accepted(),
        p.Spawn("x1-ab", "sb-1", "pytest -q -n {dop}", [0, 3], 2, {"A": "b"}, 12.5, 1, 99, 3),
        p.Result(ExecOutcome(exit_code=0, cores=(1,), run_s=0.5, node="n1").to_body()),
        p.Result(CallOutcome(gpus=(0, 1), loaded=True).to_body()),
    ],
    ids=lambda m: m.NAME,
)
def test_encode_trusted_emits_what_encode_emits(msg: p.Message) -> None:
    blobs = [b"out", b"err"] if isinstance(msg, p.Result) else []
    trusted = p.encode_trusted(msg, 42, blobs)
    assert p.decode(trusted) == p.decode(p.encode(msg, 42, blobs))
