"""The agent's GPU service requests (``Prepare``, ``Load``, ``Evict``, ``Invoke``): a mixin of ``link.Agent``,
which provides the GPU host (``gpu``), the running-action table and the epoch check."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]

from tangram import protocol as p
from tangram.errors import BadRequest, Cancelled, NodeLost, RemoteError
from tangram.outcomes import CallOutcome

from .support import gpu_chunk

log = logging.getLogger("agent")

MAX_TIMEOUT_S = 86399.0  # as link.MAX_TIMEOUT_S: the GPU host caps a call at 24 h
PAYLOAD_LIMITS = {"max_str_len": p.MAX_MESSAGE_BYTES, "max_bin_len": p.MAX_MESSAGE_BYTES,
                  "max_array_len": 1 << 20, "max_map_len": 1 << 20, "max_ext_len": 0}

Reply = tuple[p.Message, list[bytes]]


class GpuRequests:
    gpu: Any
    _running: dict[str, Any]
    _check_epochs: Any
    _track: Any
    _echo: Any

    def _gpu_host(self) -> Any:
        if self.gpu is None:
            raise BadRequest("this agent has no GPUs "
                             "(start it with --emulated-gpus N, or on a node with NVIDIA GPUs)")
        return self.gpu

    async def _prepare(self, msg: p.Prepare, blobs: tuple[bytes, ...]) -> Reply:
        from agent.gpu.base import ServiceSpec  # GPU modules load on the GPU path only (node.py)

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
            outcome = CallOutcome(run_s=run_s, gpus=tuple(msg.gpus), service=msg.service,
                                  **self._echo(msg.action, msg.attempt, msg.epoch, msg.agent_epoch))
            reply: Reply = (p.Result(outcome.to_body()), [blob])
            run.outcome.set_result(reply)
            return reply
        except BaseException as exc:
            if run.inner is not None and not run.inner.done():
                run.inner.cancel()
            run.outcome.set_exception(exc if isinstance(exc, Exception) else NodeLost("agent stopping"))
            raise
        finally:
            self._running.pop(msg.action, None)
