"""Readers and cell formats shared by the `tangram status` tables (render/status.py, render/queue.py).

The row schema belongs to the controller (docs/protocol.md), so every reader is defensive: a missing
key renders as ``-`` and aliases are tried in order (``first(row, "node", "name")``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Col = tuple[str, Callable[[Mapping[str, Any]], str]]  # a column: its title and its cell of a row


def rows(records: Mapping[str, Any] | None, section: str) -> list[dict[str, Any]]:
    """The rows of a section, whatever shape it came in (list, {"rows": [...]}, {name: row})."""
    if not records:
        return []
    raw = records.get(section)
    if isinstance(raw, dict) and isinstance(raw.get("rows"), list):
        raw = raw["rows"]
    if isinstance(raw, dict):
        out = []
        for k, v in raw.items():
            if isinstance(v, dict):
                out.append({"name": k, **v})
        return out
    if isinstance(raw, list):
        return [r for r in raw if isinstance(r, dict)]
    return []


def first(row: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return default


def num(v: Any) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def frac(a: Any, b: Any, unit: str = "") -> str:
    if num(a) is None and num(b) is None:
        return "-"
    fa = "-" if num(a) is None else short(a)
    fb = "-" if num(b) is None else short(b)
    return f"{fa}/{fb}{unit}"


def short(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


def mib(v: Any) -> str:
    n = num(v)
    if n is None:
        return "-"
    if n >= 1024:
        g = n / 1024
        return f"{g:.0f}GiB" if g >= 10 or g.is_integer() else f"{g:.1f}GiB"
    return f"{n:.0f}MiB"


def seconds(v: Any) -> str:
    n = num(v)
    if n is None:
        return "-"
    if n < 1:
        return f"{n * 1000:.0f}ms"
    if n < 60:
        return f"{n:.1f}s"
    return duration(n)


def duration(s: float) -> str:
    s = int(max(0, s))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d{h}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def listish(v: Any) -> str:
    if v is None or v == [] or v == "":
        return "-"
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    return str(v)
