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
import os
import random
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio

import tangram
from tangram import protocol as p
from tangram.errors import (
    ActionTimeout,
    BadRequest,
    Cancelled,
    ConfigError,
    ErrorCode,
    InternalError,
    NodeLost,
    ProtocolError,
    RemoteError,
    RetryLater,
    SandboxLost,
    TangramError,
)

from .config import AgentConfig

log = logging.getLogger("agent")

EXIT_OK, EXIT_FAIL, EXIT_CONFIG, EXIT_REJECTED = 0, 1, 2, 3
KILL_RETRY_S = 10.0  # a Kill that races the start of its action keeps trying this long
LIVENESS = 3  # heartbeat intervals of silence before the peer counts as lost
OUTPUT_CAP = 16 << 20  # per stream; stdout + stderr stay under protocol.MAX_MESSAGE_BYTES
GET_CAP = p.MAX_MESSAGE_BYTES - (1 << 20)
MAX_TIMEOUT_S = 86399.0  # executors take (0, 86400); Spawn timeout 0 means "no deadline given"
PAYLOAD_LIMITS = {"max_str_len": p.MAX_MESSAGE_BYTES, "max_bin_len": p.MAX_MESSAGE_BYTES,
                  "max_array_len": 1 << 20, "max_map_len": 1 << 20, "max_ext_len": 0}
REJECT_RETRYABLE = ("duplicate", "already", "retry", "later", "restart", "grace", "busy")
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


@dataclass
class _Outbox:
    limit_bytes: int
    items: deque[list[bytes]] = field(default_factory=deque)
    size: int = 0
    dropped: int = 0

    def push(self, frames: list[bytes]) -> None:
        n = sum(len(f) for f in frames)
        self.items.append(frames)
        self.size += n
        while self.size > self.limit_bytes and len(self.items) > 1:
            old = self.items.popleft()
            self.size -= sum(len(f) for f in old)
            self.dropped += 1
            log.warning("outbox full: dropped a buffered reply (%d dropped so far)", self.dropped)

    def pop(self) -> list[bytes]:
        frames = self.items.popleft()
        self.size -= sum(len(f) for f in frames)
        return frames


class Backoff:
    """Exponential from ``lo`` to ``hi``, each delay jittered into [d/2, d]."""

    def __init__(self, lo: float, hi: float, rng: random.Random | None = None) -> None:
        self.lo, self.hi, self.n = lo, hi, 0
        self.rng = rng or random.Random()

    def next(self) -> float:
        d = min(self.hi, self.lo * (2 ** min(self.n, 30)))
        self.n += 1
        return d * self.rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.n = 0


def reject_is_retryable(reason: str) -> bool:
    low = reason.lower()
    return any(word in low for word in REJECT_RETRYABLE)


def peek_request_id(frames: list[bytes]) -> int:
    """The request id of a message that did not decode, when frame 2 holds one; else 0."""
    if len(frames) > 2 and isinstance(frames[2], (bytes, bytearray)) and len(frames[2]) == 8:
        rid = int.from_bytes(frames[2], "big")
        if rid < 2**63:
            return rid
    return 0


def gpu_chunk(gpus: list[int]) -> tuple[int, int]:
    """[2, 3] -> (2, 4); the contract sends chunks as consecutive GPU indices."""
    if not gpus or list(gpus) != list(range(gpus[0], gpus[0] + len(gpus))):
        raise BadRequest(f"gpus must be consecutive indices [start, ..., end-1], got {list(gpus)[:16]}")
    return gpus[0], gpus[0] + len(gpus)


def error_reply(exc: BaseException) -> p.Error:
    """The wire error for an exception a handler raised (see docs/agent.md, "Errors")."""
    return p.Error.from_exception(to_tangram_error(exc))


def to_tangram_error(exc: BaseException) -> BaseException:
    from agent.executors.base import ExecutorError, PathRejected, SandboxNotFound, TooLarge

    if isinstance(exc, TangramError):
        return exc
    if isinstance(exc, SandboxNotFound):
        return SandboxLost(str(exc))
    if isinstance(exc, (PathRejected, TooLarge)):
        return BadRequest(str(exc))
    gpu = _gpu_error(exc)
    if gpu is not None:
        return gpu
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return ActionTimeout(str(exc) or "timed out")
    docker = _docker_error(exc)
    if docker is not None:
        return docker
    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, ExecutorError):
        return BadRequest(str(exc) or type(exc).__name__)
    if isinstance(exc, (ExecutorError, OSError)):
        return InternalError(f"{type(exc).__name__}: {exc}")
    return exc  # becomes INTERNAL without its text


def _gpu_error(exc: BaseException) -> TangramError | None:
    try:
        from agent.gpu import base as g
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(exc, g.GpuError):
        return None
    msg = str(exc) + (f" (hint: {exc.hint})" if exc.hint else "")
    detail = exc.detail or None
    if isinstance(exc, g.ServiceError):
        return RemoteError(msg, detail=detail)
    if isinstance(exc, g.CallTimeout):
        return ActionTimeout(msg, detail=detail)
    if isinstance(exc, (g.UnknownService, g.SpecMismatch, g.BadChunk)):
        return BadRequest(msg, detail=detail)
    if isinstance(exc, g.GpuOutOfMemory):
        return RetryLater(msg, detail=detail)
    return InternalError(msg, detail=detail)


def _docker_error(exc: BaseException) -> TangramError | None:
    if not type(exc).__module__.startswith("docker"):
        return None
    status = getattr(exc, "status_code", None)
    text = getattr(exc, "explanation", None) or str(exc)
    if type(exc).__name__ == "ImageNotFound":
        return BadRequest(f"image not found on this node: {text}")
    if isinstance(status, int) and 400 <= status < 500:
        return BadRequest(f"docker refused: {text}")
    return InternalError(f"docker error: {text}")


def _require_local_image(client: Any, image: str, node: str) -> None:
    import docker.errors

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise BadRequest(f"image {image!r} is not on node {node}; the agent never pulls",
                         hint="docker load or docker import it on the node first") from None


class Agent:
    """One agent: ``await Agent(cfg, executor, facts=...).run()`` returns the process exit code."""

    def __init__(self, cfg: AgentConfig, executor: Any, *, facts: dict[str, Any], gpu_host: Any = None,
                 cpus: list[int] | None = None) -> None:
        self.cfg = cfg
        self.executor = executor
        self.gpu = gpu_host
        self.facts = facts
        self.cpus = set(cpus if cpus is not None else facts.get("cpus", []))
        self.controller_epoch = 0
        self.agent_epoch = 0
        self.heartbeat_s = cfg.heartbeat_s
        self._sock: zmq.asyncio.Socket | None = None
        self._welcomed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running: dict[str, _Running] = {}
        self._outbox = _Outbox(cfg.outbox_mib << 20)
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._last_in = time.monotonic()
        self._last_out = 0.0
        self._orphaned = False
        self.sessions = 0  # Welcomes received (tests and logs)
        self._curve = cfg.curve_keys()  # tangram.certs.CurveKeys or None (plain TCP, loopback only)
        self._handlers: dict[type[p.Message], Handler] = {
            p.CreateSandbox: self._create_sandbox,
            p.DestroySandbox: self._destroy_sandbox,
            p.PutFile: self._put_file,
            p.GetFile: self._get_file,
            p.Cpuset: self._cpuset,
            p.Spawn: self._spawn,
            p.Kill: self._kill,
            p.Prepare: self._prepare,
            p.Load: self._load,
            p.Evict: self._evict,
            p.Invoke: self._invoke,
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
        ctx = zmq.asyncio.Context()
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
            from agent.gpu.base import ServiceSpec

            name = raw["name"]
            try:
                await self.gpu.prepare(name, ServiceSpec.from_dict(name, raw))
            except Exception as exc:  # noqa: BLE001 - a bad service spec is a config error
                raise AgentExit(EXIT_CONFIG, f"service {name!r}: {exc}") from None
            log.info("prepared service %s", name)

    # ------------------------------------------------------------ one connection

    def _socket(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.cfg.name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.SNDTIMEO, int(self.cfg.hello_timeout_s * 1000))  # replies use NOBLOCK anyway
        # Queue only on a live connection: a reply sent while the link is down then fails at once and waits
        # in our outbox for the next Welcome, instead of dying in a pipe when this socket is closed.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        hb_ms = max(100, int(self.cfg.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, hb_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, hb_ms * LIVENESS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, hb_ms * LIVENESS)
        if self._curve is not None:  # CURVE client: own keypair, the controller's public key pinned
            self._curve.apply(sock)
        sock.connect(self.cfg.controller)
        return sock

    async def _session(self, ctx: zmq.asyncio.Context) -> bool:
        """One socket from Hello to loss or stop; True when a Welcome came. Raises AgentExit on Reject."""
        sock = self._socket(ctx)
        self._welcomed = False
        try:
            hello = p.Hello(role="agent", name=self.cfg.name, major=p.PROTOCOL_MAJOR, minor=p.PROTOCOL_MINOR,
                            facts=self.facts, bundle="", sandboxes=await self._sandbox_names(),
                            actions=[{"action": r.action, "attempt": r.attempt, "kind": r.kind}
                                     for r in self._running.values()])
            t_hello = time.monotonic()
            try:  # waits for the TCP connection (IMMEDIATE)
                await asyncio.wait_for(sock.send_multipart(p.encode(hello, 0)), self.cfg.hello_timeout_s)
            except (TimeoutError, zmq.Again):
                log.warning("cannot reach %s within %.1f s", self.cfg.controller, self.cfg.hello_timeout_s)
                return False
            self._last_out = time.monotonic()
            log.info("hello sent to %s as %s", self.cfg.controller, self.cfg.name)
            while True:
                if self._stop.is_set():
                    await self._finish(sock, self._stop_reason, 0, destroy=False, grace=self.cfg.stop_grace_s)
                    return self._welcomed
                tick = min(0.1, self.heartbeat_s / 4)
                if await sock.poll(int(tick * 1000), zmq.POLLIN):
                    frames = await sock.recv_multipart(copy=True)
                    self._last_in = time.monotonic()
                    self._orphaned = False
                    outcome = await self._on_frames(sock, list(frames))
                    if outcome == "lost":
                        return self._welcomed
                    if outcome == "shutdown":
                        return self._welcomed
                now = time.monotonic()
                if not self._welcomed:
                    if now - t_hello > self.cfg.hello_timeout_s:
                        log.warning("no Welcome from %s within %.1f s", self.cfg.controller,
                                    self.cfg.hello_timeout_s)
                        return False
                    continue
                if now - self._last_in > LIVENESS * self.heartbeat_s:
                    log.warning("controller silent for %.1f s: reconnecting", now - self._last_in)
                    return True
                if now - self._last_out >= self.heartbeat_s:
                    self._send_on(sock, p.encode(p.Heartbeat(load=self._load_summary()), 0))
                self._flush_outbox(sock)
        finally:
            self._sock = None
            self._welcomed = False
            sock.close(linger=0)

    async def _on_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> str | None:
        try:
            env = p.decode(frames)
        except ProtocolError as exc:
            rid = peek_request_id(frames)
            log.warning("undecodable message (request %d): %s", rid, exc)
            self._reply(rid, p.Error.from_exception(exc))
            return None
        msg = env.msg
        if isinstance(msg, p.Welcome):
            if not self._welcomed:
                self._on_welcome(sock, msg)
            return None
        if isinstance(msg, p.Reject):
            if self._welcomed or reject_is_retryable(msg.reason):
                log.warning("rejected by the controller: %s (will retry)", msg.reason)
                return "lost"
            raise AgentExit(EXIT_REJECTED, f"rejected by the controller: {msg.reason}")
        if isinstance(msg, (p.Heartbeat, p.Ack)):
            return None
        if isinstance(msg, p.Bye):
            log.info("controller said bye: %s", msg.reason or "(no reason)")
            return "lost"
        if isinstance(msg, p.Shutdown):
            log.info("shutdown requested by the controller: %s", msg.reason or "(no reason)")
            await self._finish(sock, msg.reason or "shutdown", env.request_id, destroy=msg.reason == "down",
                               grace=0.0)
            self.stop(f"shutdown: {msg.reason}")
            return "shutdown"
        handler = self._handlers.get(type(msg))
        if handler is None:
            why = f"{type(msg).__name__} is not a request an agent serves"
            self._reply(env.request_id, error_reply(BadRequest(why)))
            return None
        if len(self._tasks) >= self.cfg.max_inflight:
            why = f"agent busy: {len(self._tasks)} requests in flight"
            self._reply(env.request_id, error_reply(RetryLater(why)))
            return None
        task = asyncio.create_task(self._serve(env, handler), name=f"req-{env.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    def _on_welcome(self, sock: zmq.asyncio.Socket, msg: p.Welcome) -> None:
        if msg.major != p.PROTOCOL_MAJOR:
            raise AgentExit(EXIT_REJECTED,
                            f"controller speaks {msg.major}, agent {p.PROTOCOL_MAJOR}: run tangram up")
        self._welcomed = True
        self._sock = sock
        self.controller_epoch, self.agent_epoch = msg.controller_epoch, msg.agent_epoch
        self.heartbeat_s = msg.heartbeat_s
        self.sessions += 1
        log.info("welcomed by %s (controller epoch %d, agent epoch %d, heartbeat %.2f s)",
                 self.cfg.controller, msg.controller_epoch, msg.agent_epoch, msg.heartbeat_s)
        self._flush_outbox(sock)

    async def _finish(self, sock: zmq.asyncio.Socket, reason: str, rid: int, *, destroy: bool,
                      grace: float) -> None:
        """Answer what runs (after ``grace``), destroy sandboxes if asked, say Bye on ``sock``."""
        self._sock = sock if self._welcomed else None
        await self._cancel_requests(grace)
        if destroy:
            await self._destroy_all()
        self._flush_outbox(sock)
        if self._welcomed or rid:
            self._send_on(sock, p.encode(p.Bye(reason=reason[:1000]), rid))
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

    def _send_on(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> bool:
        try:
            fut = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            exc = fut.exception() if isinstance(fut, asyncio.Future) and fut.done() else None
        except zmq.ZMQError as err:  # a closed socket raises here rather than in the future
            exc = err
        if isinstance(exc, zmq.Again):
            return False
        if exc is not None:
            log.warning("send failed: %s", exc)
            return False
        self._last_out = time.monotonic()
        return True

    def _reply(self, rid: int, msg: p.Message, blobs: list[bytes] | tuple[bytes, ...] = ()) -> None:
        try:
            frames = p.encode(msg, rid, list(blobs))
        except ProtocolError as exc:  # e.g. a result over 64 MiB: say so instead
            log.error("reply to request %d does not encode: %s", rid, exc)
            frames = p.encode(error_reply(InternalError(f"reply does not fit the protocol: {exc}")), rid)
        if self._sock is not None and not self._outbox.items and self._send_on(self._sock, frames):
            return
        self._outbox.push(frames)

    def _flush_outbox(self, sock: zmq.asyncio.Socket) -> None:
        while self._outbox.items:
            if not self._send_on(sock, self._outbox.items[0]):
                return
            self._outbox.pop()

    def _load_summary(self) -> dict[str, Any]:
        return {"running": len(self._running), "requests": len(self._tasks)}

    # ------------------------------------------------------------ requests

    async def _serve(self, env: p.Envelope, handler: Handler) -> None:
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
        from agent.executors.base import SandboxSpec, check_name

        check_name("sandbox", msg.sandbox)
        spec = SandboxSpec(msg.sandbox, msg.image or self.cfg.image, msg.mem_mib, dict(msg.labels))
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
        from agent.executors.base import check_name

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
        from agent.executors.base import RunRequest

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
            res = await self.executor.run(req)
            body = {"exit_code": res.exit_code, "truncated": res.truncated, "timed_out": res.timed_out,
                    "killed": res.killed, "run_s": res.run_s, "setup_s": res.setup_s,
                    "cores": list(res.cores),
                    **self._echo(msg.action, msg.attempt, msg.epoch, msg.agent_epoch)}
            reply: Reply = (p.Result(body), [res.stdout, res.stderr])
            log.info("action %s/%d ended: exit %d%s%s in %.3f s on cores %s", msg.action, msg.attempt,
                     res.exit_code, " (timed out)" if res.timed_out else "",
                     " (killed)" if res.killed else "",
                     res.run_s, list(res.cores))
            run.outcome.set_result(reply)
            return reply
        except BaseException as exc:
            run.outcome.set_exception(exc if isinstance(exc, Exception) else NodeLost("agent stopping"))
            raise
        finally:
            self._running.pop(msg.action, None)

    def _track(self, action: str, attempt: int, kind: str) -> _Running:
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # no "never retrieved" noise
        run = self._running[action] = _Running(action, attempt, kind, fut)
        return run

    def _echo(self, action: str, attempt: int, epoch: int, agent_epoch: int) -> dict[str, Any]:
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

    # ------------------------------------------------------------ GPU services

    def _gpu_host(self) -> Any:
        if self.gpu is None:
            raise BadRequest("this agent has no GPUs "
                             "(start it with --emulated-gpus N, or on a node with NVIDIA GPUs)")
        return self.gpu

    async def _prepare(self, msg: p.Prepare, blobs: tuple[bytes, ...]) -> Reply:
        from agent.gpu.base import ServiceSpec

        host = self._gpu_host()
        try:
            spec = ServiceSpec.from_dict(msg.service, dict(msg.spec))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad spec for service {msg.service!r}: {exc}") from None
        await host.prepare(msg.service, spec)
        log.info("service %s prepared (%s)", msg.service, spec.runtime)
        return p.Result({}), []

    async def _load(self, msg: p.Load, blobs: tuple[bytes, ...]) -> Reply:
        start, end = gpu_chunk(msg.gpus)
        res = await self._gpu_host().load(msg.service, start, end)
        log.info("service %s on GPUs %d-%d: %s in %.3f s", msg.service, start, end - 1,
                 "restored" if res.restored else "already resident", res.seconds)
        return p.Result({"seconds": res.seconds, "bytes": res.bytes, "restored": res.restored}), []

    async def _evict(self, msg: p.Evict, blobs: tuple[bytes, ...]) -> Reply:
        start, end = gpu_chunk(msg.gpus)
        await self._gpu_host().evict(msg.service, start, end)
        log.info("service %s evicted from GPUs %d-%d", msg.service, start, end - 1)
        return p.Result({}), []

    async def _invoke(self, msg: p.Invoke, blobs: tuple[bytes, ...]) -> Reply:
        host = self._gpu_host()
        start, end = gpu_chunk(msg.gpus)
        same = self._running.get(msg.action)
        if same is not None:
            if same.kind == "invoke" and same.attempt == msg.attempt:
                return await asyncio.shield(same.outcome)
            raise BadRequest(f"action {msg.action!r} attempt {same.attempt} is already running here")
        self._check_epochs(msg.epoch, msg.agent_epoch)
        try:
            payload = msgpack.unpackb(blobs[0], raw=False, strict_map_key=False, **PAYLOAD_LIMITS)
        except Exception as exc:  # noqa: BLE001 - msgpack raises many types
            raise BadRequest(f"INVOKE payload is not msgpack ({type(exc).__name__})") from None
        if not isinstance(payload, dict):
            raise BadRequest(f"INVOKE payload must be a msgpack map, got {type(payload).__name__}")
        timeout = msg.timeout_s if msg.timeout_s > 0 else MAX_TIMEOUT_S
        run = self._track(msg.action, msg.attempt, "invoke")
        t0 = time.monotonic()
        try:
            run.inner = asyncio.create_task(host.invoke(msg.service, start, end, payload, timeout))
            try:
                value = await run.inner
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if run.killed and not (current is not None and current.cancelling()):
                    raise Cancelled(f"action {msg.action!r} was killed") from None
                raise
            try:
                blob = msgpack.packb(value, use_bin_type=True)
            except Exception as exc:  # noqa: BLE001
                raise RemoteError(
                    f"service {msg.service!r} returned a value msgpack cannot encode: {exc}") from None
            run_s = time.monotonic() - t0
            body = {"run_s": run_s, "gpus": list(msg.gpus), "service": msg.service,
                    **self._echo(msg.action, msg.attempt, msg.epoch, msg.agent_epoch)}
            reply: Reply = (p.Result(body), [blob])
            run.outcome.set_result(reply)
            return reply
        except BaseException as exc:
            if run.inner is not None and not run.inner.done():
                run.inner.cancel()
            run.outcome.set_exception(exc if isinstance(exc, Exception) else NodeLost("agent stopping"))
            raise
        finally:
            self._running.pop(msg.action, None)


# ---------------------------------------------------------------- building an agent


def setup_logging(cfg: AgentConfig) -> None:
    handler: logging.Handler
    if cfg.log_file:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.log_file)), exist_ok=True)
        handler = logging.FileHandler(cfg.log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s.%(msecs)03d %(levelname)s agent[{cfg.name}] %(message)s", "%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger("agent")
    root.handlers[:] = [handler]
    root.setLevel(cfg.log_level.upper())
    root.propagate = False


def write_pidfile(path: str) -> None:
    """``agent.pid`` in the workdir; refuses when another live agent holds it."""
    try:
        with open(path, encoding="ascii") as f:
            other = int(f.read().strip() or 0)
    except (OSError, ValueError):
        other = 0
    if other and other != os.getpid() and _alive(other):
        raise ConfigError(f"another agent (pid {other}) runs with this workdir ({path})",
                          hint="stop it first, or give this agent its own --workdir")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def remove_pidfile(path: str) -> None:
    try:
        with open(path, encoding="ascii") as f:
            mine = int(f.read().strip() or 0) == os.getpid()
    except (OSError, ValueError):
        return
    if mine:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build_facts(cfg: AgentConfig, machine: Any, cpus: list[int], idle: list[int], executor_kind: str,
                gpus: list[Any]) -> dict[str, Any]:
    """The Hello facts of the contract (docs/agent.md)."""
    numa = [[c for c in node if c in set(cpus)] for node in machine.numa]
    numa = [n for n in numa if n] or [list(cpus)]
    return {
        "cpus": list(cpus), "idle_cpus": list(idle), "numa": numa,
        "mem_mib": cfg.mem_mib if cfg.mem_mib is not None else machine.mem_offer_mib,
        "gpus": len(gpus), "gpu_mem_mib": min((g.memory_total_mib for g in gpus), default=0),
        "gpu_uuids": [g.uuid for g in gpus], "executor": executor_kind, "docker": bool(machine.docker),
        "cgroup": machine.cgroup, "hostname": machine.hostname[:256], "pid": os.getpid(),
        "version": tangram.__version__, "python": machine.python, "cluster": cfg.cluster,
        "services": [s["name"] for s in cfg.services],
    }


def build_executor(cfg: AgentConfig, docker_ok: bool, idle: list[int]) -> tuple[Any, str]:
    from agent.executors.base import format_cpuset

    kind = cfg.executor
    if kind == "auto":
        kind = "docker" if docker_ok else "process"
    if kind == "docker":
        if not docker_ok:
            raise ConfigError("executor docker: no dockerd answers",
                              hint="start dockerd (or set DOCKER_HOST), or use --executor process")
        import docker

        from agent.executors.docker import DockerExecutor
        from agent.executors.images import HOSTROOT_IMAGE, ensure_hostroot_image

        client = docker.from_env(timeout=60)
        if cfg.image == HOSTROOT_IMAGE:
            ensure_hostroot_image(client)
        return DockerExecutor(client, cfg.cluster, format_cpuset(idle), cfg.image, mode=cfg.docker_mode), kind
    from agent.executors.process import ProcessExecutor

    return ProcessExecutor(os.path.join(cfg.workdir, "sandboxes"), format_cpuset(idle)), kind


def build_gpu_host(cfg: AgentConfig, machine: Any) -> tuple[Any, list[Any]]:
    """(GpuHost or None, GpuInfo list): emulated devices when asked, else NVML's, else none."""
    try:
        from agent.gpu.base import GpuInfo, emulated_gpus
        from agent.gpu.emulated import EmulatedConfig
        from agent.gpu.host import GpuHost
    except ImportError as exc:
        log.warning("GPU host unavailable (%s): no GPU services", exc)
        return None, []
    runtimes: dict[str, Any] = {"emulated": EmulatedConfig(bandwidth_gbps=cfg.restore_bandwidth_gbps)}
    if cfg.emulated_gpus:
        gpus = emulated_gpus(cfg.emulated_gpus, cfg.gpu_mem_mib, node=cfg.name)
        return GpuHost(gpus, runtimes), gpus
    if not machine.gpus:
        return None, []
    from agent.gpu.nvml import device_memory
    from agent.gpu.runtimes import default_runtimes

    gpus = [GpuInfo(index=g["index"], uuid=g["uuid"], name=g["name"], memory_total_mib=g["memory_total_mib"],
                    memory_used_mib=g.get("memory_used_mib", 0), cpus=tuple(g.get("cpus", ())),
                    pci_bus_id=g.get("pci_bus_id", "")) for g in machine.gpus]
    # real devices: every runtime (emulated, vllm, sglang; torch when installed), and 1 GiB per GPU
    # kept back for the CUDA context and allocator slack, as agent.gpu.runtimes.build_host does
    runtimes = default_runtimes(EmulatedConfig(bandwidth_gbps=cfg.restore_bandwidth_gbps))
    return GpuHost(gpus, runtimes, reserve_mib=1024, device_memory=device_memory), gpus


async def run_agent(cfg: AgentConfig) -> int:
    """Probe, build the executor and GPU host, write the pidfile, run until stopped."""
    from agent.probe import probe

    machine = await asyncio.to_thread(probe, cfg.executor != "process", cfg.emulated_gpus == 0)
    cpus, idle = cfg.resolve_cpus(machine.online)
    executor, kind = await asyncio.to_thread(build_executor, cfg, machine.docker, idle)
    gpu_host, gpus = build_gpu_host(cfg, machine)
    facts = build_facts(cfg, machine, cpus, idle, kind, gpus)
    log.info("agent %s: executor %s, cpus %s, idle %s, %d MiB, %d GPUs, controller %s", cfg.name, kind, cpus,
             idle, facts["mem_mib"], len(gpus), cfg.controller)
    agent = Agent(cfg, executor, facts=facts, gpu_host=gpu_host, cpus=cpus)
    pidfile = cfg.pidfile()
    write_pidfile(pidfile)
    try:
        code = await agent.run()
    finally:
        await agent.close()
        remove_pidfile(pidfile)
    return code


def main(cfg: AgentConfig) -> int:
    """Process entry for ``python -m agent`` and ``tangram agent``: returns the exit code."""
    os.makedirs(cfg.workdir, exist_ok=True)
    setup_logging(cfg)
    try:
        return asyncio.run(run_agent(cfg))
    except ConfigError as exc:
        log.error("%s%s", exc.message, f" (to fix: {exc.hint})" if exc.hint else "")
        return EXIT_CONFIG
    except AgentExit as exc:
        log.error("%s", exc)
        return exc.code
