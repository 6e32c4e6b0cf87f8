"""Slurm-style host lists: expand ``cpu-[01-04,07].internal`` and compress names back.

``expand`` accepts a comma-separated list of patterns; commas inside brackets separate
ranges, commas outside separate hosts. Several bracket groups multiply out in order
(``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). Zero padding follows the lower bound of each
range (``[08-10]`` -> 08 09 10; ``[8-10]`` -> 8 9 10). Errors are strict: unbalanced or
nested brackets, empty items, reversed ranges and lists over ``MAX_HOSTS`` raise
``HostlistError``, a ``ValueError``.

``compress`` is the inverse used by ``tangram status``: names that differ only in their
last number collapse into one bracket group (``cpu-01 cpu-02 cpu-03`` -> ``cpu-[01-03]``),
and ``expand(compress(names))`` yields the same set of names.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

MAX_HOSTS = 10_000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_LAST_NUMBER = re.compile(r"^(.*?)(\d+)(\D*)$")


class HostlistError(ValueError):
    """A host list pattern that cannot be expanded."""


def expand(pattern: str, *, limit: int = MAX_HOSTS) -> list[str]:
    """All host names of a pattern, in order, duplicates kept out."""
    if not isinstance(pattern, str):
        raise HostlistError(f"expected a string, got {type(pattern).__name__}")
    out: list[str] = []
    seen: set[str] = set()
    for item in _split_top(pattern):
        for name in _expand_one(item, limit):
            if name not in seen:
                seen.add(name)
                out.append(name)
            if len(out) > limit:
                raise HostlistError(f"{pattern!r} expands to more than {limit} hosts")
    return out


def _split_top(pattern: str) -> list[str]:
    """Split on commas outside brackets; check that brackets balance and do not nest."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(pattern):
        if ch == "[":
            if depth:
                raise HostlistError(f"nested '[' at position {i} in {pattern!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(f"unbalanced ']' at position {i} in {pattern!r}")
            depth = 0
        elif ch == "," and not depth:
            items.append(pattern[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in {pattern!r} (missing ']')")
    items.append(pattern[start:])
    for item in items:
        if not item.strip():
            raise HostlistError(f"empty host name in {pattern!r}")
        if item != item.strip():
            raise HostlistError(f"white space around {item.strip()!r} in {pattern!r}")
    return items


def _expand_one(item: str, limit: int) -> list[str]:
    """One comma-free pattern: literal text and bracket groups, multiplied out."""
    pieces = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
    parts: list[list[str]] = []
    total = 1
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            parts.append([piece])
            continue
        values = _expand_group(piece, item)
        total *= len(values)
        if total > limit:
            raise HostlistError(f"{item!r} expands to more than {limit} hosts")
        parts.append(values)
    return ["".join(p) for p in itertools.product(*parts)]


def _expand_group(group: str, item: str) -> list[str]:
    values: list[str] = []
    for rng in group.split(","):
        m = _RANGE.match(rng)
        if not m:
            raise HostlistError(f"bad range {rng!r} in {item!r} (expected N or N-M, digits only)")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise HostlistError(f"reversed range {rng!r} in {item!r}")
        if hi - lo >= MAX_HOSTS:
            raise HostlistError(f"range {rng!r} in {item!r} has more than {MAX_HOSTS} values")
        width = len(lo_s)
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def compress(names: Iterable[str]) -> str:
    """The shortest-ish pattern for ``names`` (first-appearance order of the groups)."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    plain: dict[str, None] = {}
    order: list[tuple[str, str, int] | str] = []
    for name in names:
        m = _LAST_NUMBER.match(name)
        if not m or "[" in name or "]" in name or "," in name:
            if name not in plain:
                plain[name] = None
                order.append(name)
            continue
        prefix, digits, suffix = m.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        key = (prefix, suffix, width)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    return ",".join(_render(k, groups[k]) if isinstance(k, tuple) else k for k in order)


def _render(key: tuple[str, str, int], numbers: list[int]) -> str:
    prefix, suffix, width = key
    nums = sorted(set(numbers))
    if len(nums) == 1:
        return f"{prefix}{_fmt(nums[0], width)}{suffix}"
    runs: list[str] = []
    for _, run in itertools.groupby(enumerate(nums), key=lambda t: t[1] - t[0]):
        vals = [v for _, v in run]
        lo, hi = vals[0], vals[-1]
        runs.append(_fmt(lo, width) if lo == hi else f"{_fmt(lo, width)}-{_fmt(hi, width)}")
    return f"{prefix}[{','.join(runs)}]{suffix}"


def _fmt(n: int, width: int) -> str:
    return str(n).zfill(width) if width else str(n)
