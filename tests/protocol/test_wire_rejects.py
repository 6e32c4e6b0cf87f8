"""Every way a frame list can be wrong raises ProtocolError with the right kind (docs/protocol.md,
"Decoding rules")."""

from __future__ import annotations

import struct

import msgpack
import pytest

from tangram import protocol as p
from tangram.errors import ErrorCode, ProtocolError, ProtocolErrorKind

DECODE, SCHEMA, VERSION, TOO_LARGE = (
    ProtocolErrorKind.DECODE,
    ProtocolErrorKind.SCHEMA,
    ProtocolErrorKind.VERSION,
    ProtocolErrorKind.TOO_LARGE,
)


def frames_for(cls: type[p.Message], body: object, *blobs: bytes, raw: bytes | None = None) -> list[bytes]:
    packed = raw if raw is not None else msgpack.packb(body, use_bin_type=True)
    return [p.TAG, bytes([cls.TYPE]), struct.pack(">Q", 1), packed, *blobs]


def rejects(frames: object, kind: ProtocolErrorKind, match: str | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        p.decode(frames)  # type: ignore[arg-type]
    assert info.value.kind is kind, str(info.value)
    return info.value


EXEC = {"sandbox": "sb-1", "cmd": "ls", "cpus_min": 1, "cpus_max": 2}


def exec_with(**changes: object) -> list[bytes]:
    return frames_for(p.Exec, {**EXEC, **changes})


def test_valid_baseline_decodes() -> None:
    assert p.decode(exec_with()).msg == p.Exec("sb-1", "ls", 1, 2)


# ---------------------------------------------------------------- framing


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "got 0"),
        ([p.TAG, b"\x24", b"\x00" * 8], "got 3"),
        ([p.TAG] * 1000, "got 1000"),
        (b"TGR1\x24", "expected a list"),
        ("not frames", "expected a list"),
        ([p.TAG, b"\x24", b"\x00" * 8, "str body"], "expected bytes"),
        ([p.TAG, b"\x24", b"\x00" * 8, None], "expected bytes"),
    ],
)
def test_bad_frame_lists(frames: object, match: str) -> None:
    rejects(frames, SCHEMA, match)


@pytest.mark.parametrize("tag", [b"XXXX", b"", b"TGR", b"TGR1x", b"tgr1", b"TGRx"])
def test_wrong_tag(tag: bytes) -> None:
    frames = exec_with()
    frames[0] = tag
    rejects(frames, SCHEMA, "bad tag")


@pytest.mark.parametrize("tag", [b"TGR2", b"TGR0", b"TGR9"])
def test_other_major_tag_is_a_version_error(tag: bytes) -> None:
    frames = exec_with()
    frames[0] = tag
    exc = rejects(frames, VERSION, "peer speaks protocol")
    assert exc.code is ErrorCode.VERSION
    assert exc.hint


@pytest.mark.parametrize("kind", [b"\xff", b"\x00", b"\x10", b"", b"\x24\x24"])
def test_unknown_type_byte(kind: bytes) -> None:
    frames = exec_with()
    frames[1] = kind
    rejects(frames, SCHEMA, "unknown message type")


@pytest.mark.parametrize("rid", [b"", b"\x00" * 7, b"\x00" * 9])
def test_short_or_long_request_id(rid: bytes) -> None:
    frames = exec_with()
    frames[2] = rid
    rejects(frames, SCHEMA, "request id")


def test_request_id_over_int64() -> None:
    frames = exec_with()
    frames[2] = struct.pack(">Q", 2**63)
    rejects(frames, SCHEMA, "request id")


def test_too_many_blobs() -> None:
    rejects([*exec_with(), *[b"b"] * (p.MAX_BLOBS + 1)], SCHEMA)


@pytest.mark.parametrize("cls", [p.Put, p.Call, p.PutFile, p.Invoke])
def test_missing_required_blob(cls: type[p.Message]) -> None:
    from protocol_samples import SAMPLES

    msg, _ = SAMPLES[cls]
    frames = p.encode(msg, 1, [b"x"])
    rejects(frames[:4], SCHEMA, "needs 1 blob")


# ---------------------------------------------------------------- sizes


def test_body_over_one_mib() -> None:
    rejects(frames_for(p.Exec, None, raw=b"\x00" * (p.MAX_BODY_BYTES + 1)), TOO_LARGE)


def test_message_over_max_bytes() -> None:
    rejects([*exec_with(), bytes(p.MAX_MESSAGE_BYTES)], TOO_LARGE)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(ProtocolError) as info:
        p.encode(p.Put("sb", "/a"), 1, [bytes(p.MAX_MESSAGE_BYTES)])
    assert info.value.kind is TOO_LARGE
    with pytest.raises(ProtocolError) as info:
        p.encode(p.Exec("../x", "ls", 1, 1), 1)
    assert info.value.kind is SCHEMA
    with pytest.raises(ProtocolError):
        p.encode(p.Cancel(1), -1)
    with pytest.raises(ProtocolError):
        p.encode(p.Cancel(1), True)
    with pytest.raises(TypeError):
        p.encode(object(), 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- msgpack


GOOD = msgpack.packb(EXEC)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(GOOD[:-1], id="truncated"),
        pytest.param(GOOD[:1], id="truncated-header"),
        pytest.param(b"", id="empty"),
        pytest.param(GOOD + b"\x00", id="trailing-bytes"),
        pytest.param(GOOD + GOOD, id="two-bodies"),
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"\x81\xa3cmd\xa2\xff\xfe", id="invalid-utf8"),
        pytest.param(b"\x81\xa3cmd\xd4\x01\x00", id="ext-type"),
        pytest.param(b"\x81\xa3cmd\xd6\xff\x00\x00\x00\x00", id="timestamp-ext"),
        pytest.param(b"\x81\xa3cmd\xc4\x02ab", id="bin-in-body"),
        pytest.param(b"\x81\x01\x02", id="int-key"),
        pytest.param(b"\xdd\xff\xff\xff\xff", id="huge-array-header"),
        pytest.param(b"\xdf\xff\xff\xff\xff", id="huge-map-header"),
        pytest.param(b"\xdb\xff\xff\xff\xff", id="huge-str-header"),
        pytest.param(b"\xc6\xff\xff\xff\xff", id="huge-bin-header"),
        pytest.param(b"\x91" * 5000 + b"\xc0", id="deep-nesting"),
        pytest.param(b"\x81\xa3cmd" + msgpack.packb("x" * (p.MAX_TEXT + 1)), id="string-over-limit"),
    ],
)
def test_bad_msgpack_is_a_decode_error(raw: bytes) -> None:
    rejects(frames_for(p.Exec, None, raw=raw), DECODE)


@pytest.mark.parametrize("body", [[1, 2], "map?", 5, None, True, 1.5])
def test_body_must_be_a_map(body: object) -> None:
    rejects(frames_for(p.Exec, body), SCHEMA, "body must be a map")


# ---------------------------------------------------------------- fields


@pytest.mark.parametrize("name", ["sandbox", "cmd", "cpus_min", "cpus_max"])
def test_missing_required_field(name: str) -> None:
    body = {k: v for k, v in EXEC.items() if k != name}
    rejects(frames_for(p.Exec, body), SCHEMA, rf"Exec\.{name}: missing")


def test_empty_body_for_fieldless_message_is_fine() -> None:
    assert p.decode(frames_for(p.Ack, {})).msg == p.Ack()
    rejects(frames_for(p.Result, {}), SCHEMA, "missing")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("cpus_min", True, "expected int, got bool"),
        ("cpus_min", False, "expected int, got bool"),
        ("cpus_min", 1.0, "expected int, got float"),
        ("cpus_min", "1", "expected int, got str"),
        ("cpus_min", None, "expected int"),
        ("cpus_min", [1], "expected int"),
        ("budget_ms", 2**63, "out of range"),
        ("budget_ms", 2**64 - 1, "out of range"),
        ("budget_ms", -1, "out of range"),
        ("cpus_min", 0, "out of range"),
        ("cpus_max", 10**12, "out of range"),
        ("duration_hint_s", float("nan"), "not a finite"),
        ("duration_hint_s", float("inf"), "not a finite"),
        ("duration_hint_s", float("-inf"), "not a finite"),
        ("duration_hint_s", -1.0, "out of range"),
        ("duration_hint_s", True, "expected float, got bool"),
        ("duration_hint_s", "1.0", "expected float"),
        ("duration_hint_s", 2**63, "out of range"),
        ("idempotent", 1, "expected bool"),
        ("idempotent", "true", "expected bool"),
        ("cmd", 5, "expected str"),
        ("cmd", "ls\x00", "NUL"),
        ("env", [["A", "b"]], "expected map"),
        ("env", {"LD_PRELOAD": "/x.so"}, "environment name"),
        ("env", {"A=B": "c"}, "environment name"),
        ("env", {"A\nB": "c"}, "environment name"),
        ("env", {"": "c"}, "environment name"),
        ("env", {"A": 1}, "expected str"),
        ("env", {f"K{i}": "v" for i in range(257)}, "more than 256"),
        ("elastic", 3, "expected"),
        ("elastic", "a;b", "not a valid id"),
        ("efficiency", {"0": 1.0}, "unit count"),
        ("efficiency", {"x": 1.0}, "unit count"),
        ("efficiency", {"2": float("nan")}, "not a finite"),
        ("efficiency", {"2": "high"}, "expected float"),
    ],
)
def test_wrong_field_values(field: str, value: object, match: str) -> None:
    rejects(exec_with(**{field: value}), SCHEMA, match)


def test_cross_field_rule() -> None:
    rejects(exec_with(cpus_min=4, cpus_max=2), SCHEMA, "below cpus_min")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../x",
        "..",
        "a..b",
        ".hidden",
        "-rf",
        "a/b",
        "a;b",
        "a b",
        "$(id)",
        "`id`",
        "a\nb",
        "a\n",
        "a\x00b",
        "a\tb",
        "é",
        "x" * 65,
        "x" * 10_000,
    ],
    ids=lambda s: ascii(s)[:20],
)
def test_bad_ids(bad: str) -> None:
    rejects(exec_with(sandbox=bad), SCHEMA, r"Exec\.sandbox")
    rejects(frames_for(p.Release, {"lease": bad}), SCHEMA, r"Release\.lease")


@pytest.mark.parametrize("good", ["sb-1", "rm-7b", "qwen2.5:7b", "_x", "A_b.c-d:e", "x" * 64, "0"])
def test_good_ids(good: str) -> None:
    assert p.decode(exec_with(sandbox=good)).msg.sandbox == good  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "bad", ["", "../etc/passwd", "/a/../b", "/a/..", "..", "/a\x00b", "x" * 4097], ids=lambda s: ascii(s)[:20]
)
def test_bad_paths(bad: str) -> None:
    rejects(frames_for(p.Get, {"sandbox": "sb", "path": bad}), SCHEMA, r"Get\.path")


@pytest.mark.parametrize("good", ["/repo/patch.diff", "rel/a.txt", "/a/..b/c..", "/a b/ü.txt"])
def test_good_paths(good: str) -> None:
    assert p.decode(frames_for(p.Get, {"sandbox": "sb", "path": good})).msg == p.Get("sb", good)


@pytest.mark.parametrize("image", ["a;b", "-x", "../img", "img name", "a\nb", "x" * 256])
def test_bad_images(image: str) -> None:
    body = {"sandbox": "sb", "image": image, "mem_mib": 1}
    rejects(frames_for(p.CreateSandbox, body), SCHEMA, "image")


def test_role_is_an_enum() -> None:
    body = {"role": "admin", "name": "n1", "major": 1, "minor": 0}
    rejects(frames_for(p.Hello, body), SCHEMA, "not one of agent, client, status")


@pytest.mark.parametrize(
    "value",
    [
        {"k": float("nan")},
        {"ok": 1, "k": float("-inf")},
        {"k": 2**63},
        {"ok": "fine", "k": 2**64 - 1},
        {"k": [float("inf")]},
        {"k": b"bytes"},
        {"k": "x\x00"},
        {"ok": 0.5, "k": {"inner": "\x00"}},
        {"": {"x" * 300: 1}},
    ],
)
def test_free_form_maps_are_checked(value: object) -> None:
    """A map of scalars (a result body) is checked value by value, at any depth; the error names the key."""
    with pytest.raises(ProtocolError) as info:
        p.decode(frames_for(p.Result, {"body": value}))
    assert info.value.kind in (SCHEMA, DECODE)
    if info.value.kind is SCHEMA and "k" in value:  # type: ignore[operator]
        assert "'k'" in str(info.value), str(info.value)


def test_free_form_nesting_is_bounded() -> None:
    deep: object = 1
    for _ in range(p.MAX_DEPTH + 2):
        deep = [deep]
    rejects(frames_for(p.Result, {"body": {"k": deep}}), SCHEMA, "nested deeper")


def test_error_codes_map_to_bad_request_or_version() -> None:
    assert ProtocolError(SCHEMA, "x").code is ErrorCode.BAD_REQUEST
    assert ProtocolError(DECODE, "x").code is ErrorCode.BAD_REQUEST
    assert ProtocolError(TOO_LARGE, "x").code is ErrorCode.BAD_REQUEST
    assert ProtocolError(VERSION, "x").code is ErrorCode.VERSION


def test_messages_do_not_echo_huge_hostile_values() -> None:
    exc = rejects(exec_with(sandbox="\n" * 5000), SCHEMA)
    assert len(str(exc)) < 200
    assert "\n" not in str(exc)
