"""A pickle payload whose `__reduce__` would write a canary file is refused, and never runs.

This test file is the one place that imports pickle: to build the hostile payload.
"""

from __future__ import annotations

import pathlib
import pickle
import struct

import pytest

from tangram import protocol as p
from tangram.errors import ProtocolError, ProtocolErrorKind


class Canary:
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.write_text, (self.path, "pwned"))


def payloads(canary: pathlib.Path) -> list[bytes]:
    evil = Canary(canary)
    return [pickle.dumps(evil, protocol=n) for n in range(pickle.HIGHEST_PROTOCOL + 1)]


def test_the_payload_really_is_hostile(tmp_path: pathlib.Path) -> None:
    proof = tmp_path / "proof"
    pickle.loads(payloads(proof)[-1])
    assert proof.read_text() == "pwned"


@pytest.mark.parametrize("cls", [p.Exec, p.Call, p.Hello, p.Result, p.Spawn])
def test_pickle_body_is_a_decode_error_and_never_runs(cls: type[p.Message], tmp_path: pathlib.Path) -> None:
    canary = tmp_path / "canary"
    for payload in payloads(canary):
        frames = [p.TAG, bytes([cls.TYPE]), struct.pack(">Q", 1), payload, b"blob"]
        with pytest.raises(ProtocolError) as info:
            p.decode(frames)
        assert info.value.kind in (ProtocolErrorKind.DECODE, ProtocolErrorKind.SCHEMA)
    assert not canary.exists()


def test_pickle_in_a_blob_stays_bytes(tmp_path: pathlib.Path) -> None:
    canary = tmp_path / "canary"
    payload = payloads(canary)[-1]
    env = p.decode(p.encode(p.Call("rm-7b"), 1, [payload]))
    assert env.blobs == (payload,)
    assert not canary.exists()


def test_pickle_as_a_whole_message(tmp_path: pathlib.Path) -> None:
    canary = tmp_path / "canary"
    for payload in payloads(canary):
        with pytest.raises(ProtocolError):
            p.decode([payload])
        with pytest.raises(ProtocolError):
            p.decode([payload[:4], payload[4:5], payload[5:13], payload[13:]])
    assert not canary.exists()
