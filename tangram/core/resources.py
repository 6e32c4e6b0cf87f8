"""Resource types and demands, in integer units.

Resource type names are plain strings: ``cpu`` (cores), ``mem`` (MiB), ``gpu`` (GPUs),
``gpu_mem`` (MiB per GPU), ``net`` (Mbit/s) and ``api:<name>`` (one slot of an API's
concurrency or quota). Amounts are always ``int``.

A demand for one resource is the set of amounts an action can run with: a fixed amount,
a contiguous range ``[lo, hi]`` or a discrete set (``{1, 2, 4, 8}`` GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass

CPU = "cpu"
MEM = "mem"
GPU = "gpu"
GPU_MEM = "gpu_mem"
NET = "net"
API_PREFIX = "api:"

KNOWN = (CPU, MEM, GPU, GPU_MEM, NET)


def api_resource(name: str) -> str:
    """The resource type that stands for one slot of API ``name``."""
    return API_PREFIX + name


def is_api(resource: str) -> bool:
    return resource.startswith(API_PREFIX)


def valid_resource(resource: str) -> bool:
    return resource in KNOWN or (is_api(resource) and len(resource) > len(API_PREFIX))


@dataclass(frozen=True)
class Demand:
    """The feasible amounts of one resource: ``choices`` if given, else ``lo..hi``."""

    lo: int
    hi: int
    choices: tuple[int, ...] = ()

    @staticmethod
    def fixed(n: int) -> Demand:
        return Demand(n, n)

    @staticmethod
    def range(lo: int, hi: int) -> Demand:
        return Demand(lo, hi)

    @staticmethod
    def of(amounts: tuple[int, ...] | list[int] | frozenset[int]) -> Demand:
        items = tuple(sorted(set(amounts)))
        if not items:
            return Demand(1, 0)  # invalid on purpose; problem() names it
        return Demand(items[0], items[-1], items)

    @property
    def min(self) -> int:
        return self.lo

    @property
    def max(self) -> int:
        return self.hi

    @property
    def contiguous(self) -> bool:
        return not self.choices

    @property
    def elastic(self) -> bool:
        return self.hi > self.lo

    def options(self) -> tuple[int, ...]:
        """Every feasible amount, ascending."""
        return self.choices if self.choices else tuple(range(self.lo, self.hi + 1))

    def allows(self, n: int) -> bool:
        return n in self.choices if self.choices else self.lo <= n <= self.hi

    def clamp_max(self, cap: int) -> Demand:
        """The same demand with amounts above ``cap`` removed (the minimum is kept)."""
        if self.hi <= cap:
            return self
        if self.choices:
            kept = tuple(c for c in self.choices if c <= cap) or (self.lo,)
            return Demand(kept[0], kept[-1], kept)
        return Demand(self.lo, max(self.lo, cap))

    def problem(self) -> str | None:
        """Why this demand is malformed, or None."""
        if self.lo < 0 or self.hi < 0:
            return "amounts must be >= 0"
        if self.lo > self.hi:
            return f"min {self.lo} is above max {self.hi}"
        if self.choices and any(c < 0 for c in self.choices):
            return "amounts must be >= 0"
        return None

