"""The QUEUE table of `tangram status`: running actions first (``R``/``CG``, at most ``RUNNING_SHOWN``
unless wide) and then the waiting ones (``PD``), as squeue lists them, with a line on how many more
there are; a waiting action's reason in the words of docs/cli.md (``waiting (...)``, ``unschedulable
(...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tangram.units import format_cpulist
from tangram_cli.render.cells import Col, first, listish, num, rows, seconds, short

RUNNING_SHOWN = 10  # running actions listed by default (-a / -o wide: every row fetched)
QUEUE_COLS: list[Col] = [
    ("ACTION", lambda r: str(first(r, "action_id", "action", "id", default="?"))),
    ("CLIENT", lambda r: client_label(r)),
    ("SANDBOX", lambda r: str(first(r, "sandbox", default="") or "-")),
    ("KIND", lambda r: str(first(r, "kind", default="-"))),
    ("ST", lambda r: _st(first(r, "st", "state", "status", default="PD"))),
    ("TIME", lambda r: seconds(first(r, "run_s", "waited_s", "wait_s"))),
    ("RESOURCES", lambda r: _resources(r)),
    ("NODE(REASON)", lambda r: str(first(r, "node", default="") or reason_text(r))),
]


def client_label(r: Mapping[str, Any]) -> str:
    """A client as status names it: its name (the CURVE key's name, then the Hello's when they differ)
    and its short tag; just the tag without a name. Never a whole identity (sessions.py)."""
    tag = str(first(r, "client", default="") or "")
    if len(tag) > 8 and all(c in "0123456789abcdef" for c in tag.lower()):
        tag = tag[:6]  # an older controller's full client key: the tag is its first 6 digits
    owner, name = str(first(r, "owner", default="") or ""), str(first(r, "name", default="") or "")
    label = f"{owner}/{name}" if owner and name and owner != name else owner or name
    if not label:
        return tag or "-"
    return f"{label} ({tag})" if tag else label


# the core's wait codes (tangram/core/status.py) as status shows them: "unschedulable" there means
# "the resources exist but are busy: wait"; only "unresolvable" means it can never fit
_REASON_WORDS = {
    "busy": "waiting",
    "unschedulable": "waiting",
    "never_fits": "unschedulable",
    "unresolvable": "unschedulable",
    "error": "error",
}


def reason_code(r: Mapping[str, Any]) -> str:
    """``pending``, ``busy``, ``never_fits`` or ``error``: the record's ``reason_code``, else read from an
    older controller's ``reason`` ("unschedulable; cpus: ..."); "" when it says none."""
    code = first(r, "reason_code")
    if isinstance(code, str) and code:
        return code
    head = str(first(r, "reason", default="") or "").split(";", 1)[0].strip()
    codes = {"unschedulable": "busy", "unresolvable": "never_fits", "error": "error", "admitted": "pending"}
    return codes.get(head, "pending" if head == "pending" else "")


def reason_text(r: Mapping[str, Any]) -> str:
    """Why a waiting action waits: ``waiting (cpus: requested 4, free 0 of 12 on local)``; only an action
    no node could ever hold reads ``unschedulable (...)``."""
    code = reason_code(r)
    text = str(first(r, "reason", default="") or "")
    head, _, rest = text.partition(";")
    if head.strip() in ("unschedulable", "unresolvable", "error", "pending", "admitted"):
        text = rest.strip()
    if not code:
        return text or "-"
    if code == "pending":
        return "pending" + (f" ({text})" if text else "")
    word = _REASON_WORDS.get(code, code)
    return f"{word} ({text})" if text else word


def _resources(r: Mapping[str, Any]) -> str:
    """A running action's grant (``cores 0-3``, ``gpus 0,1``, ``1 unit``), else the demand it waits with."""
    grant = first(r, "grant")
    if grant is None or grant == []:
        return str(first(r, "demand", default="-") or "-")
    kind = first(r, "kind")
    if isinstance(grant, list) and kind in ("exec", "call"):
        ids = [g for g in grant if isinstance(g, int) and not isinstance(g, bool) and g >= 0]
        listed = format_cpulist(sorted(set(ids))) if len(ids) == len(grant) else listish(grant)
        return f"{'cores' if kind == 'exec' else 'gpus'} {listed}"
    if num(grant) is not None:
        return f"{short(grant)} unit{'s' if grant != 1 else ''}"
    return listish(grant)


def action_rows(records: Mapping[str, Any], *, wide: bool) -> tuple[list[dict[str, Any]], str]:
    """Running actions (at most RUNNING_SHOWN unless ``wide``) then waiting ones, as squeue lists
    them; and a line on what is not shown ("" when everything is)."""
    running = rows(records, "actions")
    waiting = rows(records, "queue")
    shown = running if wide else running[:RUNNING_SHOWN]
    meta = records.get("cluster") if isinstance(records.get("cluster"), dict) else {}
    n_running = num(first(meta, "running"))
    n_waiting = num(first(meta, "queue", "queued"))
    more_r = max(0, int(n_running if n_running is not None else len(running)) - len(shown))
    more_w = max(0, int(n_waiting if n_waiting is not None else len(waiting)) - len(waiting))
    parts = []
    if more_r:
        parts.append(f"{more_r} more running")
    if more_w:
        parts.append(f"{more_w} more waiting")
    note = ""
    if parts:
        how = "-a shows every row fetched, --limit N fetches more" if not wide else "--limit N fetches more"
        note = f"... and {', '.join(parts)} ({how})"
    return [*shown, *waiting], note


def _st(v: Any) -> str:
    s = str(v)
    return "PD" if s in ("pending", "waiting") or s.startswith(("unschedulable", "admitted")) else s[:12]
