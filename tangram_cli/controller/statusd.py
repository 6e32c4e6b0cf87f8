"""The status ROUTER: `StatusReq` -> `Status(records)`; read-only.

`records` is what `tangram status -o json` prints. Sections (all when `sections` is empty):

- `cluster`: one map: `name`, `proto` ("1.0"), `controller_epoch`, `uptime_s`, `pid`,
  `address` (the bound host), `addresses` ({agents, submit, status} endpoints), `agents_up`, `agents_total`,
  `clients`, `sandboxes`, `queue` (waiting actions), `running`, `wait_p50_s` (median queueing
  delay of the last 1000 started actions, null before any), `loop_lag_s`, `events`
  (events handled), `decide` (`p50_ms`, `p99_ms`, `max_ms`, `n`: the core's decision time per event
  over the last 4096 events; `slowest`: the last few decisions over 50 ms as [ms, event type,
  commands]), `counters` (core counters plus gateway/link counters).
- `nodes`: one row per node: `node`, `state` (sinfo words: idle | mix | alloc | down, `down*` when
  the agent stopped heartbeating),
  `agent_state` (up | lost | down), `heartbeat_age_s`, `reason`, `role` (cpu | gpu | cpu+gpu),
  `cpus_total`, `cpus_used`, `mem_total_mib`, `mem_reserved_mib`, `sandboxes`,
  `sandboxes_busy`, `gpus_total`, `gpus_busy`, `gpu_mem_used_mib` (per GPU), `gpu_mem_mib` (each
  GPU's memory) and `gpu_mem_total_mib` (on nodes with GPUs), `resident`
  (service@start+size), `executor`, `docker`, `cgroup`, `hostname`, `pid`, `version`, `numa`,
  `idle_cpus`, `gpu_uuids`, `agent_epoch`, `restarts`, `connected_s`, `inflight_requests`;
  warm sandbox pools: `pool_idle` (idle pooled sandboxes, from the agent's heartbeats), `pool_mem_mib`
  (their memory) and `pool_target` (what the controller last told the agent, all shapes; pools.py).
- `services`: `service`, `runtime`, `model`, `gpu_mem_mib`, `chunk_sizes`, `load_s`,
  `resident` (instances), `inflight`, `queued`.
- `apis`: `api`, `mode` (concurrency | quota), `limit`, `in_flight` (leases held now), `used`
  (quota: leases granted in the current period, 0 once it ended), `queued`; quota mode also
  `period_s` and `period_left_s` (null outside a period).
- `queue`: waiting actions in FCFS order (at most `limit`): `action`, `pool` (cpu | gpu | api:NAME),
  `sandbox` (its sandbox, "" for calls and leases), `kind` (exec | call | lease | open), `client`
  (tag), `owner` (its client's name: the CURVE key's, else the Hello's), `name` (the Hello's),
  `state` ("PD"), `waited_s`, `demand`, `reason_code` (`busy`: the resources exist but are in use,
  the core's "unschedulable", it will run; `never_fits`: no node could ever hold it, the core's
  "unresolvable"; `pending`: admitted, about to start; `error`), `reason` (the core's words:
  messages and shortfalls such as "cpus: requested 4, free 0 of 12 on local").
- `actions`: running actions (at most `limit`): `action`, `kind`, `client` (tag), `owner`, `name`,
  `sandbox`, `state` ("R", or "CG" once a kill was sent), `node`, `run_s`, `grant` (cores or GPUs).
- `clients`: `client`, `name` (the Hello's), `owner` (the CURVE key's name, else `name`),
  `silent_s`, `connected_s`, `requests`, `outstanding` (requests without a final reply), `outbox`
  (final replies waiting to be sent), `held_bytes` (`holds.py`), `connected` (the session has a
  route), `refused` (frames of other connections refused on its identity), `sandboxes`.

Clients are named, never identified: `client` is everywhere a 6-hex-digit tag of the routing
identity (`sessions.client_tag`), and no record holds an identity, a token or a key (issue 11:
a routing identity once shown here was enough to take over a client's sandboxes).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from tangram import protocol
from tangram.core.actions import Kind
from tangram.core.scheduler import Scheduler
from tangram.errors import ProtocolError
from tangram_cli.controller.sessions import client_tag
from tangram_cli.controller.state import encode_to
from tangram_cli.controller.wire import send_now, serve

log = logging.getLogger("tangram.controller.status")

SECTIONS = ("cluster", "nodes", "services", "apis", "queue", "actions", "clients", "jobs")


def _clean(value: object) -> object:
    """Make a value fit a protocol FreeMap (finite floats, str keys, no tuples/bytes)."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k)[:256]: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value][:4096]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


class StatusServer:
    def __init__(self, sock: zmq.asyncio.Socket, build: Callable[[list[str], int], dict[str, Any]]) -> None:
        self.sock = sock
        self.build = build

    async def run(self) -> None:
        await serve(self.sock, self._on_frames, batch=16)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        ident = frames[0]
        try:
            env = protocol.decode(frames[1:])
        except ProtocolError as exc:
            send_now(self.sock, encode_to(ident, protocol.Error.from_exception(exc), 0))
            return
        msg = env.msg
        if isinstance(msg, protocol.Heartbeat):
            send_now(self.sock, encode_to(ident, protocol.Heartbeat(), 0))
        elif isinstance(msg, protocol.Hello):
            send_now(
                self.sock,
                encode_to(
                    ident,
                    protocol.Welcome(protocol.PROTOCOL_MAJOR, protocol.PROTOCOL_MINOR, 0),
                    env.request_id,
                ),
            )
        elif isinstance(msg, protocol.StatusReq):
            unknown = [s for s in msg.sections if s not in SECTIONS]
            if unknown:
                err = protocol.Error(
                    "BAD_REQUEST",
                    f"unknown section(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})",
                    False,
                )
                send_now(self.sock, encode_to(ident, err, env.request_id))
                return
            try:
                records = self.build(list(msg.sections) or list(SECTIONS), msg.limit)
                reply = encode_to(ident, protocol.Status(_clean(records)), env.request_id)  # type: ignore[arg-type]
            except Exception as exc:
                log.exception("status failed")
                reply = encode_to(
                    ident,
                    protocol.Error("INTERNAL", f"status failed ({type(exc).__name__})", False),
                    env.request_id,
                )
            send_now(self.sock, reply)
        else:
            err = protocol.Error("AUTH", f"{msg.NAME} is not allowed on the status socket", False)
            send_now(self.sock, encode_to(ident, err, env.request_id))


def node_state(row: dict[str, Any], agent: dict[str, Any] | None) -> str:
    if agent is None or agent.get("agent_state") != "up":
        return "down*" if agent is not None and agent.get("agent_state") == "lost" else "down"
    used = row.get("cpus_used", 0) + row.get("gpus_busy", 0)
    total = row.get("cpus_total", 0) + row.get("gpus_total", 0)
    if used == 0:
        return "idle"
    return "alloc" if used >= total else "mix"


def build_records(
    core: Scheduler,
    *,
    sections: list[str],
    limit: int,
    cluster: str,
    epoch: int,
    started: float,
    addresses: dict[str, str],
    agent_rows: list[dict[str, Any]],
    client_rows: list[dict[str, Any]],
    sandboxes: list[Any],
    actions: dict[str, Any],
    counters: dict[str, int],
    wait_p50: float | None,
    loop_lag_s: float,
    events: int,
    services_conf: list[Any],
    decide: dict[str, Any] | None = None,
    now: float = 0.0,
    pool_targets: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Status records; `started`, `now`: the controller's clock; `pool_targets`: `PoolKeeper.node_targets`."""
    snap = core.snapshot(limit=limit, now=now or None)
    out: dict[str, Any] = {}
    who = _Who(client_rows)
    if "cluster" in sections:
        out["cluster"] = {
            "name": cluster,
            "proto": f"{protocol.PROTOCOL_MAJOR}.{protocol.PROTOCOL_MINOR}",
            "controller_epoch": epoch,
            "uptime_s": round(now - started, 3),
            "pid": os.getpid(),
            "address": addresses.get("submit", "").removeprefix("tcp://").rsplit(":", 1)[0],
            "addresses": addresses,
            "agents_up": sum(1 for a in agent_rows if a["agent_state"] == "up"),
            "agents_total": len(agent_rows),
            "clients": len(client_rows),
            "sandboxes": sum(1 for s in sandboxes if not s.closed),
            "queue": snap.queued,
            "running": snap.running,
            "staged": snap.staged,  # decided on a running exec's cores, to start at its end (staging.py)
            "wait_p50_s": wait_p50,
            "loop_lag_s": loop_lag_s,
            "events": events,
            "decide": decide or {},
            "counters": {**dict(snap.counters), **counters},
        }
    more: dict[str, Callable[[], Any]] = {
        "nodes": lambda: _node_rows(core, snap, agent_rows, sandboxes, pool_targets or {}),
        "services": lambda: _service_rows(core, snap, services_conf),
        "apis": lambda: [_api_row(core, a, max(now, snap.now)) for a in snap.apis],
        "queue": lambda: _queue_rows(snap, actions, who, limit),
        "actions": lambda: _action_rows(core, actions, who, limit, now),
        "clients": lambda: client_rows[:limit],
        "jobs": lambda: [job_row(r) for r in snap.jobs],
    }
    out.update({name: make() for name, make in more.items() if name in sections})
    return out


def job_row(row: dict[str, Any]) -> dict[str, Any]:
    """A JOBS row from the core's (``tangram.core.views.job_rows``): held units, share of the
    cluster's and unit-seconds per pool, flattened to cores, GPUs and per-API columns; the
    memory its placed sandboxes hold and its dominant share, as the core figured them."""
    held, share, unit_s = row["held"], row["share"], row["unit_s"]
    apis = sorted({p for d in (held, unit_s) for p in d if p.startswith("api:")})
    return {
        "job": row["job"], "weight": row["weight"], "caps": row["caps"], "clients": row["clients"],
        "queued": row["queued"], "started": row["started"],
        "cores": held.get("cpu", 0), "cores_share": share.get("cpu", 0.0), "core_s": unit_s.get("cpu", 0.0),
        "gpus": held.get("gpu", 0), "gpus_share": share.get("gpu", 0.0), "gpu_s": unit_s.get("gpu", 0.0),
        "mem_mib": row["mem_mib"], "dominant_share": row["dominant_share"],
        "api_in_flight": {p[4:]: held.get(p, 0) for p in apis},
        "api_unit_s": {p[4:]: unit_s.get(p, 0.0) for p in apis},
    }


class _Who:
    """A client key -> ``client`` (its tag), ``owner`` and ``name`` (the Hello's), from the client rows."""

    def __init__(self, client_rows: list[dict[str, Any]]) -> None:
        self.owners = {r["client"]: r.get("owner") or r.get("name", "") for r in client_rows}
        self.names = {r["client"]: r.get("name", "") for r in client_rows}

    def __call__(self, key: str) -> dict[str, str]:
        tag = client_tag(key)
        return {"client": tag, "owner": self.owners.get(tag, ""), "name": self.names.get(tag, "")}


def _queue_rows(snap: Any, actions: dict[str, Any], who: _Who, limit: int) -> list[dict[str, Any]]:
    return [
        {
            "action": r.action_id,
            "pool": r.pool,
            "sandbox": getattr(actions.get(r.action_id), "sandbox", "") or "",
            "kind": r.kind,
            **who(r.client),
            "state": "PD",
            "waited_s": round(r.waited_s, 3),
            "demand": r.demand,
            **_reason(r.status),
        }
        for r in snap.queue[:limit]
    ]


def _node_rows(
    core: Scheduler, snap: Any, agent_rows: list[dict[str, Any]], sandboxes: list[Any], pools: dict[str, int]
) -> list[dict[str, Any]]:
    agents = {a["node"]: a for a in agent_rows}
    busy_by_node: dict[str, int] = {}
    for sb in sandboxes:
        if sb.busy and not sb.closed:
            busy_by_node[sb.node] = busy_by_node.get(sb.node, 0) + 1
    rows = []
    by_name = {n["node"]: n for n in snap.nodes}
    for name in sorted(set(by_name) | set(agents)):
        base = dict(
            by_name.get(name)
            or {
                "node": name,
                "cpus_total": 0,
                "cpus_used": 0,
                "mem_total_mib": 0,
                "mem_reserved_mib": 0,
                "sandboxes": 0,
                "gpus_total": 0,
                "gpus_busy": 0,
                "gpu_mem_used_mib": [],
                "resident": [],
            }
        )
        agent = agents.get(name)
        role = "+".join(r for r, n in (("cpu", base["cpus_total"]), ("gpu", base["gpus_total"])) if n) or "-"
        base.update(
            {"state": node_state(base, agent), "role": role, "sandboxes_busy": busy_by_node.get(name, 0),
             "pool_target": pools.get(name, 0)}
        )
        base.update(_gpu_mem(core, name))
        base.update(agent or {"agent_state": "unknown", "heartbeat_age_s": None, "reason": ""})
        rows.append(base)
    return rows


def _service_rows(core: Scheduler, snap: Any, services_conf: list[Any]) -> list[dict[str, Any]]:
    svc_rows = []
    conf = {s.name: s for s in services_conf}
    running_calls: dict[str, int] = {}  # from the core: O(running), not O(everything unfinished)
    for run in core.running.values():
        if run.spec.kind == Kind.CALL:
            running_calls[run.spec.service] = running_calls.get(run.spec.service, 0) + 1
    queued_calls: dict[str, int] = {}
    for w in core.queues.get("gpu", {}).values():
        queued_calls[w.spec.service] = queued_calls.get(w.spec.service, 0) + 1
    resident = [r for n in snap.nodes for r in n.get("resident", [])]
    for s in snap.services:
        name = s["service"]
        spec = conf[name].spec if name in conf else {}
        svc_rows.append(
            {
                **s,
                "runtime": str(spec.get("runtime", "")),
                "model": str(spec.get("model", "")),
                "resident": [r for r in resident if r.split("@", 1)[0] == name],
                "inflight": running_calls.get(name, 0),
                "queued": queued_calls.get(name, 0),
            }
        )
    return svc_rows


def _action_rows(
    core: Scheduler, actions: dict[str, Any], who: _Who, limit: int, now: float
) -> list[dict[str, Any]]:
    rows = []
    for aid in core.running:  # running actions only: a long queue costs nothing here
        rec = actions.get(aid)
        if rec is None or rec.started is None or (rec.final_sent and rec.kind != "lease"):
            continue
        grant = list(rec.cores) if rec.kind == "exec" else list(rec.gpus) if rec.kind == "call" else rec.units
        rows.append(
            {
                "action": rec.action_id,
                "kind": rec.kind,
                **who(rec.client),
                "sandbox": rec.sandbox,
                "state": "CG" if rec.kill_reason else "R",
                "node": rec.node,
                "run_s": round(now - rec.started, 3),
                "grant": grant,
            }
        )
        if len(rows) >= limit:
            break
    return rows


# the core's codes (tangram/core/status.py) by what they mean to a reader of the queue
_REASON_CODES = {
    "unschedulable": "busy",
    "unresolvable": "never_fits",
    "error": "error",
    "pending": "pending",
}


def _reason(status: str) -> dict[str, str]:
    """``reason_code``: ``busy`` (the core's "unschedulable": the resources exist but are in use, it
    will run), ``never_fits`` ("unresolvable": no node could ever hold it), ``pending`` (admitted,
    about to start) or ``error``; ``reason``: the core's words after the code (shortfalls, messages)."""
    head, _, rest = status.partition(";")
    code = _REASON_CODES.get(head.strip())
    if code is None:
        return {"reason_code": "", "reason": status}
    return {"reason_code": code, "reason": rest.strip()}


def _gpu_mem(core: Scheduler, node: str) -> dict[str, int]:
    """``gpu_mem_mib`` (each GPU's) and ``gpu_mem_total_mib`` of a node with GPUs; {} without."""
    gpu = core.gpu.nodes.get(node)
    if gpu is None or not gpu.count:
        return {}
    return {"gpu_mem_mib": gpu.mem_mib, "gpu_mem_total_mib": gpu.mem_mib * gpu.count}


def _api_row(core: Scheduler, row: dict[str, Any], now: float) -> dict[str, Any]:
    """The core's API row plus ``period_s`` (quota mode) and ``used`` counted in the current period
    only (the core resets it at the next grant; a finished period shows 0, not its old count)."""
    out = dict(row)
    api = core.basic.apis.get(str(row.get("api")))
    if api is None or api.mode != "quota":
        return out
    out["period_s"] = api.period_s
    window = api.next_window()
    if window is None or now >= window:
        out["used"] = 0
    out["period_left_s"] = round(window - now, 3) if window is not None and now < window else None
    return out
