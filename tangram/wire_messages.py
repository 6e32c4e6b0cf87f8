"""The message declarations of the wire protocol: the field types (`Id`, `Text`, `Count`, ...),
the `Message` base, the registry of type codes, and one frozen dataclass per message type. No
I/O here; `tangram.protocol` (which re-exports every name) holds the rules, the frames and the
codec.

`_register(code, name)` gives a class its type code and compiles one checker per field from the
field's annotation (`tangram.wire_checks`). Fields of protocol 1.0 without a default are listed
in `_required`; every later field has a default (rule 2 of `tangram.protocol`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, TypeVar, get_type_hints

from tangram.errors import TangramError, code_of, error_from_code
from tangram.wire_checks import (
    ID_PATTERN,
    INT64_MAX,
    JSON,
    MAX_ITEMS,
    MAX_KEY,
    MAX_TEXT,
    SESSION_TOKEN_BYTES,
    Checker,
    Items,
    Range,
    Str,
    compile_checker,
)

# ---------------------------------------------------------------- field types

Id = Annotated[str, Str(64, ID_PATTERN, "id")]
Name = Annotated[str, Str(64, ID_PATTERN, "name")]
OptId = Annotated[str, Str(64, f"(?:{ID_PATTERN})?", "id")]  # an id, or "" for none
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
        cls._checkers = {f.name: compile_checker(hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
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
    # a client's RL job (docs/client.md, "Jobs"; "": the default job); older controllers ignore it
    job: Annotated[str, Str(64, f"(?:{ID_PATTERN})?", "job name")] = ""


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
    # 1.3: the client's session token (hex); every later frame of the client carries its bytes
    session: Annotated[
        str, Str(2 * SESSION_TOKEN_BYTES, f"(?:[0-9a-f]{{{2 * SESSION_TOKEN_BYTES}}})?", "session token")
    ] = ""


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
    budget_ms: Count = 0  # the longest run once started (before 1.4: queueing included); 0: the maximum
    idempotent: bool = False
    total_budget_ms: Count = 0  # 1.4: the whole request, queueing included; 0: the controller's maximum

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
    budget_ms: Count = 0  # as Exec.budget_ms
    gpus_options: Annotated[list[Annotated[int, Range(1, 64)]], Items(8)] = field(default_factory=list)
    elastic: Id | None = None
    total_budget_ms: Count = 0  # as Exec.total_budget_ms

    def _problem(self) -> str | None:
        if self.gpus_options and self.gpus not in self.gpus_options:
            return f"gpus {self.gpus} is not among gpus_options {self.gpus_options}"
        return None


@_register(0x26, "LEASE")
@dataclass(frozen=True)
class Lease(Message):
    """`tokens`: what the call will be charged against a key's tokens-per-minute limit (API key
    pools; 0: none)."""

    _required = ("api",)
    api: Id
    units: Positive = 1
    budget_ms: Count = 0
    tokens: Count = 0


@_register(0x27, "RELEASE")
@dataclass(frozen=True)
class Release(Message):
    """The holder's report of its call (API key pools): `tokens` the provider counted (0: not
    reported), `rate_limited` when it answered HTTP 429, with its reset time `reset_ms`."""

    _required = ("lease",)
    lease: Id
    tokens: Count = 0
    rate_limited: bool = False
    reset_ms: Count = 0


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
    after: OptId = ""  # 1.6, a staged start: run once action `after` has ended here, on its cores


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


@_register(0x4C, "SANDBOX_POOL")
@dataclass(frozen=True)
class SandboxPool(Message):
    """Keep `count` created, idle sandboxes of one shape (`image`, `mem_mib` as a `CreateSandbox`
    names them) ready for `CreateSandbox` to claim; 0 removes the pool. Sent only to agents whose
    Hello facts list `pool` (docs/protocol.md, "Warm sandbox pools")."""

    _required = ("count",)
    count: Count
    image: Image = ""
    mem_mib: Count = 0


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
