"""The controller process: three ROUTER sockets, the driver task, signals, orderly shutdown.

`Controller` wires the pieces together and turns the core's commands into work:

    agents ROUTER  <-> AgentLink (agents.py)  --+
    submit ROUTER  <-> Gateway   (gateway.py) --+-- Driver.post(event) --> core.handle --> dispatch()
    status ROUTER  <-> StatusServer (statusd.py) <- core.snapshot()

`run_controller(options)` is the process entry used by `tangram controller`: it binds (port 0
picks a free port), prints one JSON line `{"agents": P, "submit": P, "status": P, "pid": N,
"bind": ADDR, "epoch": E}` (plus `"metrics": P, "metrics_addr": URL` when the Prometheus endpoint
is on: metrics_http.py) on stdout and writes the same to `--ready-file`, then serves until
SIGINT/SIGTERM (agents keep running; they reconnect to the next controller) or SIGUSR1 (the
`tangram down` path: `Shutdown("down")` to every agent, which then removes its sandboxes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from tangram import logfmt
from tangram.aiotasks import cancel_tasks
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.errors import ConfigError
from tangram_cli.bootstrap import netaddr
from tangram_cli.controller.agents import AgentLink, new_epoch
from tangram_cli.controller.api_keys import core_keys
from tangram_cli.controller.config import ControllerConfig
from tangram_cli.controller.curve import ServerAuth
from tangram_cli.controller.driver import Collector, Driver, WallClock, open_journal
from tangram_cli.controller.gateway import Gateway
from tangram_cli.controller.ledger import Ledger
from tangram_cli.controller.metrics import Metrics
from tangram_cli.controller.pools import PoolKeeper
from tangram_cli.controller.recovery import Recovery
from tangram_cli.controller.sessions import load_secret
from tangram_cli.controller.state import Registry, check_bind, make_router
from tangram_cli.controller.statusd import StatusServer, build_records
from tangram_cli.controller.wire import Batcher

log = logging.getLogger("tangram.controller")


@dataclass(frozen=True)
class Options:
    bind: str = "127.0.0.1"
    agents_port: int = 0
    submit_port: int = 0
    status_port: int = 0
    journal: str | None = None
    state: str | None = None  # the durable state file (ledger.py); None: nothing survives a restart
    ready_file: str | None = None
    seed: int = 0
    certs: str | None = None  # CURVE certs directory (tangram_cli/keys.py); None: plain TCP, loopback only
    metrics_port: int | None = None  # Prometheus endpoint (metrics_http.py); None: the config's, else off
    log_format: str | None = None  # text | json (tangram/logfmt.py); None: $TANGRAM_LOG_FORMAT, else text


class BindAddressNotLocal(ConfigError):
    """The bind address is not an address of this machine (EADDRNOTAVAIL): refused before any socket
    or the ZAP handler exists, so nothing is left to undo."""


def check_local(bind: str) -> None:
    """Raise BindAddressNotLocal when ``bind`` (or an address it resolves to) is not this machine's."""
    missing = netaddr.not_local(bind)
    if missing:
        raise BindAddressNotLocal(
            f"cannot bind {bind}: Cannot assign requested address "
            f"({netaddr.not_local_message(bind, missing)})",
            hint=f"bind one of this machine's addresses: {', '.join(netaddr.local_addresses())}",
        )


class Controller:
    metrics: Metrics | None = None  # per-action numbers, while the metrics endpoint is on (start())
    metrics_http: Any = None  # metrics_http.MetricsServer, while the endpoint is on

    def __init__(self, config: ControllerConfig | None = None, options: Options | None = None) -> None:
        self.config = config or ControllerConfig()
        self.options = options or Options()
        self._metrics_sock = self._check_binds()  # first: nothing else to undo when a port is taken
        self.epoch = new_epoch()
        self.clock = WallClock()
        self.registry = Registry(self.clock)  # the controller's one clock, shared by every part
        self.core = Scheduler(CoreConfig(depth=self.config.depth, stage=self.config.stage_starts),
                              seed=self.options.seed)
        self.started = self.clock.now()
        self.journal = open_journal(self.options.journal, self.config.cluster, self.epoch)
        self.driver = Driver(self.core, self.clock, self.journal, self.dispatch)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = asyncio.Event()
        self.down_requested = False  # before anything can call request_stop (the ZAP handler's on_dead)
        self.ctx = zmq.asyncio.Context()
        self.curve: ServerAuth | None = None
        try:
            self._open_sockets()
        except BaseException:
            self._close_partial()
            raise
        self.agents = AgentLink(self.agents_sock, self.driver.post, self.registry, self.config, self.epoch)
        if self.curve is not None:  # a node speaks only with its own key (User-Id), never as another node
            self.agents.peer_check = self.curve.node_key_matches
        self.gateway = Gateway(
            self.submit_sock, self.driver.post, self.registry, self.agents, self.config, self.epoch
        )
        if self.curve is not None:  # a client session is bound to its CURVE key (User-Id)
            self.gateway.use_curve(self.curve)
        self.status = StatusServer(self.status_sock, self._records)
        self.gateway.ledger = Ledger(self.options.state, self.epoch)
        self.gateway.secret = load_secret(self.options.state)  # session tokens survive a restart on it
        self.recovery = Recovery(
            self.gateway.ledger,
            self.core,
            self.registry,
            self.gateway,
            self.driver.post,
            restore_grace(self.config),
        )
        self.pools = PoolKeeper(self.config.sandbox_pool, self.agents, self.core, self.clock)
        self.agents.on_hello = self._on_hello
        self.driver.holding = self._holding
        self.agents.on_cleared = self.recovery.on_cleared
        for svc in self.config.services:
            self.driver.step(
                ev.ServiceDefined(svc.name, svc.gpu_mem_mib, svc.chunk_sizes, svc.load_s, svc.t_ori)
            )
        for api in self.config.apis:
            self.driver.step(ev.ApiDefined(api.name, api.mode, api.limit, api.period_s, core_keys(api)))
        for job in self.config.jobs:  # RL jobs' weights and caps (jobs_config.py)
            self.driver.step(job.event())
        self.recovery.restore(self.driver.step)

    def _open_sockets(self) -> None:
        """CURVE (its ZAP handler first) and the three ROUTER sockets; a failure leaves what was
        opened for ``_close_partial``."""
        o = self.options
        secure: dict[str, Any] = {"agents": None, "submit": None, "status": None}
        if o.certs:
            self.curve = ServerAuth(self.ctx, o.certs)
            # The ZAP handler runs in this context and starts before any socket binds.
            self.curve.start(on_dead=lambda _why: self.request_stop())
            secure = {name: functools.partial(self.curve.secure, name=name) for name in secure}
        self.agents_sock, self.agents_port = make_router(self.ctx, o.bind, o.agents_port, secure["agents"])
        hb = self.config.heartbeat_s  # the submit socket: no handover, ZMTP heartbeats (sessions.py)
        self.submit_sock, self.submit_port = make_router(
            self.ctx, o.bind, o.submit_port, secure["submit"], handover=False, heartbeat_s=hb
        )
        self.status_sock, self.status_port = make_router(self.ctx, o.bind, o.status_port, secure["status"])

    def _close_partial(self) -> None:
        """Undo a start that failed half-way (a port taken): sockets, ZAP handler, context, journal.
        Stopping the ZAP handler on purpose keeps its ``on_dead`` quiet."""
        for name in ("agents_sock", "submit_sock", "status_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self.curve is not None:
            with contextlib.suppress(Exception):
                self.curve.stop()
        if self._metrics_sock is not None:
            self._metrics_sock.close()
        self.ctx.term()
        self.journal.close()

    def _check_binds(self) -> Any:
        """Refuse a bind address the sockets may not use; bind the Prometheus endpoint's socket
        (metrics_http.py) on it and return it (None when the endpoint is off)."""
        o = self.options
        check_bind(o.bind, curve=bool(o.certs))
        check_local(o.bind)
        port = o.metrics_port if o.metrics_port is not None else self.config.metrics_port
        if port is None:
            return None
        # start-up cost: prometheus_client (~70 ms) loads only when metrics are on
        from tangram_cli.controller.metrics_http import metrics_socket

        return metrics_socket(o.bind, port)

    def _open_metrics(self) -> None:
        if self._metrics_sock is None:
            return
        # start-up cost: prometheus_client (~70 ms) loads only when metrics are on
        from tangram_cli.controller.metrics_http import MetricsCollector, MetricsServer

        clients = self.gateway.clients
        self.metrics = Metrics(
            self.registry.actions,
            lambda ident: (c.owner or c.name) if (c := clients.get(ident)) is not None else "",
            self.config.metrics_clients,
        )
        sections = ["cluster", "nodes", "jobs", "apis"]  # apis: each API key's figures (apis[].keys)
        collector = MetricsCollector(self.metrics, lambda: self._records(sections, 1))
        self.metrics_http = MetricsServer(self._metrics_sock, collector)

    # ------------------------------------------------------------ addresses
    def _host(self) -> str:
        return "127.0.0.1" if self.options.bind == "localhost" else self.options.bind

    @property
    def submit_addr(self) -> str:
        return f"tcp://{self._host()}:{self.submit_port}"

    @property
    def agents_addr(self) -> str:
        return f"tcp://{self._host()}:{self.agents_port}"

    @property
    def status_addr(self) -> str:
        return f"tcp://{self._host()}:{self.status_port}"

    def ready_info(self) -> dict[str, Any]:
        return {
            "agents": self.agents_port,
            "submit": self.submit_port,
            "status": self.status_port,
            "bind": self._host(),
            "pid": os.getpid(),
            "epoch": self.epoch,
            "cluster": self.config.cluster,
            "submit_addr": self.submit_addr,
            "agents_addr": self.agents_addr,
            "status_addr": self.status_addr,
            "curve": self.curve is not None,
            **self._metrics_info(),
        }

    def _metrics_info(self) -> dict[str, Any]:
        if self.metrics_http is None:
            return {}
        return {
            "metrics": self.metrics_http.port,
            "metrics_addr": f"http://{self._url_host()}:{self.metrics_http.port}/metrics",
        }

    def _url_host(self) -> str:
        host = self._host()
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    # ------------------------------------------------------------ dispatch (driver task only)
    def _holding(self) -> _Holding:
        """Around each driver batch: the finals it gives each client and what it sends each agent
        go as one message per peer at the end (`wire.Batcher`); the agents' first."""
        return _Holding(self.gateway.batcher, self.agents.batcher)

    def dispatch(self, event: ev.Event, commands: list[cmd.Command]) -> None:
        self.recovery.record(event, commands)  # durable before anything is sent
        loads: dict[tuple[str, str, int], asyncio.Future[None]] = {}
        dones: list[cmd.Done] = []
        now = self.clock.now()
        if self.metrics is not None:  # before the gateway answers and forgets the actions
            self.metrics.on_commands(commands, now)
        for c in commands:  # (the two of every exec first)
            if isinstance(c, cmd.Spawn):
                rec = self.registry.actions.get(c.action_id)
                if rec is None:
                    continue
                rec.started, rec.node, rec.cores, rec.dop = now, c.node, tuple(c.cores), c.dop
                self.registry.record_wait(now - rec.submitted)
                self.agents.spawn(c, rec)
            elif isinstance(c, cmd.Done):
                dones.append(c)
            elif isinstance(c, cmd.CreateSandbox):
                self.agents.create_sandbox(c)
                self.pools.on_create(c)
            elif isinstance(c, cmd.DestroySandbox):
                self.agents.destroy_sandbox(c)
            elif isinstance(c, cmd.Reserve):
                self.gateway.on_reserve(c)
            elif isinstance(c, cmd.Evict):
                self.agents.evict(c)
            elif isinstance(c, cmd.Load):
                loads[(c.node, c.service, c.start)] = self.agents.load(c)
            elif isinstance(c, cmd.Invoke):
                rec = self.registry.actions.get(c.action_id)
                if rec is None:
                    continue
                load = loads.get((c.node, c.service, c.start))
                rec.started, rec.node, rec.gpus = now, c.node, tuple(range(c.start, c.end))
                rec.loaded = load is not None
                self.registry.record_wait(now - rec.submitted)
                self.agents.invoke(c, rec, load)
            elif isinstance(c, cmd.Grant):
                self.gateway.on_grant(c)
            elif isinstance(c, cmd.Kill):
                rec = self.registry.actions.get(c.action_id)
                if rec is not None and not rec.kill_reason:
                    rec.kill_reason = c.reason or "killed"
                if rec is None or rec.kind == "exec":
                    self.agents.kill(c)
            elif isinstance(c, cmd.Reject):
                self.gateway.on_reject(c)
        for d in dones:
            self.gateway.on_done(d)

    def _on_hello(self, node: str, sandboxes: set[str]) -> None:
        """A node's session started: adopt its sandboxes (recovery), then send its pool targets."""
        self.recovery.on_hello(node, sandboxes)
        self.pools.on_hello(node)

    # ------------------------------------------------------------ status
    def _records(self, sections: list[str], limit: int) -> dict[str, Any]:
        counters = {
            **self.gateway.counters,
            **self.agents.counters,
            **self.recovery.counters,
            **self.pools.counters,
            "driver_yields": self.driver.yields,
            "state_lines": self.gateway.ledger.written,
        }
        if self.driver.collector is not None:
            counters["gc_full"] = self.driver.collector.full
            counters["gc_full_longest_ms"] = round(self.driver.collector.longest_s * 1e3)
        return build_records(
            self.core,
            sections=sections,
            limit=limit,
            cluster=self.config.cluster,
            epoch=self.epoch,
            started=self.started,
            addresses={"agents": self.agents_addr, "submit": self.submit_addr, "status": self.status_addr},
            agent_rows=self.agents.rows(),
            client_rows=self.gateway.rows(),
            sandboxes=list(self.registry.sandboxes.values()),
            actions=self.registry.actions,
            counters=counters,
            wait_p50=self.registry.wait_p50(),
            loop_lag_s=round(self.driver.loop_lag_s, 6),
            events=self.driver.handled,
            decide={**self.driver.decide.quantiles(), "slowest": [list(x) for x in self.driver.slow]},
            now=self.clock.now(),
            services_conf=list(self.config.services),
            pool_targets=self.pools.node_targets(),
        )

    # ------------------------------------------------------------ lifecycle
    async def check_security(self) -> None:
        """With CURVE: connect with an unknown key and with NULL to every socket; RuntimeError
        unless all are refused (fail closed). Without CURVE: nothing (loopback only)."""
        if self.curve is not None:
            await self.curve.self_test(
                {"agents": self.agents_addr, "submit": self.submit_addr, "status": self.status_addr}
            )

    def start(self) -> None:
        self._open_metrics()
        for coro in (
            self.driver.run(),
            self.agents.run(),
            self.agents.liveness(),
            self.gateway.run(),
            self.gateway.liveness(),
            self.status.run(),
            self._housekeeping(),
            self.pools.run(),
            *((self.metrics_http.run(),) if self.metrics_http is not None else ()),
        ):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    async def _housekeeping(self) -> None:
        """Twice a second: heartbeat the clients that wait (`Sessions.beat_waiting`), fsync the
        state file if it changed, lose restored sandboxes no agent adopted within the grace."""
        while True:
            await asyncio.sleep(0.5)
            self.gateway.beat_waiting()
            self.gateway.ledger.sync()
            self.recovery.expire()

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("controller task died: %r", exc, exc_info=exc)
            self._stopped.set()

    def request_stop(self, down: bool = False) -> None:
        self.down_requested = self.down_requested or down
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        if self.down_requested:
            await self.agents.shutdown_agents("down")
        await cancel_tasks(self._tasks)
        if self.metrics_http is not None:
            self.metrics_http.close()
        if self._metrics_sock is not None:  # bound, never served if the controller never started
            self._metrics_sock.close()
        await self.agents.close()
        await self.gateway.close()
        for sock in (self.agents_sock, self.submit_sock, self.status_sock):
            sock.close(linger=0)
        if self.curve is not None:
            await self.curve.aclose()  # closes the ZAP socket, else term() waits for it
        self.ctx.term()
        self.journal.close()
        self.gateway.ledger.close()

    async def __aenter__(self) -> Controller:
        self.start()
        try:
            await self.check_security()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def restore_grace(config: ControllerConfig) -> float:
    """How long restored sandboxes wait for their agents: a few heartbeats plus an agent's
    reconnect backoff."""
    return max(10.0, 6 * config.heartbeat_s)


def write_ready(path: str, info: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(info, fh)
        fh.write("\n")
    os.replace(tmp, path)


async def serve(
    config: ControllerConfig, options: Options, *, print_ready: bool = True, own_process: bool = False
) -> int:
    controller = Controller(config, options)
    if own_process:  # the process is the controller's alone: move full GC off the hot path
        controller.driver.collector = Collector(quiet=lambda: not controller.registry.actions)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, controller.request_stop)
    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, lambda: controller.request_stop(down=True))
    controller.start()
    try:
        await controller.check_security()
    except RuntimeError as exc:
        log.error("%s", exc)
        await controller.stop()
        return 1
    info = controller.ready_info()
    if options.ready_file:
        write_ready(options.ready_file, info)
    if print_ready:
        print(json.dumps(info), flush=True)
    if controller.curve is None:
        log.warning(
            "plain TCP (no --certs): any local user can connect as an agent or a client; for development "
            "and tests only (`tangram up` runs CURVE)"
        )
    log.info(
        "controller %s up: agents %s, submit %s, status %s%s",
        config.cluster,
        controller.agents_addr,
        controller.submit_addr,
        controller.status_addr,
        f", metrics {info['metrics_addr']}" if "metrics_addr" in info else "",
    )
    try:
        await controller.wait_stopped()
    finally:
        await controller.stop()
        if options.ready_file:
            with contextlib.suppress(OSError):
                os.unlink(options.ready_file)
    return 0


def run_controller(config: ControllerConfig, options: Options) -> int:
    logfmt.configure("controller", fmt=options.log_format, level=logfmt.env_level("INFO"))
    return asyncio.run(serve(config, options, own_process=True))


class _Holding:
    """``with a, b:`` for two `wire.Batcher`s, as one object (``Controller._holding``): ``b``
    releases first, then ``a``, also when the batch raised."""

    __slots__ = ("a", "b")

    def __init__(self, a: Batcher, b: Batcher) -> None:
        self.a, self.b = a, b

    def __enter__(self) -> None:
        self.a.__enter__()
        self.b.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.b.__exit__(*exc)
        finally:
            self.a.__exit__(*exc)
