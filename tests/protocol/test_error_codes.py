"""Error codes <-> exception classes: a bijection, with the retryability docs/protocol.md gives
("Errors on the wire")."""

from __future__ import annotations

import copy

import pytest

import tangram
from tangram import errors as e
from tangram.errors import ErrorCode
from tangram_cli import errors as ce

REMOTE = [
    e.ActionTimeout,
    e.QuotaExceeded,
    e.NodeLost,
    e.RetryLater,
    e.Cancelled,
    e.NoCapacity,
    e.SandboxLost,
    e.BadRequest,
    e.NotPermitted,
    e.RemoteError,
    e.InternalError,
    e.VersionMismatch,
    e.OverCap,
]
RETRYABLE = {ErrorCode.TIMEOUT, ErrorCode.QUOTA_EXCEEDED, ErrorCode.NODE_LOST, ErrorCode.RETRY_LATER}

# The wire values are frozen for protocol major 1.
WIRE_VALUES = {
    "TIMEOUT",
    "QUOTA_EXCEEDED",
    "NODE_LOST",
    "RETRY_LATER",
    "CANCELLED",
    "NO_CAPACITY",
    "SANDBOX_LOST",
    "BAD_REQUEST",
    "AUTH",
    "REMOTE_ERROR",
    "INTERNAL",
    "VERSION",
    "OVER_CAP",  # added in 1.3 (an older peer maps it to a plain TangramError)
}


def test_wire_values_are_stable() -> None:
    assert {c.value for c in ErrorCode} == WIRE_VALUES
    assert all(c.value == c.name for c in ErrorCode)


def test_code_class_mapping_is_a_bijection() -> None:
    codes = [cls.code for cls in REMOTE]
    assert len(set(codes)) == len(codes) == len(ErrorCode)
    for code in ErrorCode:
        exc = e.error_from_code(code, "m", "d")
        assert e.code_of(exc) is code
        assert type(exc) in REMOTE
        assert type(e.error_from_code(code.value, "m")) is type(exc)  # strings from the wire work too
    for cls in REMOTE:
        assert type(e.error_from_code(e.code_of(cls("m")), "m")) is cls


@pytest.mark.parametrize("cls", REMOTE, ids=lambda cls: cls.__name__)
def test_retryable_matches_the_architecture(cls: type[e.TangramError]) -> None:
    assert cls.retryable is (cls.code in RETRYABLE)
    assert cls("m").retryable is cls.retryable


def test_mapping_never_uses_class_names() -> None:
    exc = e.error_from_code("ActionTimeout", "m")
    assert type(exc) is e.TangramError
    assert exc.code is None
    assert exc.message == "[ActionTimeout] m"


def test_unknown_code_from_a_newer_peer() -> None:
    exc = e.error_from_code("DISK_FULL", "no space", "detail")
    assert type(exc) is e.TangramError
    assert (exc.retryable, exc.detail) == (False, "detail")


def test_code_of_non_tangram_errors_is_internal() -> None:
    assert e.code_of(ValueError("x")) is ErrorCode.INTERNAL
    assert e.code_of(e.ConfigError("x")) is ErrorCode.INTERNAL
    assert e.code_of(e.ProtocolError(e.ProtocolErrorKind.DECODE, "x")) is ErrorCode.BAD_REQUEST
    assert e.code_of(e.ProtocolError(e.ProtocolErrorKind.VERSION, "x")) is ErrorCode.VERSION


def test_base_attributes() -> None:
    exc = e.TangramError("it broke", hint="do this", detail="tb")
    assert (str(exc), exc.message, exc.hint, exc.detail) == ("it broke", "it broke", "do this", "tb")
    assert (exc.code, exc.retryable, exc.exit_code) == (None, False, 1)
    assert repr(exc) == "TangramError('it broke')"
    assert e.RemoteError("boom", detail="Traceback ...").detail == "Traceback ..."


@pytest.mark.parametrize(
    ("cls", "exit_code"),
    [
        (e.TangramError, 1),
        (e.ConfigError, 2),
        (ce.InventoryError, 2),
        (e.ClusterNotFound, 4),
        (e.ControllerUnreachable, 4),
        (ce.BootstrapError, 1),
        (ce.HostUnreachable, 1),
        (e.NonZeroExit, 1),
    ],
)
def test_exit_codes(cls: type[e.TangramError], exit_code: int) -> None:
    assert cls("m").exit_code == exit_code


def test_operator_errors_carry_hints() -> None:
    for cls in (
        e.ClusterNotFound,
        e.ControllerUnreachable,
        ce.HostUnreachable,
        ce.AuthFailed,
        ce.HostKeyMismatch,
    ):
        assert cls("m").hint, cls
    assert e.ClusterNotFound("m", hint="custom").hint == "custom"


def test_tree() -> None:
    assert issubclass(ce.InventoryError, e.ConfigError)
    for cls in (ce.HostUnreachable, ce.AuthFailed, ce.HostKeyMismatch):
        assert issubclass(cls, ce.BootstrapError)
    assert ce.HostKeyMismatch("changed", host="n1").host == "n1"
    for module in (e, ce):  # the library's tree, and the operator's errors that extend it
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                assert issubclass(obj, e.TangramError)
                assert obj.__name__ in module.__doc__, f"{name} missing from the tree in the docstring"


def test_non_zero_exit_carries_the_result() -> None:
    result = object()
    exc = e.NonZeroExit("exit 3", result=result)
    assert exc.result is result


def test_errors_survive_copy() -> None:  # the same protocol multiprocessing uses
    samples = [
        e.NoCapacity("too big", hint="h", detail="d"),
        e.ProtocolError(e.ProtocolErrorKind.SCHEMA, "Exec.cmd: missing"),
        e.NonZeroExit("exit 1", result={"exit_code": 1}),
        ce.HostKeyMismatch("changed", host="n1"),
    ]
    for exc in samples:
        clone = copy.deepcopy(exc)
        assert type(clone) is type(exc)
        assert clone.__dict__.keys() == exc.__dict__.keys()
        assert (str(clone), clone.hint, clone.detail) == (str(exc), exc.hint, exc.detail)


def test_package_reexports_errors_lazily() -> None:
    assert tangram.ActionTimeout is e.ActionTimeout
    assert tangram.ErrorCode is ErrorCode
    with pytest.raises(AttributeError):
        _ = tangram.NoSuchError
