"""Outputs of the core, in the imperative. Every command is a frozen dataclass.

Per node, commands must be applied in the order returned (``CreateSandbox`` before the
``Spawn`` that uses it, ``Evict`` before ``Load`` before ``Invoke``).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from tangram.core.status import Shortfall


@dataclass(frozen=True)
class CreateSandbox:
    node: str
    sandbox: str
    mem_mib: int
    image: str = ""


@dataclass(frozen=True)
class DestroySandbox:
    node: str
    sandbox: str


@dataclass(frozen=True)
class Spawn:
    """Run EXEC action ``action_id`` in ``sandbox`` on exactly ``cores`` with ``dop`` workers;
    with ``after``, a staged start: run it the moment running action ``after`` has ended, on
    ``after``'s cores (``staging.py``)."""

    action_id: str
    node: str
    sandbox: str
    cores: tuple[int, ...]
    dop: int
    est_s: float = 0.0
    after: str = ""


@dataclass(frozen=True)
class Load:
    """Restore ``service`` from host memory onto GPUs ``[start, end)`` of ``node``."""

    node: str
    service: str
    start: int
    end: int
    est_s: float = 0.0


@dataclass(frozen=True)
class Evict:
    """Drop ``service`` from GPUs ``[start, end)`` of ``node`` (no write-back)."""

    node: str
    service: str
    start: int
    end: int


@dataclass(frozen=True)
class Invoke:
    """Run CALL action ``action_id`` on ``service`` resident on GPUs ``[start, end)``."""

    action_id: str
    node: str
    service: str
    start: int
    end: int
    est_s: float = 0.0


@dataclass(frozen=True)
class Grant:
    """API lease ``action_id`` may call ``api`` now, until ``expires`` (core time), with the
    API's key named ``key`` ("" when the API has no keys; the driver hands the holder the
    secret, which the core never sees)."""

    action_id: str
    api: str
    expires: float = 0.0
    key: str = ""


@dataclass(frozen=True)
class Reserve:
    """Reserved sandbox (OPEN action) placed: it holds ``cores`` until it closes."""

    action_id: str
    node: str
    sandbox: str
    cores: tuple[int, ...]


@dataclass(frozen=True)
class Kill:
    """Stop running action ``action_id`` on ``node`` (its whole process tree)."""

    action_id: str
    node: str
    reason: str = ""


@dataclass(frozen=True)
class Reject:
    """Answer ``action_id`` with an error code (``NO_CAPACITY``, ``TIMEOUT``, ...)."""

    action_id: str
    code: str
    message: str
    reasons: tuple[Shortfall, ...] = ()


@dataclass(frozen=True)
class Done:
    """Action ``action_id`` reached its end in the core (resources are free again)."""

    action_id: str
    ok: bool
    reason: str = ""


Command = CreateSandbox | DestroySandbox | Spawn | Load | Evict | Invoke | Grant | Reserve | Kill | Reject | Done

START_COMMANDS = (Spawn, Invoke, Grant, Reserve)


class DecisionFailed(Exception):
    """A step of the core raised. ``commands`` are the ones it emitted before: the state changes
    behind them are made, so the driver must still carry them out (an action the pass started
    and never sent would hold its cores forever). Every pool is decided again at the next call;
    the error is the ``__cause__``."""

    def __init__(self, commands: list[Command]) -> None:
        super().__init__(f"the core failed after {len(commands)} commands")
        self.commands = commands

    @staticmethod
    @contextmanager
    def keeping(out: list[Command], dirty: set[str], pools: Mapping[str, object]) -> Iterator[None]:
        """Turn an error inside into ``DecisionFailed(out)`` (``out`` first when nested), and mark
        every pool for the next pass."""
        try:
            yield
        except DecisionFailed as exc:  # from a nested step: what was emitted out here comes first
            exc.commands[:0] = out
            raise
        except Exception as exc:
            dirty.update(pools)
            raise DecisionFailed(out) from exc
