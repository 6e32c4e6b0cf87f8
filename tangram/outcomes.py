"""One typed shape for an action's outcome along its whole path: agent -> controller -> client.

`Result.body` stays a free-form map on the wire (so minor versions can add keys), but nobody
reads or writes its keys by hand: the agent builds an `ExecOutcome` / `CallOutcome` and sends
`to_body()`; the controller reads it back with `from_body()`, adds what only it knows
(queueing, overhead, the grant) as `to_body(**fields)` and sends that on; the
client turns `from_body()` into its `ExecResult` / `CallResult`. Keys a peer leaves out take
the field's default; keys a newer peer adds are ignored; a key of the wrong type is a
`ProtocolError` naming it (`from_body` never guesses).

docs/protocol.md ("Result bodies") lists the keys; `tests/protocol/test_outcomes.py` checks
that the table and these classes agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tangram.errors import ProtocolError, ProtocolErrorKind

__all__ = ["CallOutcome", "ExecOutcome"]


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _float(v: object) -> bool:
    return (isinstance(v, float) and math.isfinite(v)) or _int(v)


def _ints(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(_int(x) for x in v)


_CHECKS: dict[str, Callable[[object], bool]] = {  # by the field's annotation
    "int": _int,
    "float": _float,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "tuple[int, ...]": _ints,
}


class _Outcome:
    _kinds: ClassVar[dict[str, str]]
    _lists: ClassVar[tuple[str, ...]]  # the fields that travel as lists
    _reads: ClassVar[tuple[tuple[str, str, Callable[[object], bool], Callable[[Any], Any] | None], ...]]

    def to_body(self, **extra: Any) -> dict[str, Any]:
        """The `Result.body` map for this outcome (tuples become lists), with the fields named
        in `extra` set to its values: the controller adds what only it knows this way, without
        building a second outcome (a field name that does not exist is a TypeError)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in self._kinds}
        if extra:
            if not extra.keys() <= out.keys():
                raise TypeError(f"{type(self).__name__} has no field(s) {sorted(extra.keys() - out.keys())}")
            out.update(extra)
        for name in self._lists:
            v = out[name]
            if isinstance(v, tuple):
                out[name] = list(v)
        return out

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Any:
        """The outcome in a `Result.body`; missing keys take defaults, unknown keys are ignored."""
        values: dict[str, Any] = {}
        get = body.get
        for name, kind, check, convert in cls._reads:
            v = get(name)
            if v is None:
                continue
            if not check(v):
                raise ProtocolError(
                    ProtocolErrorKind.SCHEMA,
                    f"{cls.__name__}.{name}: expected {kind}, got {type(v).__name__}",
                )
            values[name] = v if convert is None else convert(v)
        return cls(**values)


_CONVERT: dict[str, Callable[[Any], Any]] = {"float": float, "tuple[int, ...]": tuple}  # (ints for floats)


def _kinds(cls: type) -> type:
    cls._kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}  # type: ignore[attr-defined]
    cls._reads = tuple(  # type: ignore[attr-defined]  # what from_body does per field, looked up once
        (n, k, _CHECKS[k], _CONVERT.get(k)) for n, k in cls._kinds.items()  # type: ignore[attr-defined]
    )
    cls._lists = tuple(n for n, k in cls._kinds.items() if k.startswith("tuple"))  # type: ignore[attr-defined]
    return cls


@dataclass(frozen=True)
class _Attempt(_Outcome):
    """What every action outcome carries: the run time the agent measured, the attempt's
    identity (echoed by the agent so a late reply of an older attempt or controller epoch is told apart
    and dropped: docs/recovery.md), and the controller's timing."""

    run_s: float = 0.0  # process or call start to end, measured by the agent
    action: str = ""
    attempt: int = 0
    epoch: int = 0
    agent_epoch: int = 0
    node: str = ""
    queued_s: float = 0.0  # added by the controller
    overhead_s: float = 0.0  # added by the controller


@_kinds
@dataclass(frozen=True)
class ExecOutcome(_Attempt):
    """How one exec ended. The agent fills what it saw; the controller adds the rest."""

    exit_code: int = -1
    truncated: bool = False  # output capped at 16 MiB
    timed_out: bool = False  # killed by the node for running past its timeout
    killed: bool = False  # killed on the controller's order (cancel, timeout, client gone)
    setup_s: float = 0.0  # cpuset and spawn before the process ran
    waited_s: float = 0.0  # a staged start: on the agent, waiting for the action whose cores it takes
    unstaged: bool = False  # a staged start the agent gave back unstarted: its predecessor overran
    cores: tuple[int, ...] = ()
    dop: int = 0  # added by the controller


@_kinds
@dataclass(frozen=True)
class CallOutcome(_Attempt):
    """How one GPU call ended (its value travels as blob 0)."""

    service: str = ""
    gpus: tuple[int, ...] = ()  # added by the controller
    loaded: bool = False  # added by the controller: the service was restored onto the GPUs for this call
