"""Fuzz: `decode` returns an Envelope or raises ProtocolError, never anything else."""

from __future__ import annotations

import struct

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_samples import SAMPLES

from tangram import protocol as p
from tangram.errors import ProtocolError

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_refuses(frames: object) -> p.Envelope | None:
    try:
        return p.decode(frames)  # type: ignore[arg-type]
    except ProtocolError:
        return None


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=14))
def test_arbitrary_frames(frames: list[bytes]) -> None:
    decodes_or_refuses(frames)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_as_one_frame_or_split(data: bytes) -> None:
    decodes_or_refuses([data])
    decodes_or_refuses([data[:4], data[4:5], data[5:13], data[13:]])


def _frames_with_body(type_code: int, body: bytes, blobs: list[bytes]) -> list[bytes]:
    return [p.TAG, bytes([type_code]), struct.pack(">Q", 7), body, *blobs]


TYPE_CODES = st.sampled_from(sorted(p.MESSAGE_TYPES))


@FUZZ
@given(TYPE_CODES, st.binary(max_size=512), st.lists(st.binary(max_size=8), max_size=3))
def test_valid_header_random_body(type_code: int, body: bytes, blobs: list[bytes]) -> None:
    decodes_or_refuses(_frames_with_body(type_code, body, blobs))


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=80)
    | st.binary(max_size=16)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def _field_names() -> list[str]:
    names = {name for cls in p.MESSAGE_TYPES.values() for name in cls._checkers}
    return sorted(names)


@FUZZ
@given(TYPE_CODES, st.dictionaries(st.sampled_from(_field_names()) | st.text(max_size=8), VALUES, max_size=8))
def test_valid_header_structured_body(type_code: int, body: dict[str, object]) -> None:
    env = decodes_or_refuses(_frames_with_body(type_code, msgpack.packb(body, use_bin_type=True), [b"x"]))
    if env is not None:  # what decodes re-encodes to something that decodes to the same message
        assert p.decode(p.encode(env.msg, env.request_id, env.blobs)) == env


@FUZZ
@given(
    st.sampled_from(sorted(SAMPLES, key=lambda cls: cls.TYPE)),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=255),
)
def test_mutated_valid_messages(cls: type[p.Message], frame: int, pos: int, byte: int) -> None:
    msg, blobs = SAMPLES[cls]
    frames = p.encode(msg, 1, blobs)
    target = bytearray(frames[frame])
    if target:
        target[pos % len(target)] = byte
    frames[frame] = bytes(target)
    decodes_or_refuses(frames)
    decodes_or_refuses([*frames[:3], frames[3][: pos % (len(frames[3]) + 1)], *frames[4:]])
