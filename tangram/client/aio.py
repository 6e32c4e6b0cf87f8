"""`tangram.AsyncClient`: the asyncio client rollout code uses.

    async with tangram.AsyncClient("tcp://127.0.0.1:7701", name="worker-3") as tg:
        async with tg.sandbox(image="", mem="2GiB") as env:
            await env.put("solve.py", b"print(42)")
            r = await env.exec("python3 solve.py", cpus=1, timeout=60)
            r = await env.exec("python3 -m pytest -n {dop}", cpus=(1, 8), elastic="pytest")
        score = await tg.call("reward", {"text": r.stdout}, gpus=1, timeout=30)
        async with tg.api("search", timeout=30):
            ...                                 # your own HTTP call, inside the quota

Rules:

1. Every method takes `timeout=` (seconds); None means the client's `default_timeout`, and
   if that is None too, the controller's maximum. For `exec` and `call` it bounds the run once
   the action has started, not the wait in the queue: the node kills the command at `timeout`
   (`ActionTimeout`, with the output so far). `total_timeout=` (optional) bounds the whole
   request, queueing included; without it an action waits in the queue as long as the
   controller allows (`max_timeout_s`). For `api` and a `sandbox(reserve=k)` open, `timeout`
   is the wait for the grant. The client waits a few seconds longer than the whole request's
   budget for the controller's answer before giving up on its own.
2. Cancelling the task that awaits a request sends `Cancel`; the action is killed or dropped
   from the queue on the controller.
3. Errors are `tangram.errors` classes mapped from wire codes, each with `.retryable`.
   `RetryLater` (the controller's submission caps; the request was neither run nor recorded) is
   retried here with jittered exponential backoff (50 ms doubling to 2 s) until the timeout
   (or `retry_later_s` without one) for idempotent requests and for every request that starts
   new work (exec, call, lease, sandbox open); otherwise it is raised. `NodeLost` (the node,
   or a restarted controller, lost a running action) is retried once for idempotent requests.
4. Leaving a `sandbox()` or `api()` context closes it, idempotently, even on errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import re
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack  # type: ignore[import-untyped]

from tangram import protocol, units
from tangram.certs import CurveKeys, client_keys
from tangram.client.transport import Pending, Transport
from tangram.discovery import find_address, state_file
from tangram.errors import (
    ActionTimeout,
    BadRequest,
    ClusterNotFound,
    ControllerUnreachable,
    InternalError,
    MessageTooLarge,
    NodeLost,
    NonZeroExit,
    ProtocolError,
    ProtocolErrorKind,
    RetryLater,
)
from tangram.outcomes import CallOutcome, ExecOutcome
from tangram.wire_checks import ID_PATTERN

__all__ = [
    "ApiLease",
    "AsyncClient",
    "AsyncSandbox",
    "CallResult",
    "ExecResult",
    "parse_mem",
    "shell_command",
]

T = TypeVar("T")
OutcomeT = TypeVar("OutcomeT", ExecOutcome, CallOutcome)
GRACE_S = 5.0  # how much longer than the budget the client waits for the controller's answer
RETRY_BASE_S = 0.05  # RetryLater backoff: the first delay, doubled per try up to RETRY_MAX_S, jittered
RETRY_MAX_S = 2.0
_timeout = getattr(asyncio, "timeout", None)  # 3.11+

# Requests that start new work: after a RetryLater refusal they are sent again under a new
# request id (the refusal is cached under the old one), so nothing runs twice.
_NEW_WORK = (protocol.Exec, protocol.Call, protocol.Lease, protocol.SandboxOpen)
# Requests the controller counts against its per-client cap (gateway `_CAPPED`).
_CAPPED = (*_NEW_WORK, protocol.Put, protocol.Get)

MAX_MEM_MIB = 1 << 26  # 64 TiB: more than any one machine has; larger is a unit mistake (bytes as MiB?)


def parse_mem(mem: int | str | None) -> int:
    """MiB of a sandbox's `mem`: None (the agent's default) -> 0, an int (MiB), or a size such as
    "4GiB" or "2GB" (`tangram.units` rules, at most 64 TiB). Raises `UnitError` (a BadRequest)."""
    if mem is None:
        return 0
    return units.parse_size_mib(mem, "mem", max_mib=MAX_MEM_MIB)


def shell_command(cmd: str | Sequence[str]) -> str:
    """`exec`'s command: a string runs as it is (through `sh -c`); a list of arguments is quoted
    with `shlex.join`, so each one reaches the program unchanged."""
    if isinstance(cmd, str):
        return cmd
    if isinstance(cmd, (bytes, bytearray)) or not isinstance(cmd, Sequence):
        raise BadRequest(f"cmd must be a string or a list of strings, got {type(cmd).__name__}")
    args = list(cmd)
    if not args or not all(isinstance(a, str) for a in args):
        raise BadRequest(f"cmd as a list must hold at least one string and only strings, got {args!r}")
    return shlex.join(args)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    queued_s: float
    run_s: float
    overhead_s: float
    node: str
    cores: tuple[int, ...]
    dop: int = 0
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class CallResult:
    value: Any
    queued_s: float
    run_s: float
    overhead_s: float
    node: str
    gpus: tuple[int, ...]
    loaded: bool


def _outcome(kind: type[OutcomeT], env: protocol.Envelope) -> OutcomeT:
    """The typed outcome in a final Result (tangram/outcomes.py); a malformed one is an InternalError."""
    try:
        return kind.from_body(env.msg.body)  # type: ignore[attr-defined, no-any-return]
    except ProtocolError as exc:
        raise InternalError(f"the controller's result does not parse: {exc}") from None


def _budget_ms(timeout: float | None, what: str = "timeout") -> int:
    if timeout is None:
        return 0
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise BadRequest(f"{what} must be a positive number of seconds, got {timeout!r}")
    return max(1, int(timeout * 1000))


def _cpu_range(cpus: int | tuple[int, int]) -> tuple[int, int]:
    """`exec`'s `cpus`: an int or a (min, max) pair -> (min, max)."""
    if isinstance(cpus, (tuple, list)):
        if len(cpus) != 2:
            raise BadRequest("cpus must be an int or a (min, max) pair")
        lo, hi = int(cpus[0]), int(cpus[1])
    elif isinstance(cpus, int) and not isinstance(cpus, bool):
        lo = hi = cpus
    else:
        raise BadRequest(f"cpus must be an int or a (min, max) pair, got {cpus!r}")
    if lo < 1 or hi < lo:
        raise BadRequest(f"cpus must satisfy 1 <= min <= max, got ({lo}, {hi})")
    return lo, hi


def _exec_result(envl: protocol.Envelope) -> ExecResult:
    res = _outcome(ExecOutcome, envl)
    out = envl.blobs[0] if len(envl.blobs) > 0 else b""
    err = envl.blobs[1] if len(envl.blobs) > 1 else b""
    return ExecResult(
        exit_code=res.exit_code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        truncated=res.truncated,
        queued_s=res.queued_s,
        run_s=res.run_s,
        overhead_s=res.overhead_s,
        node=res.node,
        cores=res.cores,
        dop=res.dop,
        stdout_bytes=out,
        stderr_bytes=err,
    )


class AsyncClient:
    def __init__(
        self,
        addr: str | None = None,
        *,
        name: str | None = None,
        default_timeout: float | None = None,
        heartbeat_s: float = 1.0,
        connect_timeout: float = 10.0,
        certs: str | CurveKeys | None = None,
        retry_later_s: float = 60.0,
        job: str | None = None,
    ) -> None:
        addr = addr or os.environ.get("TANGRAM_ADDR")
        if not addr:
            addr = _local_addr()
        self.addr = addr
        self.name = _clean_name(name or f"client-{os.getpid()}")
        # its RL job (docs/client.md, "Jobs"): `job`, else $TANGRAM_JOB, else the default job ("")
        self.job = _job_name(os.environ.get("TANGRAM_JOB", "") if job is None else job)
        self.default_timeout = default_timeout
        self.retry_later_s = retry_later_s  # how long RetryLater is retried for a request without a timeout
        self.retried_later = 0  # RetryLater refusals retried (all requests together)
        self.retried_lost = 0  # idempotent requests run again after NODE_LOST
        # CURVE keys: `certs`, else $TANGRAM_CERTS, else the recorded cluster of `addr`, else plain TCP.
        curve = client_keys(addr, certs)
        self._transport = Transport(
            addr, self.name, heartbeat_s=heartbeat_s, connect_timeout=connect_timeout, curve=curve,
            job=self.job,
        )
        self._connected = False
        self._window: asyncio.Semaphore | None = None

    @classmethod
    def from_env(cls, **kwargs: Any) -> AsyncClient:
        return cls(None, **kwargs)

    async def connect(self) -> AsyncClient:
        if not self._connected:
            await self._transport.start()
            self._connected = True
        return self

    async def close(self) -> None:
        await self._transport.close()
        self._connected = False

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def controller_epoch(self) -> int | None:
        return self._transport.epoch

    # ------------------------------------------------------------ plumbing
    def _timeout(self, timeout: float | None) -> float | None:
        return self.default_timeout if timeout is None else timeout

    async def _roundtrip(
        self,
        msg: protocol.Message,
        blobs: list[bytes] | tuple[bytes, ...] = (),
        *,
        timeout: float | None = None,
        idempotent: bool = False,
        cancellable: bool = True,
    ) -> protocol.Envelope:
        if not self._connected:
            raise ControllerUnreachable("the client is not connected: use `async with AsyncClient(...)`")
        if isinstance(msg, _CAPPED):
            async with self._slot():
                return await self._retrying(msg, blobs, timeout, idempotent, cancellable)
        return await self._retrying(msg, blobs, timeout, idempotent, cancellable)

    def _slot(self) -> asyncio.Semaphore | contextlib.nullcontext[None]:
        """Flow control: at most the controller's per-client cap (its Welcome says it) of requests
        that start work are unanswered at once; the rest wait here, in the client, instead of
        being refused with RetryLater."""
        cap = self._transport.max_outstanding
        if cap <= 0:
            return contextlib.nullcontext()
        if self._window is None:
            self._window = asyncio.Semaphore(cap)
        return self._window

    async def _retrying(
        self,
        msg: protocol.Message,
        blobs: list[bytes] | tuple[bytes, ...],
        timeout: float | None,
        idempotent: bool,
        cancellable: bool,
    ) -> protocol.Envelope:
        retry = idempotent or isinstance(msg, _NEW_WORK)
        start = time.monotonic()
        window = timeout if timeout is not None else self.retry_later_s
        tries = 0
        lost_once = False
        while True:
            left = None if timeout is None else max(0.001, timeout - (time.monotonic() - start))
            try:
                return await self._once(msg, blobs, left, idempotent, cancellable)
            except NodeLost:
                # the node or the controller that ran it went away; an idempotent request is safe
                # to run again, once (docs/recovery.md)
                if not idempotent or lost_once:
                    raise
                lost_once = True
                self.retried_lost += 1
                continue
            except RetryLater:
                cap = min(RETRY_MAX_S, RETRY_BASE_S * (2**tries))
                delay = cap / 2 + random.uniform(0, cap / 2)
                tries += 1
                if not retry or time.monotonic() - start + delay >= window:
                    raise
            self.retried_later += 1
            await asyncio.sleep(delay)
            # the whole request's budget shrinks by the time spent refused (an exec's or call's run
            # budget does not: it starts when the action does)
            name = "total_budget_ms" if isinstance(msg, (protocol.Exec, protocol.Call)) else "budget_ms"
            budget = getattr(msg, name, 0)
            if timeout is not None and budget:
                left_ms = max(1, int((timeout - (time.monotonic() - start)) * 1000))
                msg = dataclasses.replace(msg, **{name: min(budget, left_ms)})  # type: ignore[type-var]

    async def _once(
        self,
        msg: protocol.Message,
        blobs: list[bytes] | tuple[bytes, ...],
        timeout: float | None,
        idempotent: bool,
        cancellable: bool,
    ) -> protocol.Envelope:
        try:
            pending = self._transport.request(msg, blobs, idempotent=idempotent)
        except ProtocolError as exc:  # never sent: the controller would refuse it (or libzmq drop it)
            if exc.kind is ProtocolErrorKind.TOO_LARGE:
                raise MessageTooLarge(str(exc), hint=exc.hint) from None
            raise BadRequest(str(exc)) from None
        wait = None if timeout is None else timeout + GRACE_S
        # (no shield: `pending.final` is this request's alone; the transport checks `done()` first)
        try:
            if wait is None:
                return await pending.final
            if _timeout is not None:  # 3.11+: one timer handle, no extra task
                async with _timeout(wait):
                    return await pending.final
            return await asyncio.wait_for(pending.final, wait)
        except ActionTimeout:  # the controller's answer (a TimeoutError too): keep its message and output
            raise
        except (TimeoutError, asyncio.TimeoutError):  # noqa: UP041 - distinct classes on 3.10
            self._cancel(pending)
            raise ActionTimeout(f"no answer within {timeout:g}s (+{GRACE_S:g}s grace)") from None
        except asyncio.CancelledError:
            if cancellable:
                self._cancel(pending)
            raise

    def _cancel(self, pending: Pending) -> None:
        self._transport.forget(pending.request_id)
        if not pending.final.done():
            pending.final.cancel()
        self._transport.send_raw(protocol.Cancel(pending.request_id), self._transport._next_rid())

    # ------------------------------------------------------------ API
    def sandbox(
        self,
        image: str = "",
        mem: int | str | None = None,
        reserve: int = 0,
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> _SandboxContext:
        """An async context manager opening one sandbox (one per trajectory)."""
        return _SandboxContext(self, image, parse_mem(mem), reserve, timeout, dict(labels or {}))

    async def open_sandbox(
        self,
        image: str = "",
        mem: int | str | None = None,
        reserve: int = 0,
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> AsyncSandbox:
        msg = protocol.SandboxOpen(image, parse_mem(mem), reserve, float(timeout or 0.0), dict(labels or {}))
        env = await self._roundtrip(msg, timeout=self._timeout(timeout) if reserve else None, idempotent=True)
        return AsyncSandbox(self, str(env.msg.body["sandbox"]))  # type: ignore[attr-defined]

    async def call(
        self,
        service: str,
        payload: Any,
        gpus: int | list[int] | tuple[int, ...] = 1,
        timeout: float | None = None,
        idempotent: bool = True,
        elastic: str | None = None,
        total_timeout: float | None = None,
    ) -> CallResult:
        """Call GPU service `service` with a msgpack-able payload. ``gpus`` is a chunk size or a
        list of sizes the scheduler may choose from (each size is its own service instance);
        ``elastic`` names the controller profile that says how the call scales with GPUs.
        ``timeout`` bounds the call once it runs, ``total_timeout`` the whole request (rule 1)."""
        options: list[int] = []
        if isinstance(gpus, (list, tuple)):
            if not gpus:
                raise BadRequest("gpus must name at least one size")
            options = sorted({int(g) for g in gpus})
            gpus = options[0]
        timeout = self._timeout(timeout)
        total = _budget_ms(total_timeout, "total_timeout")
        try:
            blob = msgpack.packb(payload, use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"payload is not msgpack-serialisable: {exc}") from None
        sizes = options if len(options) > 1 else []
        msg = protocol.Call(service, int(gpus), _budget_ms(timeout), sizes, elastic, total)
        env = await self._roundtrip(msg, [blob], timeout=total_timeout, idempotent=idempotent)
        res = _outcome(CallOutcome, env)
        value = msgpack.unpackb(env.blobs[0], raw=False) if env.blobs else None
        return CallResult(value, res.queued_s, res.run_s, res.overhead_s, res.node, res.gpus, res.loaded)

    def api(self, name: str, timeout: float | None = None, units: int = 1, tokens: int = 0) -> ApiLease:
        """An async context manager holding `units` of API `name`'s quota while inside it.
        For an API with a key pool, `tokens` is what the call will be charged against a key's
        tokens per minute (prompt + maximum output), and the lease's `key` is the key to call with."""
        return ApiLease(self, name, self._timeout(timeout), units, tokens)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> asyncio.Task[T]:
        """Start `fn(*args, **kwargs)` (e.g. `env.exec`, `client.call`) as a task, for fan-out."""
        return asyncio.ensure_future(fn(*args, **kwargs))


class _SandboxContext:
    def __init__(
        self,
        client: AsyncClient,
        image: str,
        mem: int,
        reserve: int,
        timeout: float | None,
        labels: dict[str, str],
    ) -> None:
        self._args = (client, image, mem, reserve, timeout, labels)
        self._sandbox: AsyncSandbox | None = None

    async def __aenter__(self) -> AsyncSandbox:
        client, image, mem, reserve, timeout, labels = self._args
        self._sandbox = await client.open_sandbox(image, mem, reserve, timeout, labels)
        return self._sandbox

    async def __aexit__(self, *exc: object) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()

    def __await__(self) -> Any:
        client, image, mem, reserve, timeout, labels = self._args
        return client.open_sandbox(image, mem, reserve, timeout, labels).__await__()


class AsyncSandbox:
    def __init__(self, client: AsyncClient, sandbox: str) -> None:
        self.client = client
        self.id = sandbox
        self.closed = False

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    async def exec(
        self,
        cmd: str | Sequence[str],
        cpus: int | tuple[int, int] = 1,
        elastic: str | Mapping[int, float] | None = None,
        duration_hint: float | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = False,
        stdin: bytes | None = None,
        idempotent: bool = False,
        total_timeout: float | None = None,
    ) -> ExecResult:
        """Run `cmd` (a string through `sh -c`, or a list of arguments, quoted with `shlex.join`)
        on `cpus` cores; `{dop}` becomes the granted core count. `timeout` bounds the run once it
        has started, `total_timeout` the whole request, queueing included (module rule 1)."""
        command = shell_command(cmd)
        lo, hi = _cpu_range(cpus)
        profile, table = None, None
        if isinstance(elastic, str):
            profile = elastic
        elif elastic is not None:
            table = {str(int(k)): float(v) for k, v in dict(elastic).items()}
        run_ms = _budget_ms(self.client._timeout(timeout))
        total_ms = _budget_ms(total_timeout, "total_timeout")
        hint = float(duration_hint or 0.0)
        msg = protocol.Exec(
            self.id, command, lo, hi, profile, table, hint, dict(env or {}), run_ms, idempotent, total_ms
        )
        envl = await self.client._roundtrip(
            msg, [stdin] if stdin is not None else [], timeout=total_timeout, idempotent=idempotent
        )
        result = _exec_result(envl)
        if check and result.exit_code != 0:
            raise NonZeroExit(f"command exited {result.exit_code}: {command[:80]}", result=result)
        return result

    def submit(self, cmd: str | Sequence[str], **kwargs: Any) -> asyncio.Task[ExecResult]:
        """`exec` as a task, for fan-out."""
        return asyncio.ensure_future(self.exec(cmd, **kwargs))

    async def put(self, path: str, data: bytes | str, timeout: float | None = None) -> None:
        blob = data.encode() if isinstance(data, str) else bytes(data)
        await self.client._roundtrip(
            protocol.Put(self.id, path), [blob], timeout=self.client._timeout(timeout), idempotent=True
        )

    async def get(self, path: str, timeout: float | None = None) -> bytes:
        env = await self.client._roundtrip(
            protocol.Get(self.id, path), timeout=self.client._timeout(timeout), idempotent=True
        )
        return env.blobs[0] if env.blobs else b""

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.client._roundtrip(protocol.SandboxClose(self.id), idempotent=True, cancellable=False)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ApiLease:
    """`async with client.api("search"):` holds one slot of the API's quota. With a key pool it
    carries a key with room: `key` (the secret to call with) and `key_name`; `report(...)` goes
    with the release (a 429 cools that key down for `reset_s`)."""

    def __init__(
        self, client: AsyncClient, api: str, timeout: float | None, units: int, tokens: int = 0
    ) -> None:
        self.client, self.api, self.timeout, self.units, self.tokens = client, api, timeout, units, tokens
        self.lease: str | None = None
        self.queued_s = self.expires_in_s = 0.0
        self.key = self.key_name = ""
        self._report = (0, False, 0)

    async def acquire(self) -> ApiLease:
        msg = protocol.Lease(self.api, self.units, _budget_ms(self.timeout), max(0, int(self.tokens)))
        body = (await self.client._roundtrip(msg, timeout=self.timeout)).msg.body  # type: ignore[attr-defined]
        self.lease = str(body["lease"])
        self.queued_s = float(body.get("queued_s", 0.0))
        self.expires_in_s = float(body.get("expires_in_s", 0.0))
        self.key, self.key_name = str(body.get("key", "")), str(body.get("key_name", ""))
        return self

    def report(self, tokens: int | None = None, rate_limited: bool = False, reset_s: float = 0.0) -> None:
        """The `tokens` the provider counted, or its HTTP 429 with its reset time `reset_s`."""
        used, limited, reset_ms = self._report
        used = max(0, int(tokens)) if tokens is not None else used
        self._report = (used, rate_limited or limited, max(reset_ms, int(max(0.0, reset_s) * 1000)))

    async def release(self) -> None:
        if self.lease is None:
            return
        lease, self.lease, self.key = self.lease, None, ""
        msg = protocol.Release(lease, *self._report)
        await self.client._roundtrip(msg, idempotent=True, cancellable=False)

    async def __aenter__(self) -> ApiLease:
        return await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


def _clean_name(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.:-]", "-", name).lstrip(".-")[:64] or "client"
    return cleaned.replace("..", "-")


def _job_name(job: str) -> str:
    if job and not re.fullmatch(ID_PATTERN, job):
        raise BadRequest(
            f"bad job name {job!r}: use 1-64 of A-Z a-z 0-9 _ . : - (starting with a letter, digit or _)"
        )
    return job


def _local_addr() -> str:
    """The local cluster's submit address, from the state file `tangram up` writes."""
    addr = find_address("local")
    if addr is None:
        raise ClusterNotFound(
            f"no controller address: {state_file('local')} names no running cluster",
            hint="pass an address, set TANGRAM_ADDR, or start a local cluster with `tangram up`",
        )
    return addr
