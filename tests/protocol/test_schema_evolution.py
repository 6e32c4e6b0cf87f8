"""Guards for protocol compatibility: stable type codes, and new fields always have defaults.

Minor versions only add fields, and a decoder fills in what an older peer left out, so every
field added after protocol 1.0 needs a default. `_required` lists the 1.0 fields without one and
is frozen: these snapshots change only with a new protocol major.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import pytest

from tangram import protocol as p

V1_TYPES = {
    0x01: "Hello",
    0x02: "Welcome",
    0x03: "Reject",
    0x04: "Heartbeat",
    0x05: "Bye",
    0x06: "Ack",
    0x07: "Accepted",
    0x08: "Result",
    0x09: "Error",
    0x20: "SandboxOpen",
    0x21: "SandboxClose",
    0x22: "Put",
    0x23: "Get",
    0x24: "Exec",
    0x25: "Call",
    0x26: "Lease",
    0x27: "Release",
    0x28: "Cancel",
    0x40: "CreateSandbox",
    0x41: "DestroySandbox",
    0x42: "PutFile",
    0x43: "GetFile",
    0x44: "Cpuset",
    0x45: "Spawn",
    0x46: "Kill",
    0x47: "Prepare",
    0x48: "Load",
    0x49: "Evict",
    0x4A: "Invoke",
    0x4B: "Shutdown",
    0x60: "StatusReq",
    0x61: "Status",
}

V1_REQUIRED = {
    "Hello": ("role", "name", "major", "minor"),
    "Welcome": ("major", "minor", "controller_epoch"),
    "Reject": ("reason",),
    "Heartbeat": (),
    "Bye": (),
    "Ack": (),
    "Accepted": (),
    "Result": ("body",),
    "Error": ("code", "message", "retryable"),
    "SandboxOpen": (),
    "SandboxClose": ("sandbox",),
    "Put": ("sandbox", "path"),
    "Get": ("sandbox", "path"),
    "Exec": ("sandbox", "cmd", "cpus_min", "cpus_max"),
    "Call": ("service",),
    "Lease": ("api",),
    "Release": ("lease",),
    "Cancel": ("target_request_id",),
    "CreateSandbox": ("sandbox", "image", "mem_mib"),
    "DestroySandbox": ("sandbox",),
    "PutFile": ("sandbox", "path"),
    "GetFile": ("sandbox", "path"),
    "Cpuset": ("sandbox", "cores"),
    "Spawn": ("action", "sandbox", "cmd", "cores", "dop", "env", "timeout_s"),
    "Kill": ("action",),
    "Prepare": ("service", "spec"),
    "Load": ("service", "gpus"),
    "Evict": ("service", "gpus"),
    "Invoke": ("action", "service", "gpus", "timeout_s"),
    "Shutdown": (),
    "StatusReq": (),
    "Status": ("records",),
}

ALL = sorted(p.MESSAGE_TYPES.values(), key=lambda cls: cls.TYPE)


def without_default(cls: type[p.Message]) -> tuple[str, ...]:
    return tuple(
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def test_version_constants() -> None:
    assert (p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, p.TAG) == (1, 8, b"TGR1")
    assert (p.SESSIONS_MINOR, p.TOKEN_BYTES) == (3, 24)
    assert p.MAX_BODY_BYTES == 1 << 20
    assert p.MAX_MESSAGE_BYTES >= p.MAX_BODY_BYTES


def test_type_codes_never_change() -> None:
    for code, name in V1_TYPES.items():
        assert p.MESSAGE_TYPES[code].__name__ == name, f"type 0x{code:02x} was {name}"


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__name__)
def test_fields_after_1_0_have_defaults(cls: type[p.Message]) -> None:
    assert without_default(cls) == cls._required, (
        f"{cls.__name__}: fields without a default must be exactly `_required` {cls._required}; "
        "a field added after protocol 1.0 needs a default"
    )
    if cls.__name__ in V1_REQUIRED:
        assert cls._required == V1_REQUIRED[cls.__name__], (
            f"{cls.__name__}._required changed: that breaks peers of protocol 1.0"
        )
    else:  # a message type added in a later minor: old peers never send it, so anything goes
        assert cls.TYPE not in V1_TYPES


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__name__)
def test_required_fields_alone_decode(cls: type[p.Message]) -> None:
    from protocol_samples import SAMPLES

    msg, blobs = SAMPLES[cls]
    minimal = {name: getattr(msg, name) for name in cls._required}
    frames = p.encode(msg, 1, blobs)
    frames[3] = msgpack.packb(minimal, use_bin_type=True)
    env = p.decode(frames)
    defaults = dataclasses.replace(
        msg, **{f.name: getattr(cls(**minimal), f.name) for f in dataclasses.fields(msg)}
    )
    assert env.msg == defaults


def test_guard_catches_a_field_without_default() -> None:
    @dataclasses.dataclass(frozen=True)
    class Future(p.Message):
        _required = ("a",)
        a: int
        b: int  # added in 1.1 without a default: must be caught

    assert without_default(Future) != Future._required


def test_docs_list_every_message() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
    text = doc.read_text(encoding="utf-8")
    for cls in ALL:
        row = re.search(rf"^\| `0x{cls.TYPE:02X}` \| `{cls.NAME}` \| `{cls.__name__}` \|", text, re.MULTILINE)
        assert row, f"docs/protocol.md has no table row for 0x{cls.TYPE:02X} {cls.NAME} {cls.__name__}"
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            assert f"`{f.name}" in text[row.start() : text.index("\n", row.start())], (cls.__name__, f.name)
