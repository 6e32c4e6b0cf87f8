"""The per-node GPU service host: services, their host backups, and what is resident on which GPUs.

The agent's link calls this API (stable):

* ``await prepare(service, spec)``: build the host-memory backup once (idempotent; another spec under the
  same name raises :class:`SpecMismatch`).
* ``await load(service, start, end) -> LoadResult``: restore onto GPUs ``[start, end)`` (node-local positions
  in the ``gpus`` list) from the host copy; ``restored=False`` when it was already resident there.
* ``await evict(service, start, end)``: drop every placement of the service lying inside ``[start, end)``;
  no write-back; idempotent.
* ``await invoke(service, start, end, payload, timeout_s) -> dict``: one call; loads first when needed.
* ``facts() -> dict``: devices, budgets, accounted memory, resident services, busy and health flags.

Rules:

1. Every load/evict/invoke takes a ticket on each GPU of its chunk, all at once at arrival; it runs when it
   is first in line on all of them. So one action per GPU at a time, and requests on overlapping chunks run
   in arrival order (no deadlock: tickets are queued atomically).
2. A placement in use (refcount > 0) is never evicted; a call that passes ``timeout_s`` answers
   :class:`CallTimeout` at once, but its placement and GPUs stay held until the work really ends.
3. Accounted memory per GPU (``spec.gpu_mem_mib`` for each resident service) never exceeds the budget
   (total - ``reserve_mib``); a load that would exceed it raises :class:`GpuOutOfMemory` and changes nothing.
   Choosing what to evict is the controller's job (LRU); ``facts()`` reports ``last_used`` to help.
4. Load failures raise :class:`LoadFailed` (accounting rolled back, partial state dropped); exceptions from
   the service function raise :class:`ServiceError` with the traceback text in ``detail``.
5. ``unhealthy_after`` device failures in a row (failed loads, errors mentioning "CUDA error") mark a GPU
   unhealthy; loads onto it then raise :class:`GpuUnhealthy`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import (
    BadChunk,
    CallTimeout,
    Chunk,
    EvictFailed,
    GpuError,
    GpuInfo,
    GpuOutOfMemory,
    GpuUnhealthy,
    HostClosed,
    LoadFailed,
    LoadResult,
    PrepareFailed,
    Runtime,
    RuntimeFactory,
    ServiceError,
    ServiceSpec,
    SpecMismatch,
    UnknownService,
    format_exc,
)

DEFAULT_LOAD_TIMEOUT_S = 600.0


def chunk_of(gpus: Sequence[int]) -> Chunk:
    """A protocol GPU list (contiguous, ascending) -> ``(start, end)``; :class:`BadChunk` otherwise."""
    idx = list(gpus)
    if not idx or idx != list(range(idx[0], idx[0] + len(idx))):
        raise BadChunk(f"GPUs must be a non-empty contiguous ascending range, got {idx}")
    return idx[0], idx[-1] + 1


class _Ticket:
    __slots__ = ("gpus", "ready")

    def __init__(self, gpus: range, ready: asyncio.Future[None]) -> None:
        self.gpus, self.ready = gpus, ready


class _GpuQueues:
    """Per-GPU FIFO queues of tickets; a ticket may run when it heads the queue of each of its GPUs."""

    def __init__(self, count: int) -> None:
        self._q: list[deque[_Ticket]] = [deque() for _ in range(count)]

    def enter(self, chunk: Chunk) -> _Ticket:
        ticket = _Ticket(range(*chunk), asyncio.get_running_loop().create_future())
        for g in ticket.gpus:
            self._q[g].append(ticket)
        self._wake(ticket.gpus)
        return ticket

    def leave(self, ticket: _Ticket) -> None:
        for g in ticket.gpus:
            with contextlib.suppress(ValueError):
                self._q[g].remove(ticket)
        if not ticket.ready.done():
            ticket.ready.cancel()
        self._wake(ticket.gpus)

    def busy(self, gpu: int) -> bool:
        return bool(self._q[gpu]) and self._q[gpu][0].ready.done()

    def waiting(self, gpu: int) -> int:
        return max(0, len(self._q[gpu]) - 1) if self.busy(gpu) else len(self._q[gpu])

    def _wake(self, gpus: range) -> None:
        for g in gpus:
            if self._q[g]:
                head = self._q[g][0]
                if not head.ready.done() and all(self._q[h][0] is head for h in head.gpus):
                    head.ready.set_result(None)


@dataclass(eq=False)
class _Placement:
    chunk: Chunk
    gpus: tuple[GpuInfo, ...]
    load: LoadResult
    refs: int = 0
    last_used: float = field(default_factory=time.monotonic)
    calls: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def ref(self) -> None:
        self.refs += 1
        self.idle.clear()

    def unref(self) -> None:
        self.refs -= 1
        self.last_used = time.monotonic()
        if self.refs == 0:
            self.idle.set()


@dataclass(eq=False)
class _Service:
    spec: ServiceSpec
    runtime: Runtime
    host_bytes: int
    placements: dict[Chunk, _Placement] = field(default_factory=dict)


class GpuHost:
    """Hosts GPU services on one node's devices (real via NVML, or emulated); see the module rules."""

    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        runtimes: Mapping[str, RuntimeFactory],
        *,
        reserve_mib: int = 0,
        unhealthy_after: int = 3,
        load_timeout_s: float | None = DEFAULT_LOAD_TIMEOUT_S,
        device_memory: Callable[[GpuInfo], int | None] | None = None,
    ) -> None:
        self.gpus = tuple(gpus)
        self.runtimes = dict(runtimes)
        self.budget_mib = [max(0, g.memory_total_mib - reserve_mib) for g in self.gpus]
        self.used_mib = [0] * len(self.gpus)
        self.unhealthy_after = unhealthy_after
        self.load_timeout_s = load_timeout_s
        self._device_memory = device_memory
        self._failures = [0] * len(self.gpus)
        self._services: dict[str, _Service] = {}
        self._prepare_locks: dict[str, asyncio.Lock] = {}
        self._queues = _GpuQueues(len(self.gpus))
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ------------------------------------------------------------------ API

    async def prepare(self, service: str, spec: ServiceSpec) -> None:
        if self._closed:
            raise HostClosed("the GPU host is shutting down")
        if spec.name != service:
            raise SpecMismatch(f"spec is named {spec.name!r}, not {service!r}")
        lock = self._prepare_locks.setdefault(service, asyncio.Lock())
        async with lock:
            known = self._services.get(service)
            if known is not None:
                if known.spec != spec:
                    raise SpecMismatch(f"service {service!r} is already prepared with another spec")
                return
            factory = self.runtimes.get(spec.runtime)
            if factory is None:
                raise PrepareFailed(
                    f"runtime {spec.runtime!r} is not available on this node (have {sorted(self.runtimes)})",
                    hint="install the runtime's extra (torch: pip install 'tangram-rl[gpu]') or pick another",
                )
            runtime = await self._build(factory, spec)
            self._services[service] = _Service(spec, runtime, await self._backup(runtime, spec))

    async def load(self, service: str, start: int, end: int) -> LoadResult:
        svc, chunk = self._service(service), self._chunk(start, end)
        ticket = self._queues.enter(chunk)
        try:
            await self._ready(ticket)
            return (await self._ensure_loaded(svc, chunk))[1]
        finally:
            self._queues.leave(ticket)

    async def evict(self, service: str, start: int, end: int) -> None:
        svc, chunk = self._service(service), self._chunk(start, end)
        ticket = self._queues.enter(chunk)
        try:
            await self._ready(ticket)
            for placement in [p for c, p in svc.placements.items() if chunk[0] <= c[0] and c[1] <= chunk[1]]:
                await self._drop(svc, placement)
        finally:
            self._queues.leave(ticket)

    async def invoke(self, service: str, start: int, end: int, payload: dict[str, Any],
                     timeout_s: float) -> dict[str, Any]:
        svc, chunk = self._service(service), self._chunk(start, end)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        ticket = self._queues.enter(chunk)
        handed_off = False
        try:
            await self._ready(ticket)
            placement, _ = await self._ensure_loaded(svc, chunk)
            task = self._start_call(svc, placement, payload, ticket)
            handed_off = True
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                raise CallTimeout(f"service {service!r} on GPUs {chunk} passed its {timeout_s:g} s timeout")
            return self._result(svc, placement, task)
        finally:
            if not handed_off:
                self._queues.leave(ticket)

    def facts(self) -> dict[str, Any]:
        resident: list[list[str]] = [[] for _ in self.gpus]
        services = {}
        for name, svc in sorted(self._services.items()):
            for c in svc.placements:
                for g in range(*c):
                    resident[g].append(name)
            services[name] = {
                "runtime": svc.spec.runtime, "gpu_mem_mib": svc.spec.gpu_mem_mib,
                "host_bytes": svc.host_bytes, "restore_bytes": svc.spec.restore_bytes,
                "placements": [
                    {"gpus": list(c), "in_use": p.refs, "calls": p.calls, "last_used": p.last_used,
                     "load_s": p.load.seconds}
                    for c, p in sorted(svc.placements.items())
                ],
            }
        gpus = [self._gpu_facts(i, resident[i]) for i in range(len(self.gpus))]
        return {"gpus": gpus, "services": services}

    async def aclose(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, wait (bounded) for everything queued or running, drop every placement and
        host backup. Placements still in use after ``timeout_s`` are left to their calls."""
        self._closed = True
        ticket = self._queues.enter((0, len(self.gpus))) if self.gpus else None
        try:
            if ticket is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(ticket.ready), timeout_s)
            for svc in list(self._services.values()):
                for placement in list(svc.placements.values()):
                    if placement.refs == 0:
                        with contextlib.suppress(Exception):
                            await self._drop(svc, placement)
                with contextlib.suppress(Exception):
                    await svc.runtime.close()
            self._services.clear()
        finally:
            if ticket is not None:
                self._queues.leave(ticket)

    # ------------------------------------------------------------------ internals

    async def _ready(self, ticket: _Ticket) -> None:
        await ticket.ready
        if self._closed:
            raise HostClosed("the GPU host is shutting down")

    def _service(self, name: str) -> _Service:
        if self._closed:
            raise HostClosed("the GPU host is shutting down")
        svc = self._services.get(name)
        if svc is None:
            raise UnknownService(f"service {name!r} is not prepared on this node")
        return svc

    def _chunk(self, start: int, end: int) -> Chunk:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(self.gpus)):
            raise BadChunk(f"chunk [{start}, {end}) is not inside this node's {len(self.gpus)} GPUs")
        return start, end

    @staticmethod
    async def _build(factory: RuntimeFactory, spec: ServiceSpec) -> Runtime:
        try:
            return factory(spec)
        except GpuError:
            raise
        except Exception as exc:
            msg = f"service {spec.name!r}: runtime setup failed: {exc}"
            raise PrepareFailed(msg, detail=format_exc(exc)) from exc

    @staticmethod
    async def _backup(runtime: Runtime, spec: ServiceSpec) -> int:
        try:
            return await runtime.prepare()
        except GpuError:
            raise
        except Exception as exc:
            msg = f"service {spec.name!r}: host backup failed: {exc}"
            raise PrepareFailed(msg, detail=format_exc(exc)) from exc

    async def _ensure_loaded(self, svc: _Service, chunk: Chunk) -> tuple[_Placement, LoadResult]:
        """Runs with the chunk's tickets held."""
        placement = svc.placements.get(chunk)
        if placement is not None:
            return placement, LoadResult(0.0, placement.load.bytes, restored=False)
        self._check_fits(svc.spec, chunk)
        gpus = self.gpus[chunk[0]:chunk[1]]
        need = svc.spec.gpu_mem_mib
        for g in range(*chunk):
            self.used_mib[g] += need
        try:
            result = await asyncio.wait_for(svc.runtime.load(gpus), self.load_timeout_s)
        except BaseException as exc:
            for g in range(*chunk):
                self.used_mib[g] -= need
            with contextlib.suppress(Exception):
                await svc.runtime.evict(gpus)
            err = self._load_error(svc.spec, chunk, exc)
            if err is None:
                raise
            self._count_failure(chunk, err)
            raise err from exc
        self._count_success(chunk)
        placement = svc.placements[chunk] = _Placement(chunk, gpus, result)
        return placement, result

    def _check_fits(self, spec: ServiceSpec, chunk: Chunk) -> None:
        for g in range(*chunk):
            if self._failures[g] >= self.unhealthy_after:
                raise GpuUnhealthy(f"GPU {g} ({self.gpus[g].uuid}) failed {self._failures[g]} times in a row")
            if self.used_mib[g] + spec.gpu_mem_mib > self.budget_mib[g]:
                raise GpuOutOfMemory(
                    f"service {spec.name!r} needs {spec.gpu_mem_mib} MiB on GPU {g}: {self.used_mib[g]} of "
                    f"{self.budget_mib[g]} MiB in use",
                    gpu=g, need_mib=spec.gpu_mem_mib, used_mib=self.used_mib[g],
                    budget_mib=self.budget_mib[g],
                )

    def _load_error(self, spec: ServiceSpec, chunk: Chunk, exc: BaseException) -> GpuError | None:
        if isinstance(exc, GpuError):
            return exc
        if isinstance(exc, TimeoutError):
            return LoadFailed(f"service {spec.name!r}: restore onto GPUs {chunk} passed "
                              f"{self.load_timeout_s} s")
        if isinstance(exc, Exception):
            return LoadFailed(f"service {spec.name!r}: restore onto GPUs {chunk} failed: {exc}",
                              detail=format_exc(exc))
        return None  # cancellation and the like propagate as they are

    def _count_failure(self, chunk: Chunk, exc: BaseException) -> None:
        if isinstance(exc, LoadFailed) or "CUDA error" in str(exc):
            for g in range(*chunk):
                self._failures[g] += 1

    def _count_success(self, chunk: Chunk) -> None:
        for g in range(*chunk):
            self._failures[g] = 0

    async def _drop(self, svc: _Service, placement: _Placement) -> None:
        while placement.refs:
            await placement.idle.wait()
        if svc.placements.get(placement.chunk) is not placement:
            return
        try:
            await svc.runtime.evict(placement.gpus)
        except GpuError:
            raise
        except Exception as exc:
            raise EvictFailed(f"service {svc.spec.name!r}: evict from GPUs {placement.chunk} failed: {exc}",
                              detail=format_exc(exc)) from exc
        del svc.placements[placement.chunk]
        for g in range(*placement.chunk):
            self.used_mib[g] -= svc.spec.gpu_mem_mib

    def _start_call(self, svc: _Service, placement: _Placement, payload: dict[str, Any],
                    ticket: _Ticket) -> asyncio.Task[dict[str, Any]]:
        """The call runs as an owned task; it releases the placement and the GPUs when it really ends."""
        placement.ref()
        placement.calls += 1
        task = asyncio.ensure_future(svc.runtime.call(placement.gpus, payload))
        self._tasks.add(task)

        def finished(t: asyncio.Task[dict[str, Any]]) -> None:
            self._tasks.discard(t)
            exc = None if t.cancelled() else t.exception()
            if exc is None:
                self._count_success(placement.chunk)
            else:
                self._count_failure(placement.chunk, exc)
            placement.unref()
            self._queues.leave(ticket)

        task.add_done_callback(finished)
        return task

    @staticmethod
    def _result(svc: _Service, placement: _Placement, task: asyncio.Task[dict[str, Any]]) -> dict[str, Any]:
        if task.cancelled():
            raise ServiceError(f"service {svc.spec.name!r}: call was cancelled")
        exc = task.exception()
        if exc is None:
            return task.result()
        if isinstance(exc, GpuError):
            raise exc
        raise ServiceError(f"service {svc.spec.name!r} on GPUs {placement.chunk} raised "
                           f"{type(exc).__name__}: {exc}", detail=format_exc(exc)) from exc

    def _gpu_facts(self, i: int, resident: list[str]) -> dict[str, Any]:
        info = self.gpus[i]
        out = info.to_dict()
        out.update(
            position=i, budget_mib=self.budget_mib[i], accounted_mib=self.used_mib[i], resident=resident,
            busy=self._queues.busy(i), waiting=self._queues.waiting(i),
            healthy=self._failures[i] < self.unhealthy_after,
        )
        if self._device_memory is not None:
            with contextlib.suppress(Exception):
                used = self._device_memory(info)
                if used is not None:
                    out["memory_used_mib"] = used
        if info.emulated:
            out["memory_used_mib"] = self.used_mib[i]
        return out
