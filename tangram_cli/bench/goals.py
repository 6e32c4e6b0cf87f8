"""PASS/FAIL of a benchmark's figures against its goals (pure; tested on fixed inputs).

Each benchmark turns its document into ``{goal key: met}`` where met is True, False, or None
(not measured: the figure is missing, or the goal does not apply to this run). The JSON
document carries that map as ``met``; the table gets a ``met`` column (PASS / FAIL / -) and a
one-line summary. Timings are never asserted in tests, only this logic.
"""

from __future__ import annotations

from typing import Any

Met = dict[str, "bool | None"]


def at_most(value: Any, limit: float) -> bool | None:
    return None if not isinstance(value, (int, float)) or isinstance(value, bool) else value <= limit


def at_least(value: Any, limit: float) -> bool | None:
    return None if not isinstance(value, (int, float)) or isinstance(value, bool) else value >= limit


def word(met: bool | None) -> str:
    return "-" if met is None else ("PASS" if met else "FAIL")


def styled(met: bool | None) -> str:
    """``word`` with rich markup (green PASS, bold red FAIL)."""
    if met is None:
        return "-"
    return "[green]PASS[/]" if met else "[bold red]FAIL[/]"


def summary(met: Met) -> str:
    """``goals: PASS (4 of 4 met)`` or ``goals: FAIL (2 of 4 missed: x, y)``; unmeasured ones named."""
    judged = {k: v for k, v in met.items() if v is not None}
    failed = [k for k, v in judged.items() if not v]
    skipped = [k for k, v in met.items() if v is None]
    if failed:
        text = f"goals: FAIL ({len(failed)} of {len(judged)} missed: {', '.join(failed)})"
    else:
        text = f"goals: PASS ({len(judged)} of {len(judged)} met)"
    if skipped:
        text += f"; not measured: {', '.join(skipped)}"
    return text


def overall(met: Met) -> bool | None:
    """True when every measured goal is met, False when one is not, None when none was measured."""
    judged = [v for v in met.values() if v is not None]
    return None if not judged else all(judged)


def scheduler_goals(rows: list[dict[str, Any]], p99_ms: float = 1.0, ratio: float = 2.0) -> dict[str, Any]:
    """`bench scheduler`: p99 <= ``p99_ms`` at 1024 queued; every p99 <= ``ratio`` x the
    shortest queue's. Goal key -> {goal, measured, met}."""
    at_1024 = next((r["p99_ms"] for r in rows if r.get("queued") == 1024), None)
    ratios = [r["p99_ratio"] for r in rows if "p99_ratio" in r]
    worst = max(ratios) if ratios else None
    return {
        "p99_ms_at_1024": {"goal": f"<= {p99_ms:g} ms", "measured": at_1024, "met": at_most(at_1024, p99_ms)},
        "p99_ratio_max": {"goal": f"<= {ratio:g}x", "measured": worst, "met": at_most(worst, ratio)},
    }
