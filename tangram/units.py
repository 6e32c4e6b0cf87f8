"""Sizes, durations and cpulists: one parser each, used by the client, the agent and the inventory.

The rules (docs/cli.md, "Units"):

* **Size** -> whole MiB. An ``int``, or a string of digits, is MiB. Otherwise a number (``2``,
  ``1.5``) and a unit, optionally separated by spaces: ``B``; ``KB MB GB TB`` (powers of 1000);
  ``KiB MiB GiB TiB`` (powers of 1024). Units are case-insensitive. A bare ``K``/``M``/``G``/``T`` is
  refused as ambiguous (Docker reads ``2g`` as GiB, Kubernetes ``2G`` as 10^9 bytes). The value is
  rounded down to whole MiB (``"2GB"`` is 1907 MiB); a non-zero size under 1 MiB is refused.
* **Duration** -> seconds. An ``int`` or ``float``, or a plain number string, is seconds. Otherwise a
  number and a unit: ``ms s m h`` (case-insensitive). Kept to whole milliseconds where a consumer
  stores milliseconds (rounded down; a non-zero duration under 1 ms is refused).
* **Cpulist** -> sorted tuple of core numbers. The kernel's cpulist syntax (``0-3,8``): items ``N``
  or ``N-M`` separated by commas, spaces allowed around items (not inside a range), decimal
  numbers without leading zeros, at most ``MAX_CPU``; no empty item, reversed range or repeated
  core. A list of ints is accepted as well. Empty only where the caller allows it (a
  memory-only NUMA node's ``cpulist`` file).

Everywhere: no negatives, no signs, no exponents, no booleans. Where a field's name says no unit
(the inventory's ``mem``, ``connect_timeout``...), a caller may require the unit
(``unit_required=True``): a bare number there is refused rather than guessed.

Every refusal is a `tangram.errors.UnitError`, which is a `BadRequest`, a `ConfigError` and a
`ValueError` at once, so the client, the agent's configuration and pydantic models each see the
error type they already handle. Stdlib only (the agent bundle imports it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from tangram.errors import UnitError

__all__ = [
    "CPULIST_FORMS",
    "DURATION_FORMS",
    "MAX_CPU",
    "SIZE_FORMS",
    "UnitError",
    "format_cpulist",
    "format_size_mib",
    "parse_cpulist",
    "parse_duration_ms",
    "parse_duration_s",
    "parse_size_mib",
]

MAX_CPU = 8191  # Linux's largest NR_CPUS is 8192

SIZE_FORMS = (
    "an integer number of MiB, or a number and a unit: B, KB, MB, GB, TB (powers of 1000) "
    "or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive, e.g. '4GiB' or '512MiB'"
)
DURATION_FORMS = "a number of seconds, or a number and a unit: ms, s, m or h, e.g. '30s' or '500ms'"
CPULIST_FORMS = "a cpulist such as '0-3,8' (N or N-M items, comma-separated) or a list of core numbers"

_NUMBER_UNIT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_SIZE_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_AMBIGUOUS = {"k", "m", "g", "t"}
_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
_CPU_NUMBER = r"(?:0|[1-9][0-9]*)"
_CPU_ITEM = re.compile(rf"({_CPU_NUMBER})(?:-({_CPU_NUMBER}))?")


def _fail(what: str, why: str, value: Any, forms: str, hint: str) -> UnitError:
    """``mem: cannot read size: '2 gigs' (accepted: ...)``: the field, the reason, the value, the forms."""
    where = f"{what}: " if what else ""
    return UnitError(
        f"{where}{why}: {value!r} (accepted: {forms})", hint=hint, value=value, what=what, forms=forms
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_unit(value: str, what: str, kind: str, forms: str, hint: str) -> tuple[Fraction, str]:
    """(number, unit as written or "") of a string such as ``"1.5 GiB"``."""
    m = _NUMBER_UNIT.fullmatch(value)
    if m is None:
        why = f"negative {kind}" if value.strip().startswith("-") else f"cannot read {kind}"
        raise _fail(what, why, value, forms, hint)
    return Fraction(m.group(1)), m.group(2)


# ---------------------------------------------------------------- sizes


def parse_size_mib(
    value: Any, what: str = "size", *, unit_required: bool = False, max_mib: int | None = None
) -> int:
    """Whole MiB of a size: ``"16GiB"`` -> 16384, ``"2GB"`` -> 1907, ``2048`` -> 2048."""
    hint = "write e.g. 4GiB, 512MiB or 2GB" + ("" if unit_required else ", or a number of MiB")
    if _is_int(value) and not unit_required:
        if value < 0:
            raise _fail(what, "negative size", value, SIZE_FORMS, hint)
        mib = value
    elif isinstance(value, str):
        number, unit = _number_unit(value, what, "size", SIZE_FORMS, hint)
        if not unit and (unit_required or number.denominator != 1):
            why = "missing unit in size" if unit_required else "a size without a unit must be whole MiB"
            raise _fail(what, why, value, SIZE_FORMS, hint)
        if unit.lower() in _AMBIGUOUS:
            big = unit.upper()
            raise _fail(
                what, f"ambiguous unit {unit!r} in size (write {big}iB or {big}B)", value, SIZE_FORMS, hint
            )
        if unit and unit.lower() not in _SIZE_BYTES:
            raise _fail(what, f"unknown unit {unit!r} in size", value, SIZE_FORMS, hint)
        mib = int(number * _SIZE_BYTES[unit.lower()] / (1 << 20)) if unit else int(number)
        if mib == 0 and number != 0:
            raise _fail(what, "size below 1 MiB", value, SIZE_FORMS, hint)
    else:
        why = "missing unit in size" if _is_int(value) else "not a size"
        raise _fail(what, why, value, SIZE_FORMS, hint)
    if max_mib is not None and mib > max_mib:
        raise _fail(what, f"size above the limit of {format_size_mib(max_mib)}", value, SIZE_FORMS, hint)
    return mib


def format_size_mib(mib: int) -> str:
    """The exact size as text that `parse_size_mib` reads back: 2048 -> ``"2GiB"``, 1500 -> ``"1500MiB"``."""
    if not _is_int(mib) or mib < 0:
        raise _fail("", "cannot format size", mib, "a whole number of MiB >= 0", "pass an int")
    for unit, shift in (("TiB", 20), ("GiB", 10)):
        if mib and mib % (1 << shift) == 0:
            return f"{mib >> shift}{unit}"
    return f"{mib}MiB"


# ---------------------------------------------------------------- durations


def parse_duration_s(value: Any, what: str = "duration", *, unit_required: bool = False) -> float:
    """Seconds of a duration: ``"10s"`` -> 10.0, ``"500ms"`` -> 0.5, ``"1.5m"`` -> 90.0, ``3`` -> 3.0."""
    return float(_duration(value, what, unit_required))


def parse_duration_ms(value: Any, what: str = "duration", *, unit_required: bool = False) -> int:
    """Whole milliseconds of a duration (rounded down): ``"10s"`` -> 10000."""
    seconds = _duration(value, what, unit_required)
    ms = int(seconds * 1000)
    if ms == 0 and seconds != 0:
        raise _fail(what, "duration below 1 ms", value, DURATION_FORMS, "write e.g. 1ms")
    return ms


def _duration(value: Any, what: str, unit_required: bool) -> Fraction:
    hint = "write e.g. 30s, 500ms, 5m or 1h" + ("" if unit_required else ", or a number of seconds")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not unit_required:
        if not math.isfinite(value) or value < 0:
            raise _fail(what, "not a finite duration >= 0", value, DURATION_FORMS, hint)
        return Fraction(str(value))  # the decimal the user wrote: 0.3 is 3/10, not 0.29999...
    if not isinstance(value, str):
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        why = "missing unit in duration" if numeric else "not a duration"
        raise _fail(what, why, value, DURATION_FORMS, hint)
    number, unit = _number_unit(value, what, "duration", DURATION_FORMS, hint)
    if not unit:
        if unit_required:
            raise _fail(what, "missing unit in duration", value, DURATION_FORMS, hint)
        return number
    if unit.lower() not in _DURATION_MS:
        raise _fail(what, f"unknown unit {unit!r} in duration", value, DURATION_FORMS, hint)
    return number * _DURATION_MS[unit.lower()] / 1000


# ---------------------------------------------------------------- cpulists


def parse_cpulist(
    value: Any, what: str = "cpus", *, allow_empty: bool = False, max_cpu: int = MAX_CPU
) -> tuple[int, ...]:
    """Sorted distinct cores of a cpulist: ``"0-3, 8"`` -> (0, 1, 2, 3, 8); ``[3, 1]`` -> (1, 3)."""
    hint = "write e.g. 0-3,8"
    if isinstance(value, (list, tuple)):
        if not all(_is_int(c) and 0 <= c <= max_cpu for c in value):
            raise _fail(what, f"core numbers must be 0..{max_cpu}", value, CPULIST_FORMS, hint)
        cores = list(value)
    elif isinstance(value, str):
        cores = _cpulist_text(value, what, max_cpu, hint)
    else:
        raise _fail(what, "not a cpulist", value, CPULIST_FORMS, hint)
    if not cores and not allow_empty:
        raise _fail(what, "empty cpulist", value, CPULIST_FORMS, hint)
    if len(set(cores)) != len(cores):
        raise _fail(what, "a core is listed twice in cpulist", value, CPULIST_FORMS, hint)
    return tuple(sorted(cores))


def _cpulist_text(text: str, what: str, max_cpu: int, hint: str) -> list[int]:
    if not text.strip():
        return []
    cores: list[int] = []
    for item in text.split(","):
        m = _CPU_ITEM.fullmatch(item.strip())
        if m is None:
            why = f"item {item.strip()!r} is not N or N-M (decimal, no leading zeros) in cpulist"
            raise _fail(what, why, text, CPULIST_FORMS, hint)
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else int(m.group(2))
        if hi < lo:
            raise _fail(what, f"reversed range {item.strip()!r} in cpulist", text, CPULIST_FORMS, hint)
        if hi > max_cpu:
            raise _fail(what, f"core {hi} above {max_cpu} in cpulist", text, CPULIST_FORMS, hint)
        cores.extend(range(lo, hi + 1))
    return cores


def format_cpulist(cores: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> ``"0-3,8"``: sorted, runs collapsed; `parse_cpulist` reads it back."""
    ordered = sorted(set(cores))
    if not ordered or not all(_is_int(c) and c >= 0 for c in ordered):
        raise _fail(
            "", "cannot format cpulist", ordered, "a non-empty set of core numbers >= 0", "pass cores"
        )
    parts: list[str] = []
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)
