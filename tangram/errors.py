"""Every error Tangram raises, in one tree.

Remote failures travel on the wire as an `ErrorCode` (never as a class name) and come back
as the matching class through `error_from_code`; `code_of` goes the other way. Errors meant
for a human carry a `hint` ("To fix: ...") and an `exit_code` for the CLI. The operator's own
errors (a bad inventory, a failed `tangram up`) subclass these in tangram_cli/errors.py.

    TangramError                      message, hint, detail, code, retryable, exit_code
     |
     +-- remote errors: one class per ErrorCode (the bijection used on the wire)
     |    +-- ActionTimeout           TIMEOUT          retryable   budget spent (also a builtin TimeoutError;
     |    |                                                        carries an exec's partial output)
     |    +-- QuotaExceeded           QUOTA_EXCEEDED   retryable   quota unmet within the budget
     |    +-- NodeLost                NODE_LOST        retryable   node of a stateless CALL died
     |    +-- RetryLater              RETRY_LATER      retryable   backpressure: caps reached
     |    +-- Cancelled               CANCELLED
     |    +-- NoCapacity              NO_CAPACITY                  the ask fits no node
     |    +-- SandboxLost             SANDBOX_LOST                 trajectory state is gone
     |    +-- BadRequest              BAD_REQUEST                  schema, ids, resource asks
     |    |    +-- MessageTooLarge                              client side: over MAX_MESSAGE_BYTES
     |    |    +-- UnitError                                    a size, duration or cpulist that does not
     |    |                                                     parse (tangram/units.py); also a ConfigError
     |    |                                                     and a ValueError
     |    +-- OverCap                 OVER_CAP                     bytes held for this client at its cap
     |    +-- NotPermitted            AUTH                         the peer's role may not do this
     |    +-- RemoteError             REMOTE_ERROR                 a service raised; detail = traceback
     |    +-- InternalError           INTERNAL                     a Tangram bug
     |    +-- VersionMismatch         VERSION                      peers speak different majors
     |
     +-- ProtocolError                kind = E_DECODE | E_SCHEMA | E_VERSION | E_TOO_LARGE
     |                                (bytes from a peer did not decode; replied as BAD_REQUEST/VERSION)
     +-- NonZeroExit                  client side, `exec(check=True)`; carries the ExecResult
     |
     +-- ConfigError                  exit 2   bad configuration value
     |                                         (InventoryError: tangram_cli/errors.py)
     +-- ClusterNotFound              exit 4   no cluster state / TANGRAM_ADDR
     +-- ControllerUnreachable        exit 4   retryable
                                      (BootstrapError and its kinds: tangram_cli/errors.py)

CLI exit codes: 1 failure, 2 usage or invalid inventory, 3 partial, 4 no cluster or
controller unreachable.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "ActionTimeout",
    "BadRequest",
    "Cancelled",
    "ClusterNotFound",
    "ConfigError",
    "ControllerUnreachable",
    "ErrorCode",
    "InternalError",
    "MessageTooLarge",
    "NoCapacity",
    "NodeLost",
    "NonZeroExit",
    "NotPermitted",
    "OverCap",
    "ProtocolError",
    "ProtocolErrorKind",
    "QuotaExceeded",
    "RemoteError",
    "RetryLater",
    "SandboxLost",
    "TangramError",
    "UnitError",
    "VersionMismatch",
    "code_of",
    "error_from_code",
]

EXIT_FAIL, EXIT_USAGE, EXIT_NO_CLUSTER = 1, 2, 4  # 3: a partial `tangram up` (tangram_cli/main.py)


class ErrorCode(str, enum.Enum):  # noqa: UP042 (StrEnum needs 3.11; we support 3.10)
    """Error codes on the wire. The values are part of protocol major 1: never rename one."""

    TIMEOUT = "TIMEOUT"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    NODE_LOST = "NODE_LOST"
    RETRY_LATER = "RETRY_LATER"
    CANCELLED = "CANCELLED"
    NO_CAPACITY = "NO_CAPACITY"
    SANDBOX_LOST = "SANDBOX_LOST"
    BAD_REQUEST = "BAD_REQUEST"
    AUTH = "AUTH"
    REMOTE_ERROR = "REMOTE_ERROR"
    INTERNAL = "INTERNAL"
    VERSION = "VERSION"
    OVER_CAP = "OVER_CAP"  # 1.3


class ProtocolErrorKind(str, enum.Enum):  # noqa: UP042
    """Why bytes from a peer were refused (docs/protocol.md, "Decoding rules")."""

    DECODE = "E_DECODE"  # not valid msgpack: truncated, trailing bytes, bad UTF-8, ext types, nesting
    SCHEMA = "E_SCHEMA"  # framing, unknown type, missing field, wrong type, bad id, NaN, out of range
    VERSION = "E_VERSION"  # frame tag of another protocol major
    TOO_LARGE = "E_TOO_LARGE"  # body, frame count or total bytes over the limits


class TangramError(Exception):
    """Base of every Tangram error. `str(exc)` is the message alone."""

    code: ClassVar[ErrorCode | None] = None
    retryable: ClassVar[bool] = False
    exit_code: ClassVar[int] = EXIT_FAIL
    default_hint: ClassVar[str | None] = None

    def __init__(self, message: str, *, hint: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        self.detail = detail

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


# ---------------------------------------------------------------- remote errors (one per code)


class ActionTimeout(TangramError, TimeoutError):
    """The budget ran out. Also a builtin `TimeoutError`, so `except TimeoutError` catches it.

    For an exec that was killed while running, `stdout_bytes`/`stderr_bytes` hold what it wrote
    before (as much as the agent kept, 16 MiB per stream); `stdout`/`stderr` decode them. Empty
    when it never started, or for other requests."""

    code = ErrorCode.TIMEOUT
    retryable = True
    default_hint = "raise timeout= or make the action shorter"

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        detail: str | None = None,
        stdout_bytes: bytes = b"",
        stderr_bytes: bytes = b"",
    ) -> None:
        super().__init__(message, hint=hint, detail=detail)
        self.stdout_bytes = stdout_bytes
        self.stderr_bytes = stderr_bytes

    def with_output(self, blobs: tuple[bytes, ...] | list[bytes]) -> ActionTimeout:
        """Keep the partial output a timed-out exec's Error carried (blob 0 stdout, 1 stderr)."""
        self.stdout_bytes = bytes(blobs[0]) if len(blobs) > 0 else b""
        self.stderr_bytes = bytes(blobs[1]) if len(blobs) > 1 else b""
        return self

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")


class QuotaExceeded(TangramError):
    code = ErrorCode.QUOTA_EXCEEDED
    retryable = True
    default_hint = "retry later, raise timeout=, or raise the API's quota in the inventory"


class NodeLost(TangramError):
    code = ErrorCode.NODE_LOST
    retryable = True


class RetryLater(TangramError):
    code = ErrorCode.RETRY_LATER
    retryable = True
    default_hint = "the controller is at its submission caps; back off and resubmit"


class Cancelled(TangramError):
    code = ErrorCode.CANCELLED


class NoCapacity(TangramError):
    code = ErrorCode.NO_CAPACITY
    default_hint = "ask for fewer cores, GPUs or memory, or add a node large enough (see `tangram status`)"


class SandboxLost(TangramError):
    code = ErrorCode.SANDBOX_LOST
    default_hint = "the sandbox's node went away; restart the trajectory in a new sandbox"


class BadRequest(TangramError):
    code = ErrorCode.BAD_REQUEST


class MessageTooLarge(BadRequest):
    """A request over `tangram.protocol.MAX_MESSAGE_BYTES`: refused by the client library before it
    is sent (libzmq would drop the frame and the connection, with no reply)."""

    default_hint = "split the data into parts under the limit (e.g. several files)"


class OverCap(TangramError):
    """The controller already holds as many bytes for this client as its cap allows (files put
    before a sandbox's first exec, stdin and payloads of unfinished actions, replies not yet
    delivered). The request was neither run nor kept. Not retried by the library: waiting helps
    only once queued work finishes or replies are read."""

    code = ErrorCode.OVER_CAP
    default_hint = (
        "exec in the sandboxes you put files to (that ships them to their node), wait for queued execs, "
        "read your replies, send fewer or smaller blobs at once, or raise scheduler.max_client_bytes"
    )


class NotPermitted(TangramError):
    code = ErrorCode.AUTH
    default_hint = "use a key whose role allows this request (client keys submit, status keys read)"


class RemoteError(TangramError):
    """A service or sandbox-side handler raised; `detail` holds its traceback as text."""

    code = ErrorCode.REMOTE_ERROR


class InternalError(TangramError):
    code = ErrorCode.INTERNAL
    default_hint = "this is a Tangram bug; the controller log names the request id"


class VersionMismatch(TangramError):
    code = ErrorCode.VERSION
    default_hint = "run `tangram up` so the controller, agents and clients share one version"


# ---------------------------------------------------------------- local errors


class ProtocolError(TangramError):
    """Bytes from a peer failed to decode. `kind` says why; `code` is what to reply with."""

    def __init__(
        self,
        kind: ProtocolErrorKind,
        message: str,
        *,
        hint: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint, detail=detail)
        self.args = (kind, message)
        self.kind = ProtocolErrorKind(kind)

    @property
    def code(self) -> ErrorCode:  # type: ignore[override]  # the wire code to reply with
        return ErrorCode.VERSION if self.kind is ProtocolErrorKind.VERSION else ErrorCode.BAD_REQUEST

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.message}"


class NonZeroExit(TangramError):
    """`exec(..., check=True)` saw a non-zero exit. `result` is the ExecResult.

    Careful: `exit_code` is the CLI's exit code (1), the process's is `result.exit_code`.
    """

    def __init__(
        self,
        message: str,
        *,
        result: object = None,
        hint: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint, detail=detail)
        self.result = result


class ConfigError(TangramError):
    exit_code = EXIT_USAGE


class UnitError(BadRequest, ConfigError, ValueError):
    """A size, duration or cpulist that `tangram.units` refuses. The message names the field, the
    value and the accepted forms. It is a `BadRequest` (the client), a `ConfigError` (agent and
    inventory configuration: exit code 2) and a `ValueError` (pydantic validators) at once."""

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        detail: str | None = None,
        value: object = None,
        what: str = "",
        forms: str = "",
    ) -> None:
        super().__init__(message, hint=hint, detail=detail)
        self.value = value
        self.what = what
        self.forms = forms


class ClusterNotFound(TangramError):
    exit_code = EXIT_NO_CLUSTER
    default_hint = "start one with `tangram up`, or set TANGRAM_ADDR (see `tangram env`)"


class ControllerUnreachable(TangramError):
    exit_code = EXIT_NO_CLUSTER
    retryable = True
    default_hint = "check that the controller runs (`tangram status`) and that TANGRAM_ADDR is right"


# ---------------------------------------------------------------- code <-> class

_CLASS_BY_CODE: dict[ErrorCode, type[TangramError]] = {
    cls.code: cls
    for cls in (
        ActionTimeout,
        QuotaExceeded,
        NodeLost,
        RetryLater,
        Cancelled,
        NoCapacity,
        SandboxLost,
        BadRequest,
        NotPermitted,
        RemoteError,
        InternalError,
        VersionMismatch,
        OverCap,
    )
    if cls.code is not None
}


def error_from_code(code: ErrorCode | str, message: str, detail: str | None = None) -> TangramError:
    """The exception for a wire error. An unknown code (a newer peer) gives a plain TangramError."""
    try:
        cls = _CLASS_BY_CODE[ErrorCode(code)]
    except ValueError:
        return TangramError(f"[{code}] {message}", detail=detail)
    return cls(message, detail=detail)


def code_of(exc: BaseException) -> ErrorCode:
    """The wire code to report `exc` with; anything that is not a remote error is INTERNAL."""
    code = getattr(exc, "code", None) if isinstance(exc, TangramError) else None
    return code if isinstance(code, ErrorCode) else ErrorCode.INTERNAL
