"""Every message type survives encode -> decode with non-default values and its blobs."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
from protocol_samples import SAMPLES

from tangram import protocol as p

ALL = sorted(p.MESSAGE_TYPES.values(), key=lambda cls: cls.TYPE)


def test_every_message_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(ALL)


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.NAME)
def test_round_trip(cls: type[p.Message]) -> None:
    msg, blobs = SAMPLES[cls]
    frames = p.encode(msg, 2**63 - 1, blobs)
    assert all(isinstance(f, bytes) for f in frames)
    env = p.decode(frames)
    assert env == p.Envelope(cls.TYPE, 2**63 - 1, msg, blobs)
    assert type(env.msg) is cls


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.NAME)
def test_samples_set_every_default_field(cls: type[p.Message]) -> None:
    msg, _ = SAMPLES[cls]
    for f in dataclasses.fields(msg):
        if f.default is not dataclasses.MISSING:
            assert getattr(msg, f.name) != f.default, f"{cls.NAME}.{f.name} left at its default"
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(msg, f.name) != f.default_factory(), f"{cls.NAME}.{f.name} left at its default"


def test_frame_layout() -> None:
    frames = p.encode(p.Cancel(5), 258, [b"x"])
    assert frames[0] == b"TGR1" == p.TAG
    assert frames[1] == bytes([p.Cancel.TYPE])
    assert frames[2] == struct.pack(">Q", 258)
    assert msgpack.unpackb(frames[3]) == {"target_request_id": 5}
    assert frames[4:] == [b"x"]


def test_float_fields_accept_ints_and_decode_as_float() -> None:
    env = p.decode(p.encode(p.Spawn("a", "s", "true", [0], 1, {}, 5), 1))
    assert isinstance(env.msg, p.Spawn)
    assert env.msg.timeout_s == 5.0
    assert isinstance(env.msg.timeout_s, float)


def test_defaults_fill_in_for_an_older_peer() -> None:
    frames = p.encode(p.Exec("sb", "ls", 1, 1), 1)
    frames[3] = msgpack.packb({"sandbox": "sb", "cmd": "ls", "cpus_min": 1, "cpus_max": 1})
    assert p.decode(frames).msg == p.Exec("sb", "ls", 1, 1)


def test_unknown_fields_are_ignored_for_a_newer_peer() -> None:
    frames = p.encode(p.Lease("search"), 1)
    frames[3] = msgpack.packb({"api": "search", "units": 2, "added_in_1_1": {"x": [1, 2]}})
    assert p.decode(frames).msg == p.Lease("search", units=2)


def test_memoryview_and_bytearray_frames_decode() -> None:
    frames = p.encode(p.Put("sb", "/a"), 3, [b"data"])
    env = p.decode([memoryview(frames[0]), bytearray(frames[1]), *frames[2:]])
    assert env.blobs == (b"data",)


def test_error_message_carries_exceptions_both_ways() -> None:
    from tangram import errors as e

    wire = p.decode(p.encode(p.Error.from_exception(e.RemoteError("raised", detail="tb")), 1)).msg
    assert isinstance(wire, p.Error)
    assert (wire.code, wire.retryable, wire.detail) == ("REMOTE_ERROR", False, "tb")
    back = wire.to_exception()
    assert type(back) is e.RemoteError
    assert (back.message, back.detail) == ("raised", "tb")

    bug = p.Error.from_exception(KeyError("secret internals"))
    assert (bug.code, bug.retryable) == ("INTERNAL", False)
    assert "secret" not in bug.message

    bad = p.Error.from_exception(e.ProtocolError(e.ProtocolErrorKind.SCHEMA, "Exec.cmd: missing"))
    assert bad.code == "BAD_REQUEST"
    assert bad.message == "E_SCHEMA: Exec.cmd: missing"
    assert type(bad.to_exception()) is e.BadRequest


def test_version_problem() -> None:
    assert p.version_problem(p.Hello("client", "w1", 1, 7)) is None
    reason = p.version_problem(p.Hello("agent", "n1", 2, 0))
    assert reason == "agent speaks 2, controller 1: run tangram up"


def test_type_codes_are_unique_bytes() -> None:
    codes = [cls.TYPE for cls in ALL]
    assert len(codes) == len(set(codes))
    assert all(0 < c < 256 for c in codes)
    assert p.type_code(p.Hello) == p.type_code(SAMPLES[p.Hello][0]) == 0x01
