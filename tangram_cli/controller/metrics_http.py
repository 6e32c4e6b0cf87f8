"""The controller's Prometheus endpoint: `GET /metrics` over plain HTTP (docs/operations.md, section 7).

Off unless a port is given (`tangram controller --metrics-port PORT`, or `metrics_port` in the
controller's `--config`; 0 picks a free port, reported in the ready line as `metrics`). It listens
on the controller's own bind address, under the same rule as its ZeroMQ sockets (`check_bind`):
never every interface, and loopback only unless the controller runs CURVE. The endpoint itself
has no authentication: anyone who reaches the port reads the metrics (names of clients, nodes,
services, APIs and API keys, counts and times; no secrets, identities or tokens).

The server runs on the controller's event loop (asyncio streams), so a scrape reads the live
state between two driver steps: `Metrics` (metrics.py) for the per-action numbers, and the status
records (`cluster`, `nodes`, `jobs` and `apis` sections, from the core's snapshot) for node utilisation,
gauges, the controller's counters, RL jobs and each API key's figures (`apis[].keys`: names, never a
secret; the keys are the configured ones, so their labels stay bounded).
prometheus-client builds the exposition text (`generate_latest`); nothing of it is on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    UnknownMetricFamily,
)

from tangram.errors import ConfigError
from tangram_cli.controller.metrics import OUTCOMES, Metrics
from tangram_cli.controller.state import bind_host

log = logging.getLogger("tangram.controller.metrics")

READ_TIMEOUT_S = 5.0
Records = Callable[[], dict[str, Any]]  # the status records, sections cluster, nodes, jobs and apis


class MetricsCollector:
    """A prometheus-client collector (`collect()` yields metric families) over `Metrics` and the
    status records."""

    def __init__(self, metrics: Metrics, records: Records) -> None:
        self.metrics = metrics
        self.records = records

    def collect(self) -> Iterator[Any]:
        yield from self._actions()
        yield from self._usage()
        yield from self._cluster(self.records())

    def _actions(self) -> Iterator[Any]:
        m = self.metrics
        for name, doc, table in (
            ("queue_wait", "Time from submission to start (exec, call, lease grant, reserved open)", m.wait),
            ("run", "The agent's run time (exec, call); time held (lease)", m.run),
            ("overhead", "Time held beyond the agent's run time (exec, call)", m.overhead),
        ):
            fam = HistogramMetricFamily(f"tangram_action_{name}_seconds", doc, labels=["kind"])
            for kind, hist in table.items():
                fam.add_metric([kind], hist.cumulative(), hist.total)
            yield fam
        fam = HistogramMetricFamily(
            "tangram_action_granted_units",
            "Units granted per start: cores (exec, reserved open), GPUs (call), API units (lease)",
            labels=["resource"],
        )
        granted = CounterMetricFamily(
            "tangram_units_granted", "Units granted, summed over starts", labels=["resource"]
        )
        for res, hist in m.units.items():
            fam.add_metric([res], hist.cumulative(), hist.total)
            granted.add_metric([res], hist.total)
        yield fam
        yield granted
        fam = CounterMetricFamily(
            "tangram_actions_finished", "Actions ended, by kind and outcome", labels=["kind", "outcome"]
        )
        for kind, counts in m.finished.items():
            for outcome in OUTCOMES:
                fam.add_metric([kind, outcome], counts[outcome])
        yield fam

    def _usage(self) -> Iterator[Any]:
        m = self.metrics
        fam = CounterMetricFamily(
            "tangram_client_resource_seconds",
            "Units times the seconds they were held, by client (owner name; 'other' past the cap)",
            labels=["client", "resource"],
        )
        for client, row in sorted(m.labels.seconds.items()):
            for res, value in row.items():
                fam.add_metric([client, res], value)
        yield fam
        for name, doc, label, table in (
            ("tangram_api_unit_seconds", "API lease units times seconds held", "api", m.api_seconds),
            ("tangram_service_gpu_seconds", "GPUs times seconds held by calls", "service", m.service_seconds),
            ("tangram_gpu_restores", "Services restored onto GPUs (Load)", "service", m.restores),
            ("tangram_gpu_evictions", "Services evicted from GPUs (Evict)", "service", m.evictions),
        ):
            fam = CounterMetricFamily(name, doc, labels=[label])
            for key, value in sorted(table.items()):
                fam.add_metric([key], value)
            yield fam

    def _cluster(self, records: dict[str, Any]) -> Iterator[Any]:
        cl = records.get("cluster") or {}
        for name, key, doc in (
            ("tangram_queued_actions", "queue", "Actions waiting"),
            ("tangram_running_actions", "running", "Actions running"),
            ("tangram_clients", "clients", "Client sessions"),
            ("tangram_sandboxes", "sandboxes", "Open sandboxes"),
            ("tangram_agents_up", "agents_up", "Agents registered and heartbeating"),
            ("tangram_agents", "agents_total", "Agents known"),
            ("tangram_uptime_seconds", "uptime_s", "Seconds since the controller started"),
        ):
            yield GaugeMetricFamily(name, doc, value=float(cl.get(key) or 0))
        yield CounterMetricFamily(
            "tangram_events_handled", "Events the core handled", value=cl.get("events", 0)
        )
        fam = UnknownMetricFamily(
            "tangram_controller_counter",
            "The controller's counters (status -o json: cluster.counters): core, gateway, agent link",
            labels=["name"],
        )
        for key, value in sorted((cl.get("counters") or {}).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                fam.add_metric([str(key)], value)
        yield fam
        yield from _nodes(records.get("nodes") or [])
        yield from _jobs(records.get("jobs") or [], self.metrics.labels.cap)
        yield from _api_keys(records.get("apis") or [])


def _nodes(rows: list[dict[str, Any]]) -> Iterator[Any]:
    for name, key, doc in (
        ("tangram_node_cpus", "cpus_total", "Cores a node hands out"),
        ("tangram_node_cpus_used", "cpus_used", "Cores granted now"),
        ("tangram_node_gpus", "gpus_total", "GPUs of a node"),
        ("tangram_node_gpus_busy", "gpus_busy", "GPUs running a call now"),
        ("tangram_node_up", "agent_state", "1 while the node's agent is up"),
    ):
        fam = GaugeMetricFamily(name, doc, labels=["node"])
        for row in rows:
            value = row.get(key)
            if key == "agent_state":
                value = 1 if value == "up" else 0
            fam.add_metric([str(row.get("node", ""))], float(value or 0))
        yield fam


JOB_GAUGES = (
    ("tangram_job_weight", "weight", "An RL job's weight"),
    ("tangram_job_queued", "queued", "An RL job's actions waiting"),
    ("tangram_job_cores", "cores", "Cores an RL job's actions hold now"),
    ("tangram_job_cores_share", "cores_share", "An RL job's share of the cluster's cores now"),
    ("tangram_job_gpus", "gpus", "GPUs an RL job's calls hold now"),
    ("tangram_job_gpus_share", "gpus_share", "An RL job's share of the cluster's GPUs now"),
    ("tangram_job_mem_mib", "mem_mib", "Memory (MiB) an RL job's placed sandboxes hold now"),
)
JOB_COUNTERS = (
    ("tangram_job_core_seconds", "core_s", "Cores times the seconds an RL job's actions held them"),
    ("tangram_job_gpu_seconds", "gpu_s", "GPUs times the seconds an RL job's calls held them"),
    ("tangram_job_actions_started", "started", "Actions of an RL job started"),
)


def _jobs(rows: list[dict[str, Any]], cap: int) -> Iterator[Any]:
    """Per RL job (status `jobs` rows; the default job is "default"): the first `cap` jobs in name
    order keep their own label, the rest count under "other" (gauges of shares are left out there)."""
    def label(i: int, row: dict[str, Any]) -> str:
        return (str(row.get("job")) or "default") if i < cap else "other"

    for name, key, doc, family in [(*g, GaugeMetricFamily) for g in JOB_GAUGES] + [
        (*c, CounterMetricFamily) for c in JOB_COUNTERS
    ]:
        fam = family(name, doc, labels=["job"])
        summed: dict[str, float] = {}
        for i, row in enumerate(rows):
            if key in ("weight", "cores_share", "gpus_share") and i >= cap:
                continue
            summed[label(i, row)] = summed.get(label(i, row), 0.0) + float(row.get(key) or 0)
        for job, value in summed.items():
            fam.add_metric([job], value)
        yield fam
    fam = CounterMetricFamily("tangram_job_api_unit_seconds", "API units times seconds held, by RL job",
                              labels=["job", "api"])
    per: dict[tuple[str, str], float] = {}
    for i, row in enumerate(rows):
        for api, value in (row.get("api_unit_s") or {}).items():
            per[(label(i, row), str(api))] = per.get((label(i, row), str(api)), 0.0) + float(value)
    for labels, value in sorted(per.items()):
        fam.add_metric(list(labels), value)
    yield fam


KEY_GAUGES = (
    ("tangram_api_key_minute_requests", "rpm_used", "Requests charged to an API key in its sliding minute"),
    ("tangram_api_key_minute_tokens", "tpm_used", "Tokens charged to an API key in its sliding minute"),
    ("tangram_api_key_leases_in_flight", "in_flight", "Leases holding an API key now"),
    ("tangram_api_key_cooling", "cooling_s", "1 while an API key cools down after a rate-limit report"),
)
KEY_COUNTERS = (
    ("tangram_api_key_leases_granted", "granted", "Leases granted an API key"),
    ("tangram_api_key_rate_limited", "limited", "Rate-limit (HTTP 429) answers reported for an API key"),
)


def _api_keys(apis: list[dict[str, Any]]) -> Iterator[Any]:
    """Per API and key name (status `apis[].keys` rows, the core's `KeyPool.rows`): never a secret,
    which neither the core nor the status records hold. APIs without keys add no series."""
    keys = [
        (str(api.get("api", "")), str(k.get("key", "")), k)
        for api in apis
        for k in (api.get("keys") or [])
        if isinstance(k, dict)
    ]
    for name, field, doc, family in [(*g, GaugeMetricFamily) for g in KEY_GAUGES] + [
        (*c, CounterMetricFamily) for c in KEY_COUNTERS
    ]:
        fam = family(name, doc, labels=["api", "key"])
        for api, key, row in keys:
            value = float(row.get(field) or 0)
            fam.add_metric([api, key], (1.0 if value > 0 else 0.0) if field == "cooling_s" else value)
        yield fam


def metrics_socket(bind: str, port: int) -> socket.socket:
    """A listening TCP socket on the controller's bind address (checked by the caller)."""
    host = bind_host(bind).strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot bind the metrics endpoint {host}:{port}: {exc.strerror or exc}",
            hint="pick another --metrics-port, or 0 for a free one",
        ) from None
    return sock


class MetricsServer:
    """`GET /metrics` (and `/`) on a socket from `metrics_socket`; other paths 404, other methods 405."""

    def __init__(self, sock: socket.socket, collector: MetricsCollector) -> None:
        self.sock = sock
        self.port = int(sock.getsockname()[1])
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)  # type: ignore[arg-type]
        self.scrapes = 0
        self._server: asyncio.AbstractServer | None = None

    async def run(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self.sock)
        async with self._server:
            await self._server.serve_forever()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            status, ctype, body = self._answer(head.split(b"\r\n", 1)[0].decode("latin-1").split())
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, request_line: list[str]) -> tuple[str, str, bytes]:
        if len(request_line) < 2:
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, path = request_line[0], request_line[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        if path not in ("/metrics", "/"):
            return "404 Not Found", "text/plain", b"not found: GET /metrics\n"
        self.scrapes += 1
        body = generate_latest(self.registry)
        return "200 OK", CONTENT_TYPE_LATEST, b"" if method == "HEAD" else body
