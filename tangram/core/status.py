"""Outcomes with reasons: why an action waits, or why it can never run.

``UNSCHEDULABLE`` means "wait": the resources exist but are busy. ``UNRESOLVABLE`` means
no registered node could ever hold the demand; the action is rejected at once with
``NO_CAPACITY`` instead of blocking the head of its FCFS queue forever.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Code(str, Enum):
    ADMITTED = "admitted"
    UNSCHEDULABLE = "unschedulable"
    UNRESOLVABLE = "unresolvable"
    ERROR = "error"


@dataclass(frozen=True)
class Shortfall:
    """``requested`` units of ``resource`` were asked; ``free`` of ``capacity`` are free."""

    resource: str
    requested: int
    free: int
    capacity: int
    where: str = ""

    def __str__(self) -> str:
        at = f" on {self.where}" if self.where else ""
        return f"{self.resource}: requested {self.requested}, free {self.free} of {self.capacity}{at}"


@dataclass(frozen=True)
class Status:
    code: Code
    reasons: tuple[Shortfall, ...] = ()
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code is Code.ADMITTED

    def __str__(self) -> str:
        parts = [self.code.value]
        if self.message:
            parts.append(self.message)
        parts.extend(str(r) for r in self.reasons)
        return "; ".join(parts)


ADMITTED = Status(Code.ADMITTED)


def wait(*reasons: Shortfall, message: str = "") -> Status:
    return Status(Code.UNSCHEDULABLE, tuple(reasons), message)


def never(*reasons: Shortfall, message: str = "") -> Status:
    return Status(Code.UNRESOLVABLE, tuple(reasons), message)


def error(message: str) -> Status:
    return Status(Code.ERROR, (), message)
