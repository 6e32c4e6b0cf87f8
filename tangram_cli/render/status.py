"""`tangram status` rendering: header, NODES / SERVICES / APIS / KEYS / JOBS / QUEUE tables (docs/cli.md,
`tangram status`). KEYS appears when an API has a key pool (with the APIS table: `--apis`); JOBS
once a client names an RL job or the config defines one.

QUEUE lists running actions first (``R``/``CG``, at most ``RUNNING_SHOWN`` unless wide) and then the
waiting ones (``PD``), as squeue does, with a line on how many more there are (render/queue.py).
NODES gets a POOL(idle/target) column when any node keeps a warm sandbox pool (``pool_target`` or
``pool_idle`` above 0); a cluster without pools shows none.

The controller's ``Status.records`` maps a section name to rows (dicts). The row schema belongs to
the controller (docs/protocol.md), so every reader (render/cells.py) is defensive: a missing key renders as
``-``, an unknown section is shown only with ``-o wide``, and aliases (``node``/``name``) are tried.
Identical nodes collapse into one row named by a hostlist range (``cpu-[01-03]``), as sinfo does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from tangram_cli.hostlist import compress
from tangram_cli.render.cells import Col, first, frac, listish, mib, num, rows, seconds
from tangram_cli.render.cells import duration as duration  # re-exported: `tangram up` reads it here
from tangram_cli.render.queue import QUEUE_COLS, action_rows
from tangram_cli.render.queue import RUNNING_SHOWN as RUNNING_SHOWN  # re-exported for status's readers

# Imported where used, not here (start-up cost): rich (only tables need it; `tangram status -o json` does
# not) and tangram.protocol (~0.1 s; the bootstrap loads this module too).

KNOWN_SECTIONS = ("nodes", "services", "apis", "jobs", "queue")
DOWN = ("down", "unreach", "lost", "gone", "dead", "failed")  # failed: `up` could not bootstrap it


def node_name(row: Mapping[str, Any]) -> str:
    return str(first(row, "node", "name", "host", default="?"))


def node_state(row: Mapping[str, Any]) -> str:
    """sinfo words: idle, mix, alloc, drain, down, boot, unreach (``*``: no heartbeat)."""
    s = first(row, "state", "status")
    if isinstance(s, str) and s:
        return s.lower()
    alive = first(row, "alive", "healthy", "registered")
    if alive is False:
        return "down*"
    used, total = num(first(row, "cpus_used", "cpus_alloc")), num(first(row, "cpus_total"))
    gb, gt = num(first(row, "gpus_busy")), num(first(row, "gpus_total"))
    if used is None and gb is None:
        return "up"
    busy = (used or 0) + (gb or 0)
    cap = (total or 0) + (gt or 0)
    if busy == 0:
        return "idle"
    return "alloc" if busy >= cap else "mix"


def healthy(row: Mapping[str, Any]) -> bool:
    agent = row.get("agent_state")
    if isinstance(agent, str) and agent != "up":
        return False
    s = node_state(row)
    return not s.endswith("*") and not s.startswith(DOWN)


# ---------------------------------------------------------------- columns


def _gpu_mem(r: Mapping[str, Any]) -> str:
    used = first(r, "gpu_mem_used_mib")
    total = first(r, "gpu_mem_total_mib")
    if isinstance(used, list):
        used = sum(x for x in used if num(x) is not None)
    if isinstance(total, list):
        total = sum(x for x in total if num(x) is not None)
    if total is None:
        per = num(first(r, "gpu_mem_mib"))
        n = num(first(r, "gpus_total"))
        total = per * n if per is not None and n else None
    if not first(r, "gpus_total"):
        return "-"
    return f"{mib(used) if used is not None else '-'}/{mib(total) if total is not None else '-'}"


NODE_COLS: list[Col] = [
    ("ROLE", lambda r: str(first(r, "role", default="-"))),
    ("STATE", node_state),
    ("CPUS(a/t)", lambda r: frac(first(r, "cpus_used", "cpus_alloc"), first(r, "cpus_total"))),
    (
        "MEM(r/t)",
        lambda r: (
            "-"
            if first(r, "mem_total_mib") is None
            else f"{mib(first(r, 'mem_reserved_mib', default=0))}/{mib(first(r, 'mem_total_mib'))}"
        ),
    ),
    (
        "GPUS(b/t)",
        lambda r: "-" if not first(r, "gpus_total") else frac(first(r, "gpus_busy"), first(r, "gpus_total")),
    ),
    ("GPU MEM(u/t)", _gpu_mem),
    (
        "SANDBOXES(busy/open)",
        lambda r: (
            frac(first(r, "sandboxes_busy", "busy"), first(r, "sandboxes", "open"))
            if first(r, "sandboxes_busy", "busy") is not None
            else listish(first(r, "sandboxes"))
        ),
    ),
    ("RESIDENT", lambda r: listish(first(r, "resident"))),
    ("HEARTBEAT", lambda r: seconds(first(r, "heartbeat_age_s", "heartbeat_s", "last_seen_s"))),
    ("REASON", lambda r: str(first(r, "reason", default="-") or "-")),
]
POOL_COL: Col = ("POOL(idle/target)", lambda r: pool_cell(r))  # after SANDBOXES, on clusters with pools
NODE_WIDE: list[Col] = [
    ("ADDRESS", lambda r: str(first(r, "address", "hostname", default="-"))),
    ("VERSION", lambda r: str(first(r, "version", default="-"))),
    ("EXECUTOR", lambda r: str(first(r, "executor", default="-"))),
    ("NUMA", lambda r: listish(first(r, "numa"))),
    ("GPU UUIDS", lambda r: listish(first(r, "gpu_uuids"))),
]


def has_pool(row: Mapping[str, Any]) -> bool:
    """A node keeps a warm sandbox pool: its controller sends it a target, or it holds idle ones."""
    return bool(num(first(row, "pool_target")) or num(first(row, "pool_idle")))


def pool_cell(row: Mapping[str, Any]) -> str:
    """``2/4``: idle warm sandboxes ready now over the node's target (all shapes); ``-`` without a pool."""
    if not has_pool(row):
        return "-"
    return frac(first(row, "pool_idle", default=0), first(row, "pool_target", default=0))


def node_cols(nodes: list[dict[str, Any]], *, wide: bool) -> list[Col]:
    """NODES columns: POOL only when one of ``nodes`` keeps a pool (no empty column without pools)."""
    cols = list(NODE_COLS)
    if any(has_pool(r) for r in nodes):
        at = next(i for i, c in enumerate(cols) if c[0].startswith("SANDBOXES")) + 1
        cols.insert(at, POOL_COL)
    return cols + (NODE_WIDE if wide else [])


SERVICE_COLS: list[Col] = [
    ("SERVICE", lambda r: str(first(r, "service", "name", default="?"))),
    ("RUNTIME", lambda r: str(first(r, "runtime", default="-"))),
    ("CHUNK", lambda r: listish(first(r, "chunk_sizes", "chunk"))),
    ("STATE", lambda r: str(first(r, "state", default="-"))),
    ("RESIDENT", lambda r: listish(first(r, "resident"))),
    ("INFLIGHT", lambda r: listish(first(r, "in_flight", "inflight"))),
    ("QUEUE", lambda r: listish(first(r, "queued", "queue"))),
    ("LOAD", lambda r: seconds(first(r, "load_s"))),
    (
        "P50/P99",
        lambda r: (
            f"{seconds(first(r, 'p50_s'))}/{seconds(first(r, 'p99_s'))}"
            if first(r, "p50_s") is not None
            else "-"
        ),
    ),
]
API_COLS: list[Col] = [
    ("API", lambda r: str(first(r, "api", "name", default="?"))),
    ("MODE", lambda r: str(first(r, "mode", default="-"))),
    ("USED/LIMIT", lambda r: _api_use(r)),
    ("INFLIGHT", lambda r: listish(first(r, "in_flight", "inflight"))),
    ("QUEUE", lambda r: listish(first(r, "queued", "queue"))),
    ("REJECTED(5m)", lambda r: listish(first(r, "rejected", "rejected_5m"))),
]


def _of(used: Any, limit: Any) -> str:
    """``120/500`` against a limit; just ``120`` where the limit is 0 (none)."""
    return frac(used, limit) if num(limit) else listish(used)


# One row per key of an API's pool (``apis[].keys``: names and counts, never a secret): leases held,
# requests and tokens in the key's sliding minute against its limits, cool-down left after a 429.
KEY_COLS: list[Col] = [
    ("API", lambda r: str(first(r, "api", default="?"))),
    ("KEY", lambda r: str(first(r, "key", "name", default="?"))),
    ("INFLIGHT", lambda r: _of(first(r, "in_flight"), first(r, "concurrency"))),
    ("REQ/MIN", lambda r: _of(first(r, "rpm_used"), first(r, "rpm"))),
    ("TOKENS/MIN", lambda r: _of(first(r, "tpm_used"), first(r, "tpm"))),
    ("COOLDOWN", lambda r: seconds(c) if (c := num(first(r, "cooling_s"))) else "-"),
    ("GRANTED", lambda r: listish(first(r, "granted"))),
    ("429S", lambda r: listish(first(r, "limited"))),
]


def key_rows(records: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The KEYS rows: each key of every API with a key pool, its API's name beside its own fields."""
    return [
        {**k, "api": first(a, "api", "name", default="?")}
        for a in rows(records, "apis")
        for k in (a.get("keys") if isinstance(a.get("keys"), list) else ())
        if isinstance(k, dict)
    ]


def _api_use(r: Mapping[str, Any]) -> str:
    """``3/16 concurrent`` (leases held now, concurrency mode), ``120/3000 per 60s`` (leases granted
    in the current period, quota mode) or ``3 in flight (per-key limits)`` (a key pool alone)."""
    mode, limit = first(r, "mode"), first(r, "limit")
    if limit == 0 and r.get("keys"):  # a key pool without an API-wide limit: the KEYS table has them
        return f"{listish(first(r, 'in_flight', 'inflight'))} in flight (per-key limits)"
    if mode == "quota":
        period = num(first(r, "period_s"))
        return f"{listish(first(r, 'used'))}/{listish(limit)} per {period_text(period) if period else '?'}"
    if mode == "concurrency":
        return f"{listish(first(r, 'in_flight', 'inflight'))}/{listish(limit)} concurrent"
    return frac(first(r, "used", "in_flight", "inflight"), limit)


def period_text(s: float) -> str:
    """A quota period as a duration the CLI reads back: 60 -> 60s, 3600 -> 1h, 300 -> 5m, 0.5 -> 500ms."""
    if s < 1:
        return f"{s * 1000:g}ms"
    if s >= 3600 and s % 3600 == 0:
        return f"{s / 3600:g}h"
    if s > 60 and s % 60 == 0:
        return f"{s / 60:g}m"
    return f"{s:g}s"


def _held(r: Mapping[str, Any], unit: str) -> str:
    """``12 (25%)``: units a job holds now and its share of the cluster's."""
    n, share = first(r, unit, default=0), num(first(r, f"{unit}_share"))
    return f"{n} ({share:.0%})" if n and share is not None else listish(n)


JOB_COLS: list[Col] = [
    ("JOB", lambda r: str(first(r, "job", default="") or "(default)")),
    ("WEIGHT", lambda r: f"{num(first(r, 'weight')) or 1:g}"),
    ("CLIENTS", lambda r: listish(first(r, "clients"))),
    ("QUEUE", lambda r: listish(first(r, "queued"))),
    ("CORES(share)", lambda r: _held(r, "cores")),
    ("GPUS(share)", lambda r: _held(r, "gpus")),
    ("MEM", lambda r: mib(first(r, "mem_mib")) if first(r, "mem_mib") else "-"),
    ("DOM-SHARE", lambda r: f"{share:.0%}" if (share := num(first(r, "dominant_share"))) else "-"),
    ("API", lambda r: " ".join(f"{k}={v}" for k, v in (first(r, "api_in_flight") or {}).items() if v) or "-"),
    ("CORE-S", lambda r: f"{num(first(r, 'core_s')) or 0:,.0f}"),
    ("GPU-S", lambda r: f"{num(first(r, 'gpu_s')) or 0:,.0f}"),
    ("CAPS", lambda r: " ".join(f"{k}={v}" for k, v in (first(r, "caps") or {}).items()) or "-"),
]



# ---------------------------------------------------------------- summary


def summary(
    records: Mapping[str, Any], state: Any | None = None, *, now: float | None = None
) -> dict[str, Any]:
    """The header values as data (also part of ``-o json``)."""
    now = time.time() if now is None else now
    meta: dict[str, Any] = {}
    for key in ("header", "controller", "cluster"):
        if isinstance(records.get(key), dict):
            meta.update(records[key])
    nodes = rows(records, "nodes")
    queue = rows(records, "queue")
    uptime = num(first(meta, "uptime_s"))
    if uptime is None and state is not None and getattr(state, "started_at", 0):
        uptime = now - state.started_at
    qlen = num(first(meta, "queue", "queued", "queue_len")) if meta else None
    if qlen is None:
        qlen = num(records.get("queued"))
    if qlen is None:
        qlen = len(queue)
    running = num(first(meta, "running")) if meta else None
    if running is None:
        running = len(rows(records, "actions"))
    p50 = num(first(meta, "wait_p50_s", "p50_wait_s"))
    if p50 is None:
        p50 = num(records.get("wait_p50_s"))
    if p50 is None:
        waits = sorted(w for r in queue if (w := num(first(r, "waited_s", "wait_s"))) is not None)
        p50 = waits[len(waits) // 2] if waits else None
    proto = first(meta, "proto", "protocol")
    if proto is None:
        from tangram import protocol  # start-up cost: see the note at the top

        proto = f"{protocol.PROTOCOL_MAJOR}.{protocol.PROTOCOL_MINOR}"
    return {
        "cluster": getattr(state, "name", None) or first(meta, "name", "cluster", default="?"),
        "controller": getattr(state, "address", None) or first(meta, "address", default="?"),
        "uptime_s": uptime,
        "agents_healthy": sum(1 for r in nodes if healthy(r)),
        "agents_total": len(nodes),
        "running": int(running),
        "queue": int(qlen),
        "wait_p50_s": p50,
        "proto": str(proto),
    }


def header_line(s: Mapping[str, Any]) -> str:
    up = duration(s["uptime_s"]) if s.get("uptime_s") is not None else "-"
    p50 = f" (p50 wait {seconds(s['wait_p50_s'])})" if s.get("wait_p50_s") is not None else ""
    return (
        f"cluster {s['cluster']}  controller {s['controller']}  up {up}  "
        f"agents {s['agents_healthy']}/{s['agents_total']}  running {s.get('running', 0)}  "
        f"queue {s['queue']}{p50}  proto {s['proto']}"
    )


# ---------------------------------------------------------------- tables


VOLATILE = ("HEARTBEAT",)  # differs between otherwise identical nodes: shown as the group's maximum


def collapse_nodes(nodes: Iterable[Mapping[str, Any]], cols: list[Col]) -> list[list[str]]:
    """One row per distinct set of cells; the NODE cell is the hostlist of the names sharing it.
    Volatile cells (heartbeat age) do not split a group; the oldest one is shown."""
    groups: dict[tuple[str, ...], list[tuple[str, Mapping[str, Any]]]] = {}
    keyed = [i for i, (title, _) in enumerate(cols) if title not in VOLATILE]
    for r in nodes:
        cells = [fn(r) for _, fn in cols]
        groups.setdefault(tuple(cells[i] for i in keyed), []).append((node_name(r), r))
    out = []
    for members in groups.values():
        rows_ = [m[1] for m in members]
        cells = []
        for title, fn in cols:
            if title == "HEARTBEAT":
                ages = [
                    a
                    for r in rows_
                    if (a := num(first(r, "heartbeat_age_s", "heartbeat_s", "last_seen_s"))) is not None
                ]
                cells.append(seconds(max(ages)) if ages else "-")
            else:
                cells.append(fn(rows_[0]))
        out.append([compress(m[0] for m in members), *cells])
    return out


def tables(
    records: Mapping[str, Any],
    *,
    wide: bool = False,
    unhealthy_only: bool = False,
    sections: Iterable[str] = KNOWN_SECTIONS,
) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) for every non-empty section, in display order."""
    out = []
    want = set(sections)
    if "nodes" in want:
        nodes = rows(records, "nodes")
        if unhealthy_only:
            nodes = [r for r in nodes if not healthy(r)]
        cols = node_cols(nodes, wide=wide)
        if nodes:
            out.append(("NODES", ["NODE", *[c[0] for c in cols]], collapse_nodes(nodes, cols)))
    for name, cols in (("services", SERVICE_COLS), ("apis", API_COLS)):
        if name not in want:
            continue
        rs_ = rows(records, name)
        if rs_:
            out.append((name.upper(), [c[0] for c in cols], [[fn(r) for _, fn in cols] for r in rs_]))
    keys = key_rows(records) if "apis" in want else []
    if keys:
        out.append(("KEYS", [c[0] for c in KEY_COLS], [[fn(r) for _, fn in KEY_COLS] for r in keys]))
    jobs = rows(records, "jobs")
    if "jobs" in want and any(first(r, "job") for r in jobs):  # only with a job beside the default one
        out.append(("JOBS", [c[0] for c in JOB_COLS], [[fn(r) for _, fn in JOB_COLS] for r in jobs]))
    if "queue" in want:
        acts, _note = action_rows(records, wide=wide)
        if acts:
            out.append(("QUEUE", [c[0] for c in QUEUE_COLS], [[fn(r) for _, fn in QUEUE_COLS] for r in acts]))
    if wide:
        for name in sorted(records):
            if name in KNOWN_SECTIONS or name in ("actions", "controller", "header", "cluster"):
                continue
            rs_ = rows(records, name)
            if rs_:
                keys = sorted({k for r in rs_ for k in r})
                out.append(
                    (
                        name.upper(),
                        [k.upper() for k in keys],
                        [[listish(r.get(k)) for k in keys] for r in rs_],
                    )
                )
    return out


def drop_empty_columns(headers: list[str], body: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Leave out columns (other than the first) that read ``-`` in every row."""
    keep = [i for i in range(len(headers)) if i == 0 or any(r[i] not in ("-", "", "-/-") for r in body)]
    return [headers[i] for i in keep], [[r[i] for i in keep] for r in body]


def renderable(
    records: Mapping[str, Any],
    state: Any | None = None,
    *,
    wide: bool = False,
    unhealthy_only: bool = False,
    sections: Iterable[str] = KNOWN_SECTIONS,
) -> Any:
    """A rich renderable: the header line then each non-empty table."""
    from rich import box  # start-up cost: see the note at the top
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(header_line(summary(records, state)), style="bold")]
    for title, headers, body in tables(records, wide=wide, unhealthy_only=unhealthy_only, sections=sections):
        headers, body = drop_empty_columns(headers, body)
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title=None, header_style="bold")
        for h in headers:
            t.add_column(h, no_wrap=True)
        for r in body:
            t.add_row(*r)
        parts.append(t)
        if title == "QUEUE" and (note := action_rows(records, wide=wide)[1]):
            parts.append(Text(note, style="dim"))
    if len(parts) == 1:
        parts.append(Text("no nodes registered yet", style="dim"))
    return Group(*parts)


def to_json(records: Mapping[str, Any], state: Any | None = None) -> dict[str, Any]:
    """``-o json``: the summary plus the controller's records as they came."""
    return {**summary(records, state), "records": dict(records)}
