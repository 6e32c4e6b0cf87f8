"""The node agent process: a ZeroMQ DEALER to the controller's agents ROUTER, and the request handlers.

Life of a connection (docs/agent.md, docs/contract.md):

1. A new DEALER (routing identity = node name) connects and sends ``Hello`` (request id 0) with the
   machine facts and the sandboxes that still exist. ``Welcome`` starts a session and sets the epochs
   and the heartbeat interval; ``Reject`` ends the agent (exit 3) unless its reason is retryable
   (``REJECT_RETRYABLE``). No answer within ``hello_timeout_s``: close, back off, try again.
2. In a session each side sends ``Heartbeat`` after ``heartbeat_s`` without other traffic; any inbound
   message counts. Three silent intervals: the controller is lost; the socket is closed and a new one says
   ``Hello`` again after a jittered backoff (``backoff_min_s`` doubling to ``backoff_max_s``).
3. Each request runs in its own task, owned by ``Agent._tasks`` (nothing dangles: stopping cancels and
   awaits them) and answered EXACTLY once with its request id: ``Result``, ``Ack`` (``Kill``) or
   ``Error`` (exceptions map to codes in ``error_reply``). Undecodable frames get ``ERROR BAD_REQUEST``.
   Replies that cannot be sent (cut off) wait in a bounded outbox and go out after the next ``Welcome``.
4. Cut off for ``orphan_timeout_s`` with actions running: every running action is killed (its Spawn still
   answers, ``killed=True``).
5. ``Shutdown`` -> running requests cancelled (answered ``NODE_LOST``), sandboxes destroyed when the reason
   is ``"down"``, ``Bye`` with the Shutdown's request id, exit 0. SIGTERM/SIGINT: the same after up to
   ``stop_grace_s`` for running requests, sandboxes left running, ``Bye`` with request id 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq

from agent import staged
from agent.executors.base import SandboxSpec, check_name
from tangram import protocol as p
from tangram.certs import KeyRefused
from tangram.errors import (
    BadRequest,
    ErrorCode,
    NodeLost,
    ProtocolError,
    RetryLater,
)
from tangram.outcomes import ExecOutcome

from .config import AgentConfig
from .executors.base import RunRequest
from .executors.spawn import wait_done
from .gpu_requests import MAX_TIMEOUT_S, GpuRequests
from .node import (  # noqa: F401 - agent.link.main is the entry point tangram_cli calls
    build_executor,
    build_facts,
    build_gpu_host,
    main,
    remove_pidfile,
    run_agent,
    setup_logging,
    write_pidfile,
)
from .pool_requests import PoolRequests
from .replies import ReplySender
from .support import (  # noqa: F401 - part of agent.link's interface (tests)
    Backoff,
    _Outbox,
    _require_local_image,
    error_reply,
    gpu_chunk,
    peek_request_id,
    reject_is_retryable,
    to_tangram_error,
)
from .wire import Wire, agent_socket, close_monitor, handshake_refusal

log = logging.getLogger("agent")

EXIT_OK, EXIT_FAIL, EXIT_CONFIG, EXIT_REJECTED = 0, 1, 2, 3
KILL_RETRY_S = 10.0  # a Kill that races the start of its action keeps trying this long
LIVENESS = 3  # heartbeat intervals of silence before the peer counts as lost
OUTPUT_CAP = 16 << 20  # per stream; stdout + stderr stay under protocol.MAX_MESSAGE_BYTES
GET_CAP = p.MAX_MESSAGE_BYTES - (1 << 20)
GPU_MESSAGES = (p.Prepare, p.Load, p.Evict, p.Invoke)

Reply = tuple[p.Message, list[bytes]]
Handler = Callable[[Any, tuple[bytes, ...]], Awaitable[Reply]]


class AgentExit(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Running:
    action: str
    attempt: int
    kind: str  # "spawn" | "invoke"
    outcome: asyncio.Future[Reply]
    inner: asyncio.Task[Any] | None = None  # invoke: the GPU call, cancelled by Kill
    killed: bool = False
    stop: asyncio.Future[None] | None = None  # a staged spawn, until it starts: a Kill resolves it


class Agent(GpuRequests, ReplySender, PoolRequests):
    """One agent: ``await Agent(cfg, executor, facts=...).run()`` returns the process exit code."""

    def __init__(self, cfg: AgentConfig, executor: Any, *, facts: dict[str, Any], gpu_host: Any = None,
                 cpus: list[int] | None = None) -> None:
        self.cfg = cfg
        self.executor = executor
        self.gpu = gpu_host
        self.facts = facts
        self.cpus = set(cpus if cpus is not None else facts.get("cpus", []))
        self._setup_pool()
        self.controller_epoch = 0
        self.agent_epoch = 0
        self.heartbeat_s = cfg.heartbeat_s
        self._wire: Wire | None = None  # the current session's socket
        self._live: Wire | None = None  # where replies go while welcomed
        self._ending: asyncio.Future[tuple[str, p.Envelope | None]] | None = None
        self._welcomed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running: dict[str, _Running] = {}
        self._flights = staged.Flights()  # Spawn requests in flight per action (staged starts wait on them)
        self._outbox = _Outbox(cfg.outbox_mib << 20)
        self._replies: list[list[bytes]] = []  # replies of this loop iteration, sent as one batch
        self._batches = False  # the controller's Welcome said minor >= BATCH_MINOR
        self._unstage = False  # the Welcome said minor >= UNSTAGE_MINOR: a staged start may be given back
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._last_in = time.monotonic()
        self._last_out = 0.0
        self._orphaned = False
        self.sessions = 0  # Welcomes received (tests and logs)
        self._curve = cfg.curve_keys()  # tangram.certs.CurveKeys or None (plain TCP, loopback only)
        self._monitor: zmq.Socket | None = None  # the session socket's handshake events (refused keys)
        self._handlers: dict[type[p.Message], Handler] = {
            p.CreateSandbox: self._create_announced,
            p.DestroySandbox: self._destroy_sandbox,
            p.PutFile: self._put_file,
            p.GetFile: self._get_file,
            p.Cpuset: self._cpuset,
            p.Spawn: self._spawn_after_create,
            p.Kill: self._kill,
            p.Prepare: self._prepare,
            p.Load: self._load,
            p.Evict: self._evict,
            p.Invoke: self._invoke,
            p.SandboxPool: self._sandbox_pool,
        }

    # ------------------------------------------------------------ lifecycle

    def stop(self, reason: str = "stopping") -> None:
        """Graceful stop (signal handlers call this)."""
        if not self._stop.is_set():
            log.info("stop requested: %s", reason)
            self._stop_reason = reason
            self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.stop, signal.Signals(sig).name)
        ctx = zmq.Context()
        watchdog = asyncio.create_task(self._orphan_watch(), name="orphan-watch")
        backoff = Backoff(self.cfg.backoff_min_s, self.cfg.backoff_max_s)
        code = EXIT_OK
        try:
            await self._prepare_services()
            while not self._stop.is_set():
                welcomed = await self._session(ctx)
                if self._stop.is_set():
                    break
                if welcomed:
                    backoff.reset()
                delay = backoff.next()
                log.info("reconnecting to %s in %.2f s", self.cfg.controller, delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            if self._tasks:  # stopped while cut off: nobody to answer, but nothing may dangle
                await self._cancel_requests(self.cfg.stop_grace_s)
        except AgentExit as exc:
            log.error("%s", exc)
            code = exc.code
            await self._cancel_requests(0)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
            ctx.destroy(linger=0)
        log.info("agent %s exits (%d)", self.cfg.name, code)
        return code

    async def close(self) -> None:
        """Release the executor and GPU host (after ``run``)."""
        with contextlib.suppress(Exception):
            await self.executor.close()
        if self.gpu is not None:
            with contextlib.suppress(Exception):
                await self.gpu.aclose(timeout_s=5.0)

    async def _prepare_services(self) -> None:
        for raw in self.cfg.services:
            if self.gpu is None:
                raise AgentExit(EXIT_CONFIG, "services are configured but this agent has no GPUs")
            from agent.gpu.base import ServiceSpec  # GPU modules load on the GPU path only (node.py)

            name = raw["name"]
            try:
                await self.gpu.prepare(name, ServiceSpec.from_dict(name, raw))
            except Exception as exc:  # noqa: BLE001 - a bad service spec is a config error
                raise AgentExit(EXIT_CONFIG, f"service {name!r}: {exc}") from None
            log.info("prepared service %s", name)

    # ------------------------------------------------------------ one connection

    def _socket(self, ctx: zmq.Context) -> zmq.Socket:
        sock, self._monitor = agent_socket(ctx, self.cfg, self._curve, LIVENESS)
        return sock

    def _handshake_refusal(self) -> KeyRefused | None:
        """A refused handshake this session's monitor saw (tangram.certs.HandshakeWatch), else None."""
        return handshake_refusal(self._monitor, self.cfg, self._curve)

    def _close_monitor(self, sock: zmq.Socket) -> None:
        mon, self._monitor = self._monitor, None
        close_monitor(sock, mon)

    async def _session(self, ctx: zmq.Context) -> bool:
        """One socket from Hello to loss or stop; True when a Welcome came. Raises AgentExit on Reject."""
        self._welcomed = False
        self._ending = asyncio.get_running_loop().create_future()
        self._ending.add_done_callback(lambda f: f.cancelled() or f.exception())
        wire = Wire(self._socket(ctx), self._on_frames)
        try:
            hello = p.Hello(role="agent", name=self.cfg.name, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR,
                            facts=self._hello_facts(self.facts), bundle="",
                            sandboxes=await self._sandbox_names(),
                            actions=[{"action": r.action, "attempt": r.attempt, "kind": r.kind}
                                     for r in self._running.values()])
            t_hello = time.monotonic()
            # waits for the TCP connection (IMMEDIATE)
            if not await wire.send_within(p.encode(hello, 0), self.cfg.hello_timeout_s):
                refused = self._handshake_refusal()
                if refused is not None:
                    log.error("%s; to fix: %s", refused.message, refused.hint)
                else:
                    log.warning("cannot reach %s within %.1f s", self.cfg.controller,
                                self.cfg.hello_timeout_s)
                return False
            self._last_out = time.monotonic()
            self._wire = wire
            log.info("hello sent to %s as %s", self.cfg.controller, self.cfg.name)
            while True:
                if self._stop.is_set():
                    await self._finish(wire, self._stop_reason, 0, destroy=False, grace=self.cfg.stop_grace_s)
                    return self._welcomed
                if await wait_done(self._ending, min(0.1, self.heartbeat_s / 4)):
                    await self._end_session(wire)
                    return self._welcomed
                if not self._tick(wire, t_hello):
                    return self._welcomed
        finally:
            self._wire = self._live = None
            self._welcomed = False
            self._close_monitor(wire.sock)
            wire.close()

    def _tick(self, wire: Wire, t_hello: float) -> bool:
        """Timers of a session: the Hello deadline, liveness, heartbeats, the outbox. False: end it."""
        now = time.monotonic()
        if not self._welcomed:
            if now - t_hello > self.cfg.hello_timeout_s:
                log.warning("no Welcome from %s within %.1f s", self.cfg.controller, self.cfg.hello_timeout_s)
                return False
            return True
        if now - self._last_in > LIVENESS * self.heartbeat_s:
            wire.drain()  # what arrived while this process waited for a core counts
        if now - self._last_in > LIVENESS * self.heartbeat_s:
            log.warning("controller silent for %.1f s: reconnecting", now - self._last_in)
            return False
        if now - self._last_out >= self.heartbeat_s:
            self._send_on(wire, p.encode(p.Heartbeat(load=self._load_summary()), 0))
        self._flush_outbox(wire)
        return True

    async def _end_session(self, wire: Wire) -> None:
        """The session ended on a message: Bye or a retryable Reject (lost), Shutdown, or a final Reject."""
        kind, env = self._ending.result()  # raises AgentExit for a final Reject
        if kind == "shutdown":
            assert env is not None
            assert isinstance(env.msg, p.Shutdown)
            reason = env.msg.reason
            log.info("shutdown requested by the controller: %s", reason or "(no reason)")
            await self._finish(wire, reason or "shutdown", env.request_id, destroy=reason == "down",
                               grace=0.0)
            self.stop(f"shutdown: {reason}")

    def _end(self, kind: str, env: p.Envelope | None = None, exc: BaseException | None = None) -> None:
        if self._ending is None or self._ending.done():
            return
        if exc is not None:
            self._ending.set_exception(exc)
        else:
            self._ending.set_result((kind, env))

    def _on_frames(self, frames: list[bytes]) -> int:
        """One inbound message (a batch: each item), handled synchronously from the socket reader;
        returns how many messages it carried."""
        if self._ending is None or self._ending.done():
            return 1  # the session is over: what follows is not read, as on a closed socket
        self._last_in = time.monotonic()
        self._orphaned = False
        try:
            envs = p.decode_all(frames)
        except ProtocolError as exc:
            rid = peek_request_id(frames)
            log.warning("undecodable message (request %d): %s", rid, exc)
            self._reply(rid, p.Error.from_exception(exc))
            return 1
        for env in envs:  # one, or the items of a batch
            if isinstance(env, p.BadItem):
                log.warning("undecodable message (request %d): %s", env.request_id, env.error)
                self._reply(env.request_id, p.Error.from_exception(env.error))
            else:
                self._on_envelope(env)
        return len(envs)

    def _on_envelope(self, env: p.Envelope) -> None:
        msg = env.msg
        handler = self._handlers.get(type(msg))
        if handler is not None:
            self._start_request(env, handler)
        elif isinstance(msg, p.Welcome):
            if not self._welcomed:
                try:
                    self._on_welcome(msg)
                except AgentExit as exc:
                    self._end("", exc=exc)
        elif isinstance(msg, p.Reject):
            if self._welcomed or reject_is_retryable(msg.reason):
                log.warning("rejected by the controller: %s (will retry)", msg.reason)
                self._end("lost")
            else:
                self._end("", exc=AgentExit(EXIT_REJECTED, f"rejected by the controller: {msg.reason}"))
        elif isinstance(msg, p.Bye):
            log.info("controller said bye: %s", msg.reason or "(no reason)")
            self._end("lost")
        elif isinstance(msg, p.Shutdown):
            self._end("shutdown", env)
        elif not isinstance(msg, (p.Heartbeat, p.Ack)):
            why = f"{type(msg).__name__} is not a request an agent serves"
            self._reply(env.request_id, error_reply(BadRequest(why)))

    def _start_request(self, env: p.Envelope, handler: Handler) -> None:
        if len(self._tasks) >= self.cfg.max_inflight:
            why = f"agent busy: {len(self._tasks)} requests in flight"
            self._reply(env.request_id, error_reply(RetryLater(why)))
            return
        if type(env.msg) is p.Spawn:
            self._flights.enter(env.msg.action)  # at once: a Spawn staged after it may be right behind
        task = asyncio.create_task(self._serve(env, handler))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_welcome(self, msg: p.Welcome) -> None:
        if msg.major != p.PROTOCOL_MAJOR:
            raise AgentExit(EXIT_REJECTED,
                            f"controller speaks {msg.major}, agent {p.PROTOCOL_MAJOR}: run tangram up")
        self._welcomed = True
        self._batches = msg.minor >= p.BATCH_MINOR
        self._unstage = msg.minor >= p.UNSTAGE_MINOR  # it takes a staged start back (staged.py)
        self._live = self._wire
        self.controller_epoch, self.agent_epoch = msg.controller_epoch, msg.agent_epoch
        self.heartbeat_s = msg.heartbeat_s
        self.sessions += 1
        log.info("welcomed by %s (controller epoch %d, agent epoch %d, heartbeat %.2f s)",
                 self.cfg.controller, msg.controller_epoch, msg.agent_epoch, msg.heartbeat_s)
        if self._wire is not None:
            self._flush_outbox(self._wire)

    async def _finish(self, wire: Wire, reason: str, rid: int, *, destroy: bool, grace: float) -> None:
        """Answer what runs (after ``grace``), destroy sandboxes if asked, say Bye on ``wire``."""
        self._live = wire if self._welcomed else None
        await self._cancel_requests(grace)
        if destroy:
            await self._destroy_all()
            await self._drain_pool()
        self._flush_outbox(wire)
        if self._welcomed or rid:
            self._send_on(wire, p.encode(p.Bye(reason=reason[:1000]), rid))
        log.info("bye sent (%s)", reason)

    async def _cancel_requests(self, grace: float) -> None:
        if not self._tasks:
            return
        if grace > 0:
            log.info("waiting up to %.1f s for %d running requests", grace, len(self._tasks))
            await asyncio.wait(set(self._tasks), timeout=grace)
        pending = set(self._tasks)
        for task in pending:
            task.cancel()
        if pending:
            log.info("cancelled %d running requests", len(pending))
            await asyncio.wait(pending, timeout=30)

    async def _destroy_all(self) -> None:
        for name in await self._sandbox_names():
            try:
                await self.executor.destroy_sandbox(name)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not destroy sandbox %s: %s", name, exc)
        log.info("sandboxes destroyed")

    async def _sandbox_names(self) -> list[str]:
        try:
            return list(await self.executor.list_sandboxes())[: p.MAX_ITEMS]
        except Exception as exc:  # noqa: BLE001 - e.g. dockerd gone: report none rather than not say hello
            log.warning("cannot list sandboxes: %s", exc)
            return []

    # ------------------------------------------------------------ sending

    def _load_summary(self) -> dict[str, Any]:
        return {"running": len(self._running), "requests": len(self._tasks), **self._pool_load()}

    # ------------------------------------------------------------ requests

    async def _serve(self, env: p.Envelope, handler: Handler) -> None:
        try:
            await self._serve_one(env, handler)
        finally:
            if type(env.msg) is p.Spawn:  # after its reply is queued
                self._flights.leave(env.msg.action, env.msg.after)

    async def _serve_one(self, env: p.Envelope, handler: Handler) -> None:
        rid = env.request_id
        try:
            msg, blobs = await handler(env.msg, env.blobs)
        except asyncio.CancelledError:
            msg, blobs = error_reply(NodeLost("the agent stopped before the request finished")), []
        except Exception as exc:  # noqa: BLE001 - every failure becomes exactly one Error reply
            msg, blobs = error_reply(exc), []
            if isinstance(msg, p.Error) and msg.code == ErrorCode.INTERNAL.value:
                log.error("request %d (%s) failed:\n%s", rid, type(env.msg).__name__, traceback.format_exc())
            else:
                log.info("request %d (%s): %s %s", rid, type(env.msg).__name__, msg.code, msg.message)
        self._reply(rid, msg, blobs)

    def _check_epochs(self, epoch: int, agent_epoch: int) -> None:
        if epoch and self.controller_epoch and epoch != self.controller_epoch:
            raise BadRequest(f"stale dispatch: controller epoch {epoch}, current {self.controller_epoch}")
        if agent_epoch and self.agent_epoch and agent_epoch != self.agent_epoch:
            raise BadRequest(f"stale dispatch: agent epoch {agent_epoch}, current {self.agent_epoch}")

    async def _create_sandbox(self, msg: p.CreateSandbox, blobs: tuple[bytes, ...]) -> Reply:
        check_name("sandbox", msg.sandbox)
        spec = SandboxSpec(msg.sandbox, msg.image or self.cfg.image, msg.mem_mib, dict(msg.labels))
        if self._claim(spec):  # a warm one from the pool: no image check, no container to make
            log.info("sandbox %s claimed from the pool (%s, %d MiB)", msg.sandbox, spec.image, spec.mem_mib)
            return p.Result({"pooled": True}), []
        client = getattr(self.executor, "client", None)
        if client is not None and hasattr(client, "images"):  # docker: never pull, only local images
            await asyncio.to_thread(_require_local_image, client, spec.image, self.cfg.name)
        try:
            await self.executor.create_sandbox(spec)
        except Exception as exc:
            if getattr(exc, "status_code", None) == 409 and msg.sandbox in await self._sandbox_names():
                return p.Result({"existed": True}), []
            raise
        log.info("sandbox %s created (%s, %d MiB)", msg.sandbox,
                 spec.image if client is not None else "directory", spec.mem_mib)
        return p.Result({}), []

    async def _destroy_sandbox(self, msg: p.DestroySandbox, blobs: tuple[bytes, ...]) -> Reply:
        check_name("sandbox", msg.sandbox)
        await self.executor.destroy_sandbox(msg.sandbox)
        log.info("sandbox %s destroyed", msg.sandbox)
        return p.Result({}), []

    async def _put_file(self, msg: p.PutFile, blobs: tuple[bytes, ...]) -> Reply:
        await self.executor.put(msg.sandbox, msg.path, blobs[0])
        return p.Result({}), []

    async def _get_file(self, msg: p.GetFile, blobs: tuple[bytes, ...]) -> Reply:
        data = await self.executor.get(msg.sandbox, msg.path, GET_CAP)
        return p.Result({"size": len(data)}), [data]

    async def _cpuset(self, msg: p.Cpuset, blobs: tuple[bytes, ...]) -> Reply:
        raise BadRequest("CPUSET is not served: the agent sets a sandbox's cpuset per Spawn "
                         "(allocate on execution)")

    async def _spawn(self, msg: p.Spawn, blobs: tuple[bytes, ...]) -> Reply:
        same = self._running.get(msg.action)
        if same is not None:
            if same.kind == "spawn" and same.attempt == msg.attempt:  # a resend: join the running attempt
                return await asyncio.shield(same.outcome)
            raise BadRequest(f"action {msg.action!r} attempt {same.attempt} is already running here")
        self._check_epochs(msg.epoch, msg.agent_epoch)
        outside = sorted(set(msg.cores) - self.cpus)
        if not msg.cores or outside:
            raise BadRequest(f"cores {outside or '[]'} are not cores this agent hands out "
                             f"({sorted(self.cpus)})")
        timeout = min(msg.timeout_s, MAX_TIMEOUT_S) if msg.timeout_s > 0 else MAX_TIMEOUT_S
        req = RunRequest(msg.action, msg.sandbox, msg.cmd, tuple(msg.cores), dict(msg.env), timeout, msg.dop,
                         OUTPUT_CAP, blobs[0] if blobs else None)
        run = self._track(msg.action, msg.attempt, "spawn")
        try:
            waited = 0.0
            if msg.after:  # a staged start: on msg.after's cores, once it has ended here
                run.stop = asyncio.get_running_loop().create_future()
                verdict, waited = await staged.wait(self._flights, msg.action, msg.after, run.stop,
                                                    self._ending, lambda: self._ending if self._welcomed
                                                    else None, self._unstage)
                run.stop = None
                if verdict != staged.GO:  # killed while staged, its session is over, or given back
                    echo = self._echo(msg.action, msg.attempt, msg.epoch, msg.agent_epoch)
                    out = ExecOutcome(killed=verdict == staged.STOP, unstaged=verdict == staged.GIVE_BACK,
                                      waited_s=waited, **echo)
                    return self._settle(run, out, b"", b"")
            res = await self.executor.run(req)
            outcome = ExecOutcome(exit_code=res.exit_code, truncated=res.truncated, timed_out=res.timed_out,
                                  killed=res.killed, run_s=res.run_s, setup_s=res.setup_s, waited_s=waited,
                                  cores=tuple(res.cores),
                                  **self._echo(msg.action, msg.attempt, msg.epoch, msg.agent_epoch))
            log.debug("action %s/%d ended: exit %d%s%s in %.3f s on cores %s", msg.action, msg.attempt,
                     res.exit_code, " (timed out)" if res.timed_out else "",
                     " (killed)" if res.killed else "",
                     res.run_s, list(res.cores))
            return self._settle(run, outcome, res.stdout, res.stderr)
        except BaseException as exc:
            run.outcome.set_exception(exc if isinstance(exc, Exception) else NodeLost("agent stopping"))
            raise
        finally:
            self._running.pop(msg.action, None)

    @staticmethod
    def _settle(run: _Running, outcome: ExecOutcome, stdout: bytes, stderr: bytes) -> Reply:
        reply: Reply = (p.Result(outcome.to_body()), [stdout, stderr])
        run.outcome.set_result(reply)
        return reply

    def _track(self, action: str, attempt: int, kind: str) -> _Running:
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        run = self._running[action] = _Running(action, attempt, kind, fut)
        return run

    def _echo(self, action: str, attempt: int, epoch: int, agent_epoch: int) -> dict[str, Any]:
        """The attempt's identity for an outcome (`ExecOutcome`/`CallOutcome` fields), for fencing."""
        return {"action": action, "attempt": attempt, "epoch": epoch or self.controller_epoch,
                "agent_epoch": agent_epoch or self.agent_epoch, "node": self.cfg.name}

    async def _kill(self, msg: p.Kill, blobs: tuple[bytes, ...]) -> Reply:
        run = self._running.get(msg.action)
        if run is None or (msg.attempt and msg.attempt != run.attempt):
            log.info("kill %s: not running here", msg.action)
            return p.Ack(), []
        await self._kill_running(run)
        log.info("kill %s/%d", run.action, run.attempt)
        return p.Ack(), []

    async def _kill_running(self, run: _Running) -> None:
        run.killed = True
        if run.stop is not None:  # staged, not started: it answers at once, unstarted
            if not run.stop.done():
                run.stop.set_result(None)
            return
        if run.kind == "invoke":
            if run.inner is not None:
                run.inner.cancel()
            return
        # The executor knows the action only once its process exists: retry until then (bounded).
        end = time.monotonic() + KILL_RETRY_S
        while not await self.executor.kill(run.action):
            if run.outcome.done() or time.monotonic() > end:
                return
            await asyncio.sleep(0.02)

    async def _orphan_watch(self) -> None:
        period = max(0.05, min(1.0, self.cfg.orphan_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            cut_off = time.monotonic() - self._last_in
            if self._orphaned or not self._running or cut_off <= self.cfg.orphan_timeout_s:
                continue
            self._orphaned = True
            log.warning("cut off from the controller for %.1f s: killing %d running actions", cut_off,
                        len(self._running))
            for run in list(self._running.values()):
                with contextlib.suppress(Exception):
                    await self._kill_running(run)
