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

Layout: limits and field constraints, the checkers compiled from field annotations, the
message declarations (most of the module's length: one short dataclass per type), the codec.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import msgpack  # type: ignore[import-untyped]

from tangram.errors import ProtocolError, ProtocolErrorKind, TangramError, code_of, error_from_code
from tangram.outcomes import CallOutcome, ExecOutcome

__all__ = [
    "ID_PATTERN",
    "MAX_BLOBS",
    "MAX_BODY_BYTES",
    "MAX_MESSAGE_BYTES",
    "MESSAGE_TYPES",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "TAG",
    "CallOutcome",
    "Envelope",
    "ExecOutcome",
    "Message",
    "ProtocolError",
    "ProtocolErrorKind",
    "decode",
    "encode",
    "encode_trusted",
    "type_code",
    "version_problem",
]

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 2
TAG = b"TGR%d" % PROTOCOL_MAJOR
_TAG_PREFIX = b"TGR"

MAX_BODY_BYTES = 1 << 20  # one msgpack body
MAX_MESSAGE_BYTES = 64 << 20  # all frames of one message together; also zmq.MAXMSGSIZE (per frame)
MAX_BLOBS = 8
MAX_TEXT = 64 << 10  # longest string in a body (commands, tracebacks)
MAX_STR = 4096  # default bound for a plain `str` field
MAX_ITEMS = 4096  # default bound for lists and dicts
MAX_KEY = 256
MAX_DEPTH = 16  # nesting of free-form (JSON-like) fields
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_HEADER = struct.Struct(">Q")

_UNPACK_LIMITS: dict[str, int] = {
    "max_str_len": MAX_TEXT,
    "max_bin_len": 0,
    "max_array_len": MAX_ITEMS * 4,
    "max_map_len": MAX_ITEMS * 4,
    "max_ext_len": 0,
}

# Ids end up in container names, labels and file names. `.` and `:` are allowed for names such
# as `qwen2.5-7b`, but an id never starts with `.` or `-`, and never contains `..`.
ID_PATTERN = r"(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}"


# ---------------------------------------------------------------- field constraints


@dataclass(frozen=True)
class Str:
    """A string field: at most `max_len` characters, matching `pattern` (whole string) if given."""

    max_len: int = MAX_STR
    pattern: str | None = None
    what: str = "string"


@dataclass(frozen=True)
class Range:
    """An int or float field within [lo, hi]."""

    lo: float
    hi: float


@dataclass(frozen=True)
class Items:
    """A list or dict with at most `max_items` entries."""

    max_items: int


class _Json:
    """A free-form value: maps with string keys, lists, str, int64, finite floats, bool, None."""


JSON = _Json()

Id = Annotated[str, Str(64, ID_PATTERN, "id")]
Name = Annotated[str, Str(64, ID_PATTERN, "name")]
Text = Annotated[str, Str(MAX_TEXT)]
Image = Annotated[str, Str(255, r"(?:(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,254})?", "image")]
Path = Annotated[str, Str(4096, r"(?!(?:.*/)?\.\.(?:/|$))[^\x00]{1,4096}", "path")]
EnvKey = Annotated[str, Str(128, r"(?!LD_)[A-Za-z_][A-Za-z0-9_]*", "environment name")]
Env = Annotated[dict[EnvKey, Annotated[str, Str(MAX_TEXT)]], Items(256)]
Labels = Annotated[dict[Id, Annotated[str, Str(256)]], Items(64)]
Free = Annotated[object, JSON]
FreeMap = dict[Annotated[str, Str(MAX_KEY)], Free]
Count = Annotated[int, Range(0, INT64_MAX)]
Positive = Annotated[int, Range(1, INT64_MAX)]
Seconds = Annotated[float, Range(0, 1e9)]
Cores = Annotated[list[Annotated[int, Range(0, 1 << 20)]], Items(MAX_ITEMS)]
Gpus = Annotated[list[Annotated[int, Range(0, 1023)]], Items(64)]
Units = Annotated[str, Str(6, r"[1-9][0-9]{0,5}", "unit count")]


# ---------------------------------------------------------------- checkers

Checker = Callable[[object, str], object]


def _fail(path: str, why: str) -> ProtocolError:
    return ProtocolError(ProtocolErrorKind.SCHEMA, f"{path}: {why}")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_bool(value: object, path: str) -> object:
    if not isinstance(value, bool):
        raise _fail(path, f"expected bool, got {type(value).__name__}")
    return value


def _int_checker(lo: float, hi: float) -> Checker:
    low, high = max(lo, INT64_MIN), min(hi, INT64_MAX)

    def check(value: object, path: str) -> object:
        if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
            raise _fail(path, f"expected int, got {type(value).__name__}")
        if not (low <= value <= high):
            raise _fail(path, f"{_show(value)} is out of range")
        return value

    return check


def _float_checker(lo: float, hi: float) -> Checker:
    def check(value: object, path: str) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, f"expected float, got {type(value).__name__}")
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise _fail(path, f"{_show(value)} is out of range")
        number = float(value)
        if not math.isfinite(number):
            raise _fail(path, f"{number} is not a finite number")
        if not lo <= number <= hi:
            raise _fail(path, f"{number} is out of range")
        return number

    return check


def _str_checker(spec: Str) -> Checker:
    pattern = re.compile(spec.pattern) if spec.pattern else None

    def check(value: object, path: str) -> object:
        if not isinstance(value, str):
            raise _fail(path, f"expected str, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise _fail(path, f"{spec.what} longer than {spec.max_len} characters")
        if pattern is not None and pattern.fullmatch(value) is None:
            raise _fail(path, f"{_show(value)} is not a valid {spec.what}")
        if pattern is None and "\x00" in value:
            raise _fail(path, f"{spec.what} contains NUL")
        return value

    return check


def _check_none(value: object, path: str) -> object:
    if value is not None:
        raise _fail(path, f"expected None, got {type(value).__name__}")
    return None


def _literal_checker(choices: tuple[object, ...]) -> Checker:
    def check(value: object, path: str) -> object:
        if not isinstance(value, str) or value not in choices:
            raise _fail(path, f"{_show(value)} is not one of {', '.join(map(str, choices))}")
        return value

    return check


def _union_checker(options: list[Checker]) -> Checker:
    nullable = _check_none in options

    def check(value: object, path: str) -> object:
        if value is None and nullable:  # `X | None` with None: no failed try of X first
            return None
        first: ProtocolError | None = None
        for option in options:
            try:
                return option(value, path)
            except ProtocolError as exc:
                first = first or exc
        assert first is not None
        raise first

    return check


def _list_checker(item: Checker, max_items: int) -> Checker:
    def check(value: object, path: str) -> object:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, f"expected list, got {type(value).__name__}")
        if len(value) > max_items:
            raise _fail(path, f"more than {max_items} items")
        try:
            return [item(v, path) for v in value]
        except ProtocolError:  # check again with each item's path, for the message (cold path)
            return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return check


def _dict_checker(key: Checker, val: Checker, max_items: int) -> Checker:
    def check(value: object, path: str) -> object:
        if not isinstance(value, dict):
            raise _fail(path, f"expected map, got {type(value).__name__}")
        if len(value) > max_items:
            raise _fail(path, f"more than {max_items} entries")
        try:
            return {str(key(k, path)): val(v, path) for k, v in value.items()}
        except ProtocolError:  # check again with each entry's path, for the message (cold path)
            return {str(key(k, f"{path} key")): val(v, f"{path}[{_show(k)}]") for k, v in value.items()}

    return check


_key_check = _str_checker(Str(MAX_KEY, None, "key"))
_text_check = _str_checker(Str(MAX_TEXT))
_int64_check = _int_checker(INT64_MIN, INT64_MAX)
_finite_check = _float_checker(-math.inf, math.inf)


def _check_json(value: object, path: str, depth: int = 0) -> object:
    """A free-form value, normalised (tuples become lists). Paths are built only on failure."""
    try:
        return _json_fast(value, depth)
    except ProtocolError:
        return _json_slow(value, path, depth)


def _json_fast(value: object, depth: int) -> object:
    if value is None or value is True or value is False:
        return value
    kind = type(value)
    if kind is str:
        if len(value) > MAX_TEXT or "\x00" in value:  # type: ignore[arg-type, operator]
            raise _fail("", "bad text")
        return value
    if kind is int:
        if not INT64_MIN <= value <= INT64_MAX:  # type: ignore[operator]
            raise _fail("", "out of range")
        return value
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise _fail("", "not finite")
        return value
    if depth >= MAX_DEPTH:
        raise _fail("", "too deep")
    if kind is dict:
        out = {}
        for k, v in value.items():  # type: ignore[attr-defined]
            if type(k) is not str or len(k) > MAX_KEY or "\x00" in k:
                raise _fail("", "bad key")
            out[k] = _json_fast(v, depth + 1)
        return out
    if kind is list or kind is tuple:
        return [_json_fast(v, depth + 1) for v in value]  # type: ignore[attr-defined]
    raise _fail("", "slow path")  # subclasses and everything else: the exact checks below


def _json_slow(value: object, path: str, depth: int = 0) -> object:
    if depth > MAX_DEPTH:
        raise _fail(path, f"nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return _int64_check(value, path)
    if isinstance(value, float):
        return _finite_check(value, path)
    if isinstance(value, str):
        return _text_check(value, path)
    if isinstance(value, (list, tuple)):
        return [_json_slow(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {
            str(_key_check(k, f"{path} key")): _json_slow(v, f"{path}[{_show(k)}]", depth + 1)
            for k, v in value.items()
        }
    raise _fail(path, f"{type(value).__name__} is not allowed in a body (bytes go in blobs)")


def _compile(tp: object) -> Checker:
    """Turn a field annotation into a function that validates and normalises one value."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _compile_annotated(args[0], args[1:])
    if tp is bool:
        return _check_bool
    if tp is int:
        return _int64_check
    if tp is float:
        return _finite_check
    if tp is str:
        return _str_checker(Str())
    if tp is type(None):
        return _check_none
    if origin is Literal:
        return _literal_checker(args)
    if origin in (Union, types.UnionType):
        return _union_checker([_compile(a) for a in args])
    if origin is list:
        return _list_checker(_compile(args[0]), MAX_ITEMS)
    if origin is dict:
        return _dict_checker(_compile(args[0]), _compile(args[1]), MAX_ITEMS)
    raise TypeError(f"unsupported field annotation {tp!r}")


def _compile_annotated(base: object, meta: tuple[object, ...]) -> Checker:
    spec = meta[0]
    if isinstance(spec, _Json):
        return _check_json
    if isinstance(spec, Str):
        return _str_checker(spec)
    if isinstance(spec, Range):
        return _int_checker(spec.lo, spec.hi) if base is int else _float_checker(spec.lo, spec.hi)
    if isinstance(spec, Items):
        args = get_args(base)
        if get_origin(base) is list:
            return _list_checker(_compile(args[0]), spec.max_items)
        return _dict_checker(_compile(args[0]), _compile(args[1]), spec.max_items)
    raise TypeError(f"unsupported annotation metadata {spec!r}")


# ---------------------------------------------------------------- messages and registry


class Message:
    """Base of every message. Subclasses are frozen dataclasses registered with `_register`."""

    TYPE: ClassVar[int]
    NAME: ClassVar[str]
    _required: ClassVar[tuple[str, ...]] = ()  # fields of protocol 1.0 without a default; frozen
    _min_blobs: ClassVar[int] = 0
    _checkers: ClassVar[dict[str, Checker]]
    _fields: ClassVar[tuple[tuple[str, Checker, str, bool], ...]]

    def _problem(self) -> str | None:
        """A cross-field rule the message breaks, or None."""
        return None


_BY_CODE: dict[int, type[Message]] = {}
MESSAGE_TYPES: Mapping[int, type[Message]] = types.MappingProxyType(_BY_CODE)
M = TypeVar("M", bound=type[Message])


def _register(code: int, name: str) -> Callable[[M], M]:
    def wrap(cls: M) -> M:
        if code in _BY_CODE or not 0 < code < 256:
            raise ValueError(f"bad or duplicate message type 0x{code:02x}")
        hints = get_type_hints(cls, include_extras=True)
        cls.TYPE, cls.NAME = code, name
        cls._checkers = {f.name: _compile(hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        cls._fields = tuple(  # (name, checker, path for errors, required)
            (n, c, f"{cls.__name__}.{n}", n in cls._required) for n, c in cls._checkers.items()
        )
        _BY_CODE[code] = cls
        return cls

    return wrap


def type_code(message: Message | type[Message]) -> int:
    return message.TYPE


# General, both directions ------------------------------------------------------------------


@_register(0x01, "HELLO")
@dataclass(frozen=True)
class Hello(Message):
    """First message on a connection. Agents add facts, bundle hash and what they still run."""

    _required = ("role", "name", "major", "minor")
    role: Literal["agent", "client", "status"]
    name: Name
    major: Count
    minor: Count
    facts: FreeMap = field(default_factory=dict)
    bundle: Annotated[str, Str(128)] = ""
    sandboxes: Annotated[list[Id], Items(MAX_ITEMS)] = field(default_factory=list)
    actions: Annotated[list[FreeMap], Items(MAX_ITEMS)] = field(default_factory=list)


@_register(0x02, "WELCOME")
@dataclass(frozen=True)
class Welcome(Message):
    _required = ("major", "minor", "controller_epoch")
    major: Count
    minor: Count
    controller_epoch: Count
    agent_epoch: Count = 0
    heartbeat_s: Annotated[float, Range(0.01, 3600)] = 1.0
    max_outstanding: Count = 0  # 1.1: the per-client cap on unanswered requests (0: not said)
    durable: bool = False  # 1.2: the controller keeps a state file: resends after a restart are safe


@_register(0x03, "REJECT")
@dataclass(frozen=True)
class Reject(Message):
    _required = ("reason",)
    reason: Text


@_register(0x04, "HEARTBEAT")
@dataclass(frozen=True)
class Heartbeat(Message):
    load: FreeMap = field(default_factory=dict)


@_register(0x05, "BYE")
@dataclass(frozen=True)
class Bye(Message):
    reason: Text = ""


@_register(0x06, "ACK")
@dataclass(frozen=True)
class Ack(Message):
    pass


@_register(0x07, "ACCEPTED")
@dataclass(frozen=True)
class Accepted(Message):
    pass


@_register(0x08, "RESULT")
@dataclass(frozen=True)
class Result(Message):
    """The final reply to a request; `body` is request-specific (docs/protocol.md)."""

    _required = ("body",)
    body: FreeMap


@_register(0x09, "ERROR")
@dataclass(frozen=True)
class Error(Message):
    """A failed request. `code` is an ErrorCode value; unknown codes (newer peers) are allowed."""

    _required = ("code", "message", "retryable")
    code: Annotated[str, Str(32, r"[A-Z][A-Z0-9_]*", "error code")]
    message: Text
    retryable: bool
    detail: Text = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> Error:
        code = code_of(exc)
        if isinstance(exc, TangramError):
            return cls(code.value, str(exc)[:MAX_TEXT], exc.retryable, (exc.detail or "")[:MAX_TEXT])
        return cls(code.value, f"internal error ({type(exc).__name__})", False)

    def to_exception(self) -> TangramError:
        return error_from_code(self.code, self.message, self.detail or None)


# Client -> controller (submit socket) --------------------------------------------------------


@_register(0x20, "SANDBOX_OPEN")
@dataclass(frozen=True)
class SandboxOpen(Message):
    image: Image = ""
    mem_mib: Count = 0
    reserve: Count = 0
    timeout_s: Seconds = 0.0
    labels: Labels = field(default_factory=dict)


@_register(0x21, "SANDBOX_CLOSE")
@dataclass(frozen=True)
class SandboxClose(Message):
    _required = ("sandbox",)
    sandbox: Id


@_register(0x22, "PUT")
@dataclass(frozen=True)
class Put(Message):
    """Write blob 0 to `path` inside the sandbox."""

    _required = ("sandbox", "path")
    _min_blobs = 1
    sandbox: Id
    path: Path


@_register(0x23, "GET")
@dataclass(frozen=True)
class Get(Message):
    _required = ("sandbox", "path")
    sandbox: Id
    path: Path


@_register(0x24, "EXEC")
@dataclass(frozen=True)
class Exec(Message):
    """Run `cmd` in a sandbox on cpus_min..cpus_max cores; optional blob 0 is stdin."""

    _required = ("sandbox", "cmd", "cpus_min", "cpus_max")
    sandbox: Id
    cmd: Text
    cpus_min: Annotated[int, Range(1, 1 << 16)]
    cpus_max: Annotated[int, Range(1, 1 << 16)]
    elastic: Id | None = None
    efficiency: Annotated[dict[Units, Annotated[float, Range(0, 1e6)]], Items(1024)] | None = None
    duration_hint_s: Seconds = 0.0
    env: Env = field(default_factory=dict)
    budget_ms: Count = 0
    idempotent: bool = False

    def _problem(self) -> str | None:
        if self.cpus_max < self.cpus_min:
            return f"cpus_max {self.cpus_max} is below cpus_min {self.cpus_min}"
        return None


@_register(0x25, "CALL")
@dataclass(frozen=True)
class Call(Message):
    """Call a GPU service; blob 0 is the msgpack payload."""

    _required = ("service",)
    _min_blobs = 1
    service: Id
    gpus: Annotated[int, Range(1, 64)] = 1
    budget_ms: Count = 0
    gpus_options: Annotated[list[Annotated[int, Range(1, 64)]], Items(8)] = field(default_factory=list)
    elastic: Id | None = None

    def _problem(self) -> str | None:
        if self.gpus_options and self.gpus not in self.gpus_options:
            return f"gpus {self.gpus} is not among gpus_options {self.gpus_options}"
        return None


@_register(0x26, "LEASE")
@dataclass(frozen=True)
class Lease(Message):
    _required = ("api",)
    api: Id
    units: Positive = 1
    budget_ms: Count = 0


@_register(0x27, "RELEASE")
@dataclass(frozen=True)
class Release(Message):
    _required = ("lease",)
    lease: Id


@_register(0x28, "CANCEL")
@dataclass(frozen=True)
class Cancel(Message):
    _required = ("target_request_id",)
    target_request_id: Count


# Controller -> agent (agents socket) ----------------------------------------------------------


@_register(0x40, "SANDBOX_CREATE")
@dataclass(frozen=True)
class CreateSandbox(Message):
    _required = ("sandbox", "image", "mem_mib")
    sandbox: Id
    image: Image
    mem_mib: Count
    labels: Labels = field(default_factory=dict)


@_register(0x41, "SANDBOX_DESTROY")
@dataclass(frozen=True)
class DestroySandbox(Message):
    _required = ("sandbox",)
    sandbox: Id


@_register(0x42, "FILE_PUT")
@dataclass(frozen=True)
class PutFile(Message):
    _required = ("sandbox", "path")
    _min_blobs = 1
    sandbox: Id
    path: Path


@_register(0x43, "FILE_GET")
@dataclass(frozen=True)
class GetFile(Message):
    _required = ("sandbox", "path")
    sandbox: Id
    path: Path


@_register(0x44, "CPUSET")
@dataclass(frozen=True)
class Cpuset(Message):
    _required = ("sandbox", "cores")
    sandbox: Id
    cores: Cores


@_register(0x45, "SPAWN")
@dataclass(frozen=True)
class Spawn(Message):
    """Run one attempt of an action; the agent echoes (action, attempt, epochs) in its result."""

    _required = ("action", "sandbox", "cmd", "cores", "dop", "env", "timeout_s")
    action: Id
    sandbox: Id
    cmd: Text
    cores: Cores
    dop: Positive
    env: Env
    timeout_s: Seconds
    attempt: Positive = 1
    epoch: Count = 0
    agent_epoch: Count = 0


@_register(0x46, "KILL")
@dataclass(frozen=True)
class Kill(Message):
    """Kill an action's container; attempt 0 means whichever attempt runs."""

    _required = ("action",)
    action: Id
    attempt: Count = 0
    epoch: Count = 0


@_register(0x47, "PREPARE")
@dataclass(frozen=True)
class Prepare(Message):
    """Stage a service's weights in host memory (the host backup) without using a GPU."""

    _required = ("service", "spec")
    service: Id
    spec: FreeMap


@_register(0x48, "LOAD")
@dataclass(frozen=True)
class Load(Message):
    _required = ("service", "gpus")
    service: Id
    gpus: Gpus


@_register(0x49, "EVICT")
@dataclass(frozen=True)
class Evict(Message):
    _required = ("service", "gpus")
    service: Id
    gpus: Gpus


@_register(0x4A, "INVOKE")
@dataclass(frozen=True)
class Invoke(Message):
    """Run one call on a loaded service; blob 0 is the msgpack payload."""

    _required = ("action", "service", "gpus", "timeout_s")
    _min_blobs = 1
    action: Id
    service: Id
    gpus: Gpus
    timeout_s: Seconds
    attempt: Positive = 1
    epoch: Count = 0
    agent_epoch: Count = 0


@_register(0x4B, "SHUTDOWN")
@dataclass(frozen=True)
class Shutdown(Message):
    reason: Text = ""


# Status socket ------------------------------------------------------------------------------


@_register(0x60, "STATUS_REQ")
@dataclass(frozen=True)
class StatusReq(Message):
    sections: Annotated[list[Id], Items(32)] = field(default_factory=list)
    limit: Annotated[int, Range(0, 10_000)] = 50


@_register(0x61, "STATUS")
@dataclass(frozen=True)
class Status(Message):
    _required = ("records",)
    records: FreeMap


# ---------------------------------------------------------------- codec


@dataclass(frozen=True)
class Envelope:
    """One decoded message: its type code, request id, body and blob frames."""

    type: int
    request_id: int
    msg: Message
    blobs: tuple[bytes, ...] = ()


def _validate(
    cls: type[Message], values: Mapping[str, object], present: Callable[[str], bool]
) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, check, path, required in cls._fields:
        if present(name):
            out[name] = check(values[name], path)
        elif required:
            raise _fail(path, "missing")
    return out


def _build(cls: type[Message], values: dict[str, object]) -> Message:
    try:
        msg = cls(**values)
    except TypeError as exc:  # a required field that `_required` forgot: still a schema error
        raise _fail(cls.__name__, str(exc)) from None
    problem = msg._problem()
    if problem is not None:
        raise _fail(cls.__name__, problem)
    return msg


def encode(msg: Message, request_id: int, blobs: Sequence[bytes] = ()) -> list[bytes]:
    """Frames for `msg`. Raises ProtocolError when the message would not decode on the other side."""
    cls = type(msg)
    if _BY_CODE.get(getattr(cls, "TYPE", -1)) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message type")
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= INT64_MAX:
        raise _fail("request_id", f"{_show(request_id)} is not an int in [0, 2**63)")
    values = {name: getattr(msg, name) for name in cls._checkers}
    normal = _validate(cls, values, _always)
    problem = msg._problem()  # the cross-field rules decode applies (the fields were checked above)
    if problem is not None:
        raise _fail(cls.__name__, problem)
    body = msgpack.packb(normal, use_bin_type=True)
    frames = [TAG, bytes((cls.TYPE,)), _HEADER.pack(request_id), body, *(bytes(b) for b in blobs)]
    _check_sizes(cls, frames)
    return frames


def encode_trusted(msg: Message, request_id: int, blobs: Sequence[bytes] = ()) -> list[bytes]:
    """Frames for a message built only from values that were already checked: fields of a
    decoded message or of a typed outcome (`tangram.outcomes`). The controller's hot path uses
    it for `Spawn` (from a decoded `Exec`), `Accepted` and action `Result`s; field checks are
    skipped, sizes are still checked. `tests/protocol` checks that what it emits decodes to
    the same message as `encode`'s frames."""
    cls = type(msg)
    body = msgpack.packb({name: getattr(msg, name) for name in cls._checkers}, use_bin_type=True)
    frames = [TAG, bytes((cls.TYPE,)), _HEADER.pack(request_id), body, *(bytes(b) for b in blobs)]
    _check_sizes(cls, frames)
    return frames


def _always(name: str) -> bool:
    return True


def _check_sizes(cls: type[Message], frames: Sequence[bytes]) -> None:
    if len(frames[3]) > MAX_BODY_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"{cls.__name__} body over {MAX_BODY_BYTES} bytes")
    if sum(len(f) for f in frames) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"{cls.__name__} over {MAX_MESSAGE_BYTES} bytes")
    if len(frames) - 4 > MAX_BLOBS:
        raise ProtocolError(ProtocolErrorKind.SCHEMA, f"{cls.__name__}: more than {MAX_BLOBS} blobs")
    if len(frames) - 4 < cls._min_blobs:
        raise ProtocolError(ProtocolErrorKind.SCHEMA, f"{cls.__name__}: needs {cls._min_blobs} blob(s)")


def _frames(frames: object) -> list[bytes]:
    if not isinstance(frames, (list, tuple)):
        raise _fail("frames", f"expected a list of frames, got {type(frames).__name__}")
    if not 4 <= len(frames) <= 4 + MAX_BLOBS:
        raise _fail("frames", f"expected 4 to {4 + MAX_BLOBS} frames, got {len(frames)}")
    out = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise _fail(f"frame {i}", f"expected bytes, got {type(frame).__name__}")
        out.append(bytes(frame))
    return out


def _header(frames: list[bytes]) -> tuple[type[Message], int]:
    tag, kind, rid = frames[0], frames[1], frames[2]
    if tag != TAG:
        if len(tag) == 4 and tag.startswith(_TAG_PREFIX) and tag[3:].isdigit():
            raise ProtocolError(
                ProtocolErrorKind.VERSION,
                f"peer speaks protocol {tag[3:].decode()}, this side {PROTOCOL_MAJOR}",
                hint="run `tangram up` so every peer runs the same Tangram version",
            )
        raise _fail("frame 0", "not a Tangram message (bad tag)")
    if len(kind) != 1 or kind[0] not in _BY_CODE:
        raise _fail("frame 1", f"unknown message type {kind[:4].hex() or '(empty)'}")
    if len(rid) != _HEADER.size:
        raise _fail("frame 2", f"request id must be {_HEADER.size} bytes, got {len(rid)}")
    (request_id,) = _HEADER.unpack(rid)
    if request_id > INT64_MAX:
        raise _fail("frame 2", "request id over 2**63 - 1")
    return _BY_CODE[kind[0]], request_id


def _unpack(cls: type[Message], body: bytes) -> dict[str, object]:
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises ValueError, UnicodeDecodeError, ExtraData, StackError...
        raise ProtocolError(ProtocolErrorKind.DECODE, f"{cls.__name__} body: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise _fail(cls.__name__, f"body must be a map, got {type(value).__name__}")
    return value


def decode(frames: Sequence[bytes]) -> Envelope:
    """The message in `frames` (identity frames already removed). Raises only ProtocolError."""
    parts = _frames(frames)
    if sum(len(p) for p in parts) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ProtocolErrorKind.TOO_LARGE, f"message over {MAX_MESSAGE_BYTES} bytes")
    cls, request_id = _header(parts)
    _check_sizes(cls, parts)
    values = _unpack(cls, parts[3])
    msg = _build(cls, _validate(cls, values, values.__contains__))
    return Envelope(cls.TYPE, request_id, msg, tuple(parts[4:]))


def version_problem(hello: Hello, *, me: str = "controller") -> str | None:
    """The `Reject` reason for a peer of another major, or None when the versions work together."""
    if hello.major == PROTOCOL_MAJOR:
        return None
    return f"{hello.role} speaks {hello.major}, {me} {PROTOCOL_MAJOR}: run tangram up"
