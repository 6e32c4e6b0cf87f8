"""The agent's side of opening sandboxes fast: a mixin of ``link.Agent``, which provides the executor, the
agent's config, its cores and its ``_create_sandbox``/``_spawn`` handlers.

* Warm sandbox pools: only an executor with a ``pool`` (the Docker executor: ``agent.executors.docker_pool``)
  has them; the Hello facts then list them under ``pool`` (a list, maybe empty), which is what tells the
  controller it may send ``SandboxPool``. The process executor has none and says nothing (docs/agent.md).
* A ``Spawn`` that arrives while a ``CreateSandbox`` of its sandbox is being served waits for it (the facts
  say ``spawn_after_create``), so the controller may send a sandbox's first Spawn right behind its
  CreateSandbox instead of after the reply: one round trip less on every open. Requests start in the
  order they arrive, and the CreateSandbox registers itself before its first ``await``."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from tangram import protocol as p
from tangram.errors import BadRequest

from .executors.base import SandboxSpec
from .executors.docker_pool import Shape

log = logging.getLogger("agent")

Reply = tuple[p.Message, list[bytes]]


class PoolRequests:
    executor: Any
    cfg: Any
    cpus: set[int]
    _create_sandbox: Any
    _spawn: Any
    _creating: dict[str, asyncio.Future[None]]

    def _pool(self) -> Any:
        return getattr(self.executor, "pool", None)

    def _setup_pool(self) -> None:
        """The pool waits while every core the agent hands out runs an action."""
        self._creating = {}
        pool = self._pool()
        if pool is not None:
            pool.total_cores = len(self.cpus)

    async def _create_announced(self, msg: p.CreateSandbox, blobs: tuple[bytes, ...]) -> Reply:
        """``CreateSandbox``, known to the Spawns that arrive while it is served (module doc)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._creating[msg.sandbox] = done
        try:
            return await self._create_sandbox(msg, blobs)  # type: ignore[no-any-return]
        finally:
            if self._creating.get(msg.sandbox) is done:
                del self._creating[msg.sandbox]
            done.set_result(None)

    async def _spawn_after_create(self, msg: p.Spawn, blobs: tuple[bytes, ...]) -> Reply:
        creating = self._creating.get(msg.sandbox)
        if creating is not None:
            await asyncio.shield(creating)
        return await self._spawn(msg, blobs)  # type: ignore[no-any-return]

    async def _sandbox_pool(self, msg: p.SandboxPool, blobs: tuple[bytes, ...]) -> Reply:
        pool = self._pool()
        if pool is None:
            raise BadRequest(f"node {self.cfg.name} keeps no sandbox pools (executor without pools)")
        shape = Shape(msg.image or self.cfg.image, msg.mem_mib)
        pool.set_target(shape, msg.count)
        log.info("sandbox pool %s: target %d", shape.label(), msg.count)
        sp = pool.pools[shape]
        return p.Result({"idle": len(sp.ready), "making": sp.making}), []

    def _claim(self, spec: SandboxSpec) -> bool:
        """A warm sandbox for ``spec``, claimed at once; False: the executor must create one."""
        claim = getattr(self.executor, "claim_sandbox", None)
        return bool(claim is not None and claim(spec))

    def _hello_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        """``facts``, and what the agent offers: Spawns after CreateSandbox, pools (with the memory of a
        sandbox opened without ``mem``)."""
        pool = self._pool()
        if pool is None:
            return {**facts, "spawn_after_create": True}
        return {**facts, "spawn_after_create": True, "pool": pool.report(),
                "sandbox_mem_mib": self.executor.limits.mem_mib, "image": self.cfg.image}

    def _pool_load(self) -> dict[str, Any]:
        """For heartbeats: idle pooled sandboxes and their memory."""
        pool = self._pool()
        if pool is None:
            return {}
        mem = sum(r["idle"] * (r["mem_mib"] or self.executor.limits.mem_mib) for r in pool.report())
        return {"pool_idle": pool.idle(), "pool_mem_mib": mem}

    async def _drain_pool(self) -> None:
        pool = self._pool()
        if pool is not None:
            removed = await pool.drain()
            log.info("sandbox pools drained: %d idle containers removed", removed)
