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
  `sandboxes_busy`, `gpus_total`, `gpus_busy`, `gpu_mem_used_mib` (per GPU), `resident`
  (service@start+size), `executor`, `docker`, `cgroup`, `hostname`, `pid`, `version`, `numa`,
  `idle_cpus`, `gpu_uuids`, `agent_epoch`, `restarts`, `connected_s`, `inflight_requests`.
- `services`: `service`, `runtime`, `model`, `gpu_mem_mib`, `chunk_sizes`, `load_s`,
  `resident` (instances), `inflight`, `queued`.
- `apis`: `api`, `mode`, `limit`, `period_s`, `in_flight`, `used`, `queued`.
- `queue`: waiting actions in FCFS order (at most `limit`): `action`, `pool`, `kind` (exec |
  call | lease | open), `client` (tag), `owner` (its client's name), `state` ("PD"), `waited_s`,
  `demand`, `reason`.
- `actions`: running actions (at most `limit`): `action`, `kind`, `client` (tag), `owner`, `sandbox`,
  `state` ("R", or "CG" once a kill was sent), `node`, `run_s`, `grant` (cores or GPUs).
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

SECTIONS = ("cluster", "nodes", "services", "apis", "queue", "actions", "clients")


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
) -> dict[str, Any]:
    """Status records; `started` and `now` are on the controller's clock."""
    snap = core.snapshot(limit=limit)
    out: dict[str, Any] = {}
    agents = {a["node"]: a for a in agent_rows}
    owners = {r["client"]: r.get("owner") or r.get("name", "") for r in client_rows}  # tag -> name
    busy_by_node: dict[str, int] = {}
    for sb in sandboxes:
        if sb.busy and not sb.closed:
            busy_by_node[sb.node] = busy_by_node.get(sb.node, 0) + 1
    if "cluster" in sections:
        all_counters = dict(snap.counters)
        all_counters.update(counters)
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
            "wait_p50_s": wait_p50,
            "loop_lag_s": loop_lag_s,
            "events": events,
            "decide": decide or {},
            "counters": all_counters,
        }
    if "nodes" in sections:
        rows = []
        names = sorted({n["node"] for n in snap.nodes} | set(agents))
        by_name = {n["node"]: n for n in snap.nodes}
        for name in names:
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
            role = (
                "+".join(r for r, n in (("cpu", base["cpus_total"]), ("gpu", base["gpus_total"])) if n) or "-"
            )
            base.update(
                {"state": node_state(base, agent), "role": role, "sandboxes_busy": busy_by_node.get(name, 0)}
            )
            base.update(agent or {"agent_state": "unknown", "heartbeat_age_s": None, "reason": ""})
            rows.append(base)
        out["nodes"] = rows
    if "services" in sections:
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
        out["services"] = svc_rows
    if "apis" in sections:
        out["apis"] = [dict(a) for a in snap.apis]
    if "queue" in sections:
        out["queue"] = [
            {
                "action": r.action_id,
                "pool": r.pool,
                "kind": r.kind,
                "client": client_tag(r.client),
                "owner": owners.get(client_tag(r.client), ""),
                "state": "PD",
                "waited_s": round(r.waited_s, 3),
                "demand": r.demand,
                "reason": r.status,
            }
            for r in snap.queue[:limit]
        ]
    if "actions" in sections:
        rows2 = []
        for aid in core.running:  # running actions only: a long queue costs nothing here
            rec = actions.get(aid)
            if rec is None or rec.started is None or (rec.final_sent and rec.kind != "lease"):
                continue
            grant = (
                list(rec.cores) if rec.kind == "exec" else list(rec.gpus) if rec.kind == "call" else rec.units
            )
            rows2.append(
                {
                    "action": rec.action_id,
                    "kind": rec.kind,
                    "client": client_tag(rec.client),
                    "owner": owners.get(client_tag(rec.client), ""),
                    "sandbox": rec.sandbox,
                    "state": "CG" if rec.kill_reason else "R",
                    "node": rec.node,
                    "run_s": round(now - rec.started, 3),
                    "grant": grant,
                }
            )
            if len(rows2) >= limit:
                break
        out["actions"] = rows2
    if "clients" in sections:
        out["clients"] = client_rows[:limit]
    return out
