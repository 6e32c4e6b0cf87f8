"""Tangram's one wire protocol: frames, message dataclasses, encode and decode. No I/O here.

A message is a list of ZeroMQ frames (the ROUTER adds the peer identity in front):

    [b"TGR1"] [type: 1 byte] [request id: u64 big-endian] [msgpack body] [blob 0] [blob 1] ...

Rules (docs/protocol.md has the table of every message):

1. The tag carries the protocol major; `Hello`/`Welcome` carry (major, minor). A different
   major is refused: `E_VERSION` on decode, `Reject` at the handshake (`version_problem`).
2. A body is a msgpack map of a frozen dataclass's fields. Decoding is strict: bounded sizes,
   no ext/bin types, no non-string keys, typed fields (a bool is not an int, ints fit int64,
   floats are finite), ids match `ID_PATTERN`. Unknown fields are ignored, so a minor version
   may add fields, and every field added after 1.0 must have a default (`_required` lists the
   1.0 fields without one; a test fails when another field has no default).
3. Bytes never travel in a body: file contents, stdin/stdout and call payloads are blob frames.
4. Every failure to decode raises `ProtocolError(kind, message)`; nothing else escapes
   `decode`. A controller replies `Error.from_exception(exc)` (BAD_REQUEST or VERSION).
5. Never pickle: bodies are msgpack, payloads are msgpack or raw bytes.
6. Sessions (1.3): `Welcome.session` gives a client its session token (`TOKEN_BYTES` bytes, hex in
   the body). Every later frame the client sends carries it right after the request id in frame 2
   (`encode(..., token=...)`, `Envelope.token`); the controller serves a sandbox, lease or request
   only to frames that carry the token of the session that created it (docs/protocol.md,
   "Sessions"). Replies and every other peer leave it out.
7. Batches (1.5): a `BATCH` message (type `BATCH`, request id 0, the sender's token if it has one)
   carries up to `BATCH_MAX` messages in exactly five frames: its body is a msgpack list of
   ``[type, request id, body map, [blob sizes]]``, one per message, and frame 4 holds the blobs
   of all of them end to end, in order (so a batch costs five frames however many messages and
   empty outputs it carries). Each item is checked as a message of its own (`decode_all`: an
   item that does not decode is a `BadItem`, the others stand); HELLO, WELCOME and REJECT never
   travel in one. A peer sends batches only to a peer that said minor >= `BATCH_MINOR`; `pack`
   builds them from the frames `encode` made.

Layout: this module holds the rules, the frame constants and the codec, and re-exports every
public name of the two modules behind it: `tangram.wire_checks` (limits, field constraints and
the checkers compiled from field annotations) and `tangram.wire_messages` (the field types, the
`Message` base, the type-code registry and one short dataclass per message type). Callers import
from here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgpack  # type: ignore[import-untyped]

from tangram.errors import ProtocolError, ProtocolErrorKind
from tangram.outcomes import CallOutcome, ExecOutcome
from tangram.wire_checks import (
    ID_PATTERN,
    INT64_MAX,
    INT64_MIN,
    JSON,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_KEY,
    MAX_STR,
    MAX_TEXT,
    SESSION_TOKEN_BYTES,
    Checker,
    Items,
    Range,
    Str,
    schema_error,
    show_value,
)
from tangram.wire_messages import (
    _BY_CODE,
    MESSAGE_TYPES,
    Accepted,
    Ack,
    Bye,
    Call,
    Cancel,
    Cores,
    Count,
    Cpuset,
    CreateSandbox,
    DestroySandbox,
    Env,
    EnvKey,
    Error,
    Evict,
    Exec,
    Free,
    FreeMap,
    Get,
    GetFile,
    Gpus,
    Heartbeat,
    Hello,
    Id,
    Image,
    Invoke,
    Kill,
    Labels,
    Lease,
    Load,
    Message,
    Name,
    Path,
    Positive,
    Prepare,
    Put,
    PutFile,
    Reject,
    Release,
    Result,
    SandboxClose,
    SandboxOpen,
    SandboxPool,
    Seconds,
    Shutdown,
    Spawn,
    Status,
    StatusReq,
    Text,
    Units,
    Welcome,
    type_code,
)

__all__ = [
    "BATCH_MINOR",
    "BATCH_MAX",
    "BATCH_BODY_BYTES",
    "BATCH",
    "ID_PATTERN",
    "INT64_MAX",
    "INT64_MIN",
    "JSON",
    "MAX_BLOBS",
    "MAX_BODY_BYTES",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "MAX_KEY",
    "MAX_MESSAGE_BYTES",
    "MAX_STR",
    "MAX_TEXT",
    "MESSAGE_TYPES",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "SESSIONS_MINOR",
    "STAGED_MINOR",
    "UNSTAGE_MINOR",
    "RESEND_MINOR",
    "TAG",
    "TOKEN_BYTES",
    "UNBATCHED",
    "Accepted",
    "Ack",
    "BadItem",
    "Bye",
    "Call",
    "CallOutcome",
    "Cancel",
    "Checker",
    "Cores",
    "Count",
    "Cpuset",
    "CreateSandbox",
    "DestroySandbox",
    "Env",
    "EnvKey",
    "Envelope",
    "Error",
    "Evict",
    "Exec",
    "ExecOutcome",
    "Free",
    "FreeMap",
    "Get",
    "GetFile",
    "Gpus",
    "Heartbeat",
    "Hello",
    "Id",
    "Image",
    "Invoke",
    "Items",
    "Kill",
    "Labels",
    "Lease",
    "Load",
    "Message",
    "Name",
    "Path",
    "Positive",
    "Prepare",
    "ProtocolError",
    "ProtocolErrorKind",
    "Put",
    "PutFile",
    "Range",
    "Reject",
    "Release",
    "Result",
    "SandboxClose",
    "SandboxOpen",
    "SandboxPool",
    "Seconds",
    "Shutdown",
    "Spawn",
    "Status",
    "StatusReq",
    "Str",
    "Text",
    "Units",
    "Welcome",
    "batch_frames",
    "decode",
    "decode_all",
    "is_batch",
    "encode",
    "encode_trusted",
    "chunks",
    "pack",
    "packed",
    "stamp",
    "as_resend",
    "type_code",
    "version_problem",
]

PROTOCOL_MAJOR = 1
# 1.1 Welcome.max_outstanding, 1.2 Welcome.durable, 1.3 sessions, 1.4 run vs total budgets, 1.5 batches,
# 1.6 staged starts (Spawn.after), 1.7 a staged start given back unstarted (ExecOutcome.unstaged)
PROTOCOL_MINOR = 8
SESSIONS_MINOR = 3  # the first minor whose clients carry session tokens; the controller refuses older ones
BATCH_MINOR = 5  # the first minor whose peers read (and may send) batches
STAGED_MINOR = 6  # the first minor whose agents start a Spawn(after=A) themselves when A ends
UNSTAGE_MINOR = 7  # the first minor whose controllers take a staged start back (ExecOutcome.unstaged)
RESEND_MINOR = 8  # the first minor whose controllers read the resend flag (`as_resend`)
BATCH = 0x0A  # the type code of a batch (rule 7); no message class: its body is a list, not a map
BATCH_MAX = 256  # messages in one batch
BATCH_BODY_BYTES = 2 * (1 << 20)  # the batch's body (the items' bodies together)
_BATCH_KIND = bytes((BATCH,))
UNBATCHED = frozenset({0x01, 0x02, 0x03})  # HELLO, WELCOME, REJECT: a connection's first words go alone
TOKEN_BYTES = SESSION_TOKEN_BYTES  # a session token: frame 2 is the request id, then this many bytes
TAG = b"TGR%d" % PROTOCOL_MAJOR
_TAG_PREFIX = b"TGR"

MAX_BODY_BYTES = 1 << 20  # one msgpack body
MAX_MESSAGE_BYTES = 64 << 20  # all frames of one message together; also zmq.MAXMSGSIZE (per frame)
MAX_BLOBS = 8
_HEADER = struct.Struct(">Q")
FLAG_RESEND = 0x01  # 1.8: frame 2's last byte after the session token on a resent request (`as_resend`)
_FLAGGED = _HEADER.size + TOKEN_BYTES + 1

_UNPACK_LIMITS: dict[str, int] = {
    "max_str_len": MAX_TEXT,
    "max_bin_len": 0,
    "max_array_len": MAX_ITEMS * 4,
    "max_map_len": MAX_ITEMS * 4,
    "max_ext_len": 0,
}


# ---------------------------------------------------------------- codec


@dataclass(frozen=True)
class Envelope:
    """One decoded message: its type code, request id, body, blob frames, and the session token
    that came with it (b"" when none did: replies, agents, clients before their Welcome)."""

    type: int
    request_id: int
    msg: Message
    blobs: tuple[bytes, ...] = ()
    token: bytes = b""
    resend: bool = False  # 1.8: a client library's copy of a request it sent before a `Welcome` (`as_resend`)


def _validate(
    cls: type[Message], values: Mapping[str, object], present: Callable[[str], bool]
) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, check, path, required in cls._fields:
        if present(name):
            out[name] = check(values[name], path)
        elif required:
            raise schema_error(path, "missing")
    return out


def _build(cls: type[Message], values: dict[str, object]) -> Message:
    try:
        msg = cls(**values)
    except TypeError as exc:  # a required field that `_required` forgot: still a schema error
        raise schema_error(cls.__name__, str(exc)) from None
    problem = msg._problem()
    if problem is not None:
        raise schema_error(cls.__name__, problem)
    return msg


def encode(msg: Message, request_id: int, blobs: Sequence[bytes] = (), token: bytes = b"") -> list[bytes]:
    """Frames for `msg`, with the client's session `token` (rule 6) when given. Raises ProtocolError
    when the message would not decode on the other side."""
    cls = type(msg)
    if _BY_CODE.get(getattr(cls, "TYPE", -1)) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message type")
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= INT64_MAX:
        raise schema_error("request_id", f"{show_value(request_id)} is not an int in [0, 2**63)")
    normal = _validate(cls, msg.__dict__, _always)  # (a frozen dataclass's __dict__ is its fields)
    problem = msg._problem()  # the cross-field rules decode applies (the fields were checked above)
    if problem is not None:
        raise schema_error(cls.__name__, problem)
    if token and len(token) != TOKEN_BYTES:
        raise schema_error("token", f"a session token is {TOKEN_BYTES} bytes, got {len(token)}")
    body = msgpack.packb(normal, use_bin_type=True)
    rid = _HEADER.pack(request_id) + bytes(token) if token else _HEADER.pack(request_id)
    frames = [TAG, bytes((cls.TYPE,)), rid, body, *map(bytes, blobs)]
    _check_sizes(cls, frames)
    return frames


def stamp(frames: list[bytes], token: bytes) -> list[bytes]:
    """`frames` (from `encode`) with their session token replaced by `token` (b"": none)."""
    return [frames[0], frames[1], frames[2][: _HEADER.size] + token, *frames[3:]]


def as_resend(frames: list[bytes]) -> list[bytes]:
    """`frames` (a request with its session token, from `encode`/`stamp`) marked as a resend (1.8):
    frame 2 ends with `FLAG_RESEND`. The client library marks the copies it sends after a `Welcome`
    of requests it sent before; a controller does not answer such a copy again when the request's
    final reply already went out on the connection the copy came over (docs/protocol.md)."""
    rid = frames[2][: _HEADER.size + TOKEN_BYTES]
    if len(rid) != _HEADER.size + TOKEN_BYTES:
        raise ValueError("only a request that carries a session token can be marked as a resend")
    return [frames[0], frames[1], rid + bytes((FLAG_RESEND,)), *frames[3:]]


def encode_trusted(msg: Message, request_id: int, blobs: Sequence[bytes] = ()) -> list[bytes]:
    """Frames for a message built only from values that were already checked: fields of a
    decoded message or of a typed outcome (`tangram.outcomes`). The controller's hot path uses
    it for `Spawn` (from a decoded `Exec`), `Accepted` and action `Result`s; field checks are
    skipped, sizes are still checked. `tests/protocol` checks that what it emits decodes to
    the same message as `encode`'s frames."""
    cls = type(msg)
    body = msgpack.packb(msg.__dict__, use_bin_type=True)  # a frozen dataclass: its fields, in order
    frames = [TAG, bytes((cls.TYPE,)), _HEADER.pack(request_id), body, *map(bytes, blobs)]
    _check_sizes(cls, frames)
    return frames


def _always(name: str) -> bool:
    return True


def _check_sizes(cls: type[Message], frames: Sequence[bytes]) -> None:
    if len(frames[3]) > MAX_BODY_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"{cls.__name__} body over {MAX_BODY_BYTES} bytes")
    if (size := sum(map(len, frames))) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            ProtocolErrorKind.TOO_LARGE,
            f"{cls.__name__} of {size} bytes is over the limit of {MAX_MESSAGE_BYTES} bytes "
            f"({MAX_MESSAGE_BYTES >> 20} MiB, tangram.protocol.MAX_MESSAGE_BYTES) on one message",
            hint="split the data into parts under the limit (e.g. several files), or ship it another way",
        )
    if len(frames) - 4 > MAX_BLOBS:
        raise ProtocolError(ProtocolErrorKind.SCHEMA, f"{cls.__name__}: more than {MAX_BLOBS} blobs")
    if len(frames) - 4 < cls._min_blobs:
        raise ProtocolError(ProtocolErrorKind.SCHEMA, f"{cls.__name__}: needs {cls._min_blobs} blob(s)")


def _frames(frames: object) -> list[bytes]:
    if not isinstance(frames, (list, tuple)):
        raise schema_error("frames", f"expected a list of frames, got {type(frames).__name__}")
    if not 4 <= len(frames) <= 4 + MAX_BLOBS:
        raise schema_error("frames", f"expected 4 to {4 + MAX_BLOBS} frames, got {len(frames)}")
    out = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise schema_error(f"frame {i}", f"expected bytes, got {type(frame).__name__}")
        out.append(bytes(frame))
    return out


def _header(frames: list[bytes]) -> tuple[type[Message], int, bytes, bool]:
    tag, kind, rid = frames[0], frames[1], frames[2]
    if tag != TAG:
        if len(tag) == 4 and tag.startswith(_TAG_PREFIX) and tag[3:].isdigit():
            raise ProtocolError(
                ProtocolErrorKind.VERSION,
                f"peer speaks protocol {tag[3:].decode()}, this side {PROTOCOL_MAJOR}",
                hint="run `tangram up` so every peer runs the same Tangram version",
            )
        raise schema_error("frame 0", "not a Tangram message (bad tag)")
    if len(kind) != 1 or kind[0] not in _BY_CODE:
        raise schema_error("frame 1", f"unknown message type {kind[:4].hex() or '(empty)'}")
    token = b""
    resend = False
    if len(rid) != _HEADER.size:
        if len(rid) == _FLAGGED and rid[-1] == FLAG_RESEND:
            rid, resend = rid[:-1], True
        if len(rid) != _HEADER.size + TOKEN_BYTES:
            raise schema_error(
                "frame 2",
                f"request id must be {_HEADER.size} bytes (+ {TOKEN_BYTES} of session token "
                f"[+ the resend flag {FLAG_RESEND}]), got {len(frames[2])}",
            )
        rid, token = rid[: _HEADER.size], rid[_HEADER.size :]
    (request_id,) = _HEADER.unpack(rid)
    if request_id > INT64_MAX:
        raise schema_error("frame 2", "request id over 2**63 - 1")
    return _BY_CODE[kind[0]], request_id, token, resend


def _unpack(cls: type[Message], body: bytes) -> dict[str, object]:
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)
    except Exception as exc:  # noqa: BLE001 - msgpack raises ValueError, UnicodeDecodeError, ExtraData...
        raise ProtocolError(ProtocolErrorKind.DECODE, f"{cls.__name__} body: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise schema_error(cls.__name__, f"body must be a map, got {type(value).__name__}")
    return value


def decode(frames: Sequence[bytes]) -> Envelope:
    """The message in `frames` (identity frames already removed). Raises only ProtocolError."""
    parts = _frames(frames)
    if sum(map(len, parts)) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"message over {MAX_MESSAGE_BYTES} bytes")
    cls, request_id, token, resend = _header(parts)
    _check_sizes(cls, parts)
    values = _unpack(cls, parts[3])
    msg = _build(cls, _validate(cls, values, values.__contains__))
    return Envelope(cls.TYPE, request_id, msg, tuple(parts[4:]), token, resend)


# ---------------------------------------------------------------- batches (rule 7)


@dataclass(frozen=True)
class BadItem:
    """An item of a batch that does not decode: its request id and why (the rest of the batch stands)."""

    request_id: int
    error: ProtocolError


def _msgpack_uint(value: int) -> bytes:
    """msgpack's shortest form of an unsigned int (what `msgpack.packb` writes), without a call
    into it: a batch writes two or three per item."""
    if value < 0x80:
        return bytes((value,))
    if value < 0x100:
        return b"\xcc" + bytes((value,))
    if value < 0x10000:
        return b"\xcd" + value.to_bytes(2, "big")
    if value < 0x100000000:
        return b"\xce" + value.to_bytes(4, "big")
    return b"\xcf" + value.to_bytes(8, "big")


def _msgpack_uints(values: Sequence[int]) -> bytes:
    """A short msgpack list of unsigned ints (at most `MAX_BLOBS` < 16: a fixarray)."""
    return bytes((0x90 | len(values),)) + b"".join(_msgpack_uint(v) for v in values)


def batch_frames(items: Sequence[Sequence[bytes]], token: bytes = b"") -> list[bytes]:
    """One `BATCH` of `items`, each a message's frames as `encode`/`encode_trusted` made them
    (their own tokens give way to the batch's `token`). The bodies are spliced in as they are:
    a msgpack list is its header followed by its elements. `pack` keeps to the limits."""
    n = len(items)
    parts = [bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")]
    blobs: list[bytes] = []
    for frames in items:
        rid = int.from_bytes(frames[2][: _HEADER.size], "big")
        sizes = _msgpack_uints([len(b) for b in frames[4:]]) if len(frames) > 4 else b"\x90"
        parts.append(b"\x94" + _msgpack_uint(frames[1][0]) + _msgpack_uint(rid) + frames[3] + sizes)
        blobs.extend(frames[4:])
    return [TAG, _BATCH_KIND, _HEADER.pack(0) + token, b"".join(parts), b"".join(blobs)]


def chunks(items: Sequence[list[bytes]], most: int = BATCH_MAX) -> list[list[list[bytes]]]:
    """`items` (encoded messages, in order) cut into runs that fit one batch each: at most
    `most` (<= `BATCH_MAX`) messages, `BATCH_BODY_BYTES` of bodies, `MAX_MESSAGE_BYTES` in all."""
    out: list[list[list[bytes]]] = []
    chunk: list[list[bytes]] = []
    body = size = 0
    for frames in items:
        n = sum(map(len, frames))
        full = len(chunk) >= most or body + len(frames[3]) > BATCH_BODY_BYTES
        if chunk and (full or size + n > MAX_MESSAGE_BYTES - 4096):
            out.append(chunk)
            chunk, body, size = [], 0, 0
        chunk.append(frames)
        body, size = body + len(frames[3]), size + n
    if chunk:
        out.append(chunk)
    return out


def packed(chunk: Sequence[list[bytes]], token: bytes = b"") -> list[bytes]:
    """The message that carries one chunk (`chunks`): a lone item as it is, else a batch."""
    return chunk[0] if len(chunk) == 1 else batch_frames(chunk, token)


def pack(items: Sequence[list[bytes]], token: bytes = b"", most: int = BATCH_MAX) -> list[list[bytes]]:
    """The messages that carry `items`, one per chunk (`chunks`, `packed`)."""
    return [packed(c, token) for c in chunks(items, most)]


def is_batch(frames: Sequence[bytes]) -> bool:
    return len(frames) > 1 and frames[1] == _BATCH_KIND


def decode_all(frames: Sequence[bytes]) -> list[Envelope | BadItem]:
    """The messages in `frames`: the one of a plain message (`decode`), or each item of a batch.
    Raises ProtocolError when a plain message does not decode or a batch's framing is broken (its
    tag, header, body, or blob sizes); an item that does not decode is a `BadItem`."""
    if not is_batch(frames):
        return [decode(frames)]
    if len(frames) != 5:
        raise schema_error("frames", f"a batch has 5 frames, got {len(frames)}")
    parts = _frames(frames[:4]) + [bytes(frames[4])]
    if sum(map(len, parts)) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"batch over {MAX_MESSAGE_BYTES} bytes")
    if len(parts[3]) > BATCH_BODY_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"batch body over {BATCH_BODY_BYTES} bytes")
    token = _batch_token(parts)
    data = parts[4]
    out: list[Envelope | BadItem] = []
    at = 0
    for code, rid, body, sizes in _batch_items(parts[3], len(data)):
        blobs = []
        for size in sizes:
            blobs.append(data[at : at + size])
            at += size
        try:
            cls = _BY_CODE.get(code)
            if cls is None or code in UNBATCHED:
                raise schema_error("batch item", f"message type {code:#04x} cannot travel in a batch")
            if len(blobs) < cls._min_blobs:
                raise schema_error(cls.__name__, f"needs {cls._min_blobs} blob(s)")
            msg = _build(cls, _validate(cls, body, body.__contains__))
            out.append(Envelope(code, rid, msg, tuple(blobs), token))
        except ProtocolError as exc:
            out.append(BadItem(rid, exc))
    return out


def _batch_token(parts: list[bytes]) -> bytes:
    if parts[0] != TAG:
        _header(parts)  # raises the right error (version, or not Tangram)
    rid = parts[2]
    if len(rid) not in (_HEADER.size, _HEADER.size + TOKEN_BYTES) or _HEADER.unpack(rid[: _HEADER.size])[0]:
        raise schema_error("frame 2", "a batch's request id is 0 (+ the session token)")
    return rid[_HEADER.size :]


def _is_item(item: object) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 4
        and type(item[0]) is int
        and type(item[1]) is int
        and isinstance(item[2], dict)
        and isinstance(item[3], list)
        and 0 <= item[1] <= INT64_MAX
        and len(item[3]) <= MAX_BLOBS
        and all(type(n) is int and n >= 0 for n in item[3])
    )


def _batch_items(body: bytes, data: int) -> list[tuple[int, int, dict[str, object], list[int]]]:
    """The items of a batch body, their framing checked: ``(type, request id, body, blob sizes)``;
    the sizes must add up to `data`, the length of the blob frame."""
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)
    except Exception as exc:  # noqa: BLE001 - as _unpack
        raise ProtocolError(ProtocolErrorKind.DECODE, f"batch body: {type(exc).__name__}") from None
    if not isinstance(value, list) or not 1 <= len(value) <= BATCH_MAX:
        raise schema_error("batch", f"body must be a list of 1 to {BATCH_MAX} items")
    total = 0
    for item in value:
        if not _is_item(item):
            raise schema_error("batch item", "expected [type, request id, body map, [blob sizes]]")
        total += sum(item[3])
    if total != data:
        raise schema_error("batch", f"items name {total} bytes of blobs, the blob frame has {data}")
    return value  # type: ignore[return-value]


def version_problem(hello: Hello, *, me: str = "controller") -> str | None:
    """The `Reject` reason for a peer of another major, or None when the versions work together."""
    if hello.major == PROTOCOL_MAJOR:
        return None
    return f"{hello.role} speaks {hello.major}, {me} {PROTOCOL_MAJOR}: run tangram up"
