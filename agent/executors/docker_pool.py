"""The Docker executor's warm sandbox pool: created, idle containers of a shape, claimed on open.

A pooled container is made exactly as a sandbox's would be (``docker.container_kwargs``: image, limits,
user, ``/etc``, disk; its spawner started), but for no sandbox yet: it is named ``<prefix>_pool-<token>``
(``<prefix>`` is the cluster's container-name prefix; a sandbox name never starts with ``_``), has no
``tangram.sandbox`` label, and carries ``tangram.pool=<mem_mib>/<image>`` (its shape) and
``tangram.pool.make`` (a digest of the arguments it was made with). The controller names each shape's
size with ``SandboxPool`` (docs/protocol.md, "Warm sandbox pools").

Rules:

1. ``take`` (serving ``CreateSandbox``) does not wait: it pops a ready container of the request's shape,
   appends the claim (container id, sandbox) to ``<workdir>/pool-claims`` before the reply, and renames
   the container to the sandbox's name in the background, ``QUIET_S`` later (the sandbox's first
   actions go first). Labels cannot change, so from then on the
   container's *name* says which sandbox it is (``sandbox_of``); until the rename is done the executor's
   own map says it, and after an agent crash the claims file does (rule 4).
2. Refill runs in the background: at most ``concurrency`` containers made at once, their Docker calls
   on threads of the pool's own (never the ones running actions wait for); it waits while every core the
   node hands out runs an action, while a cold ``CreateSandbox`` is being served, and for ``QUIET_S``
   after a claim (a trajectory's first actions follow its open: they run before the refill's container
   creation competes with them for the node's CPU and dockerd), but no longer than ``MAX_DEFER_S``.
   Pooled containers hold no cores (they sit on the idle cores, as every idle sandbox does) and at most
   ``max_idle`` of them exist at once.
3. A pool above its target loses its oldest containers (removed in the background).
4. Agent restart (``recover``): the containers of this node with the pool label are found. A pool-named
   one whose claim is in ``pool-claims`` is renamed now (the claim stands); an unclaimed running one made
   with this agent's arguments is adopted back into its pool (a new spawner started); every other one is
   removed. An adopted pool keeps its size until the controller names a target, at most
   ``ADOPT_GRACE_S``: nothing is left behind by an agent that is never told.
5. ``drain`` (``Shutdown("down")``) removes every idle pooled container; ``close`` leaves them running
   for the next agent (rule 4).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .base import SandboxSpec

if TYPE_CHECKING:  # the executor owns the pool; the pool calls back into it
    from .docker import DockerExecutor, _Sandbox

LABEL_POOL = "tangram.pool"
LABEL_MAKE = "tangram.pool.make"
LABEL_SANDBOX = "tangram.sandbox"  # as agent.executors.docker's (a pooled container has none)
LABEL_NODE = "tangram.node"
POOLED = "pooled"  # the placeholder sandbox name a pooled container is made for
POOL_MARK = "_pool-"
CLAIMS_FILE = "pool-claims"
ADOPT_GRACE_S = 60.0
IDLE_POLL_S = 0.25
QUIET_S = 0.5  # refill waits this long after a claim (rule 2) ...
MAX_DEFER_S = 5.0  # ... but never longer than this in a row
FAIL_BACKOFF_S = (1.0, 30.0)  # after a failed make: wait this long, doubling up to the second
# the container arguments whose change makes an adopted container unlike a new one
MAKE_KEYS = ("image", "mem_limit", "memswap_limit", "pids_limit", "user", "cpuset_cpus", "volumes",
             "mounts", "read_only", "storage_opt", "cap_drop", "security_opt", "network_mode", "working_dir",
             "environment")
log = logging.getLogger("agent.executors.docker")


@dataclass(frozen=True, order=True)
class Shape:
    """A pool's shape as the executor sees it: the image (the agent's default filled in) and the memory
    the request named (0: the agent's default)."""

    image: str
    mem_mib: int

    def label(self) -> str:
        return f"{self.mem_mib}/{self.image}"

    @classmethod
    def of_label(cls, value: str) -> Shape | None:
        mem, sep, image = value.partition("/")
        if not sep or not mem.isdigit() or not image:
            return None
        return cls(image, int(mem))


def make_digest(kw: dict[str, Any]) -> str:
    """Pure: a digest of the container arguments that matter for adoption (``MAKE_KEYS``)."""
    doc = json.dumps({k: str(kw.get(k)) for k in MAKE_KEYS}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def pooled_kwargs(kw: dict[str, Any], shape: Shape, name: str, label_sandbox: str,
                  extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Pure: a sandbox's ``containers.run`` arguments made into a pooled container's: ``name``, no sandbox
    label, the shape and the make digest, and the ``extra`` labels (never over the agent's own)."""
    labels = {**(extra or {}), **{k: v for k, v in kw["labels"].items() if k != label_sandbox}}
    labels[LABEL_POOL] = shape.label()
    labels[LABEL_MAKE] = make_digest(kw)
    return {**kw, "name": name, "labels": labels}


def is_pool_name(name: str, prefix: str) -> bool:
    return name.lstrip("/").startswith(prefix + POOL_MARK)


def sandbox_of(name: str, prefix: str) -> str | None:
    """The sandbox a claimed pooled container holds, from its name; None for an unclaimed one."""
    name = name.lstrip("/")
    if not name.startswith(prefix) or is_pool_name(name, prefix):
        return None
    return name[len(prefix):] or None


class ClaimLog:
    """``pool-claims``: one ``<container id> <sandbox>`` line per claim whose rename may not be done."""

    def __init__(self, path: str) -> None:
        self.path = path

    def add(self, cid: str, sandbox: str) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a", encoding="ascii") as fh:
            fh.write(f"{cid} {sandbox}\n")

    def read(self) -> dict[str, str]:
        out: dict[str, str] = {}
        with contextlib.suppress(OSError), open(self.path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                cid, _, sandbox = line.strip().partition(" ")
                if cid and sandbox:
                    out[cid] = sandbox
        return out

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass
class PoolStats:
    made: int = 0
    claimed: int = 0
    missed: int = 0  # CreateSandbox of a shape with a target and nothing ready: made cold
    removed: int = 0
    adopted: int = 0
    failed: int = 0


@dataclass
class _ShapePool:
    ready: deque[_Sandbox] = field(default_factory=deque)
    target: int | None = None  # None: never named by the controller (adopted containers only)
    making: int = 0
    failing_until: float = 0.0
    failures: int = 0


class SandboxPool:
    """The pools of one Docker executor (rules in the module doc)."""

    def __init__(self, ex: DockerExecutor, workdir: str, *, max_idle: int = 64, concurrency: int = 1,
                 labels: dict[str, str] | None = None) -> None:
        self.ex = ex
        self.max_idle = max_idle
        self.concurrency = max(1, concurrency)
        self.labels = dict(labels or {})  # labels every pooled container carries (an operator's, a test's)
        self.prefix = ex._name("")
        self.claims = ClaimLog(os.path.join(workdir, CLAIMS_FILE))
        self.pools: dict[Shape, _ShapePool] = {}
        self.renames: dict[str, str] = {}  # container id -> sandbox: claims whose rename is not done
        self.total_cores = 0  # cores the node hands out (the agent says); 0: unknown, never all busy
        self.stats = PoolStats()
        self.adopt_until = 0.0
        self.draining = False  # down: what is made from now on is removed at once
        self._last_claim = 0.0
        self._deferred_since: float | None = None  # refill has waited for quiet since
        self._thread = ThreadPoolExecutor(max_workers=self.concurrency + 1, thread_name_prefix="pool")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ plumbing
    async def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn`` on one of the pool's own threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args, **kw))

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        """The refill task (idempotent; on the running loop)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.ensure_future(self._run())

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------ what the agent asks
    def set_target(self, shape: Shape, count: int) -> None:
        sp = self.pools.setdefault(shape, _ShapePool())
        sp.target, sp.failing_until, sp.failures = max(0, count), 0.0, 0
        self.start()
        self.wake()

    def shape_of(self, spec: SandboxSpec, own_labels: tuple[str, ...]) -> Shape | None:
        """The shape a request can be served from, None when it asks for what no pooled container has: a
        user or pids limit of its own, or labels beyond the agent's own (``own_labels``) and the pool's."""
        if spec.user is not None or spec.pids_limit != 512:
            return None
        extra = {k: v for k, v in spec.labels.items() if k not in own_labels}
        if any(self.labels.get(k) != v for k, v in extra.items()):
            return None
        return Shape(spec.image or self.ex.image_default, spec.mem_mib)

    def take(self, spec: SandboxSpec, shape: Shape | None) -> _Sandbox | None:
        """Rule 1: a ready container of ``shape`` claimed for ``spec.sandbox``; None: none ready."""
        sp = self.pools.get(shape) if shape is not None else None
        while sp is not None and sp.ready:
            sb = sp.ready.popleft()
            self.wake()
            if sb.cg is not None and self.ex.use_spawner and (sb.spawner is None or not sb.spawner.alive):
                self._background(self._remove(sb))  # its spawner died: the container may be gone too
                continue
            sb.name = spec.sandbox
            self.claims.add(sb.cid, spec.sandbox)
            self.renames[sb.cid] = spec.sandbox
            self._background(self._rename(sb.cid, spec.sandbox))
            self.stats.claimed += 1
            self._last_claim = time.monotonic()
            return sb
        if sp is not None and sp.target:
            self.stats.missed += 1
        return None

    def pending(self) -> dict[str, str]:
        """Claimed sandboxes whose container still has its pool name: container id -> sandbox."""
        return dict(self.renames)

    def report(self) -> list[dict[str, Any]]:
        """Every pool: shape, target, idle and being made (for Hello facts and heartbeats)."""
        return [{"image": s.image, "mem_mib": s.mem_mib, "target": sp.target if sp.target is not None else -1,
                 "idle": len(sp.ready), "making": sp.making} for s, sp in sorted(self.pools.items())]

    def idle(self) -> int:
        return sum(len(sp.ready) for sp in self.pools.values())

    # ------------------------------------------------------------ refill and trim (rules 2, 3)
    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            waiter = asyncio.ensure_future(self._wake.wait())  # not wait_for: it can swallow a cancel
            try:
                await asyncio.wait({waiter}, timeout=IDLE_POLL_S)
            finally:
                waiter.cancel()
            self._wake.clear()
            try:
                self._trim()
                while (shape := self._next_shape()) is not None:
                    sp = self.pools[shape]
                    sp.making += 1
                    self._background(self._make(shape, sp))
            except Exception:  # noqa: BLE001 - the pool must outlive any one mistake
                log.exception("sandbox pool: refill round failed")

    def _target(self, sp: _ShapePool) -> int:
        if sp.target is not None:
            return sp.target
        return len(sp.ready) + sp.making if time.monotonic() < self.adopt_until else 0

    def _next_shape(self) -> Shape | None:
        making = sum(sp.making for sp in self.pools.values())
        if making >= self.concurrency or self.ex._cold > 0 or self.idle() + making >= self.max_idle:
            return None
        if self.total_cores and len(self.ex.busy_cores()) >= self.total_cores:
            return None  # every core runs an action: refill waits (rule 2)
        now = time.monotonic()
        short = [(len(sp.ready) + sp.making - self._target(sp), s) for s, sp in self.pools.items()
                 if sp.failing_until <= now and len(sp.ready) + sp.making < self._target(sp)]
        if not short or self._wait_for_quiet(now):
            return None
        return min(short)[1]

    def _wait_for_quiet(self, now: float) -> bool:
        """Rule 2: True while a claim was made less than QUIET_S ago (for at most MAX_DEFER_S)."""
        if now - self._last_claim >= QUIET_S:
            self._deferred_since = None
            return False
        if self._deferred_since is None:
            self._deferred_since = now
        return now - self._deferred_since < MAX_DEFER_S

    def _trim(self) -> None:
        for sp in self.pools.values():
            while len(sp.ready) > self._target(sp):
                self._background(self._remove(sp.ready.popleft()))

    async def _make(self, shape: Shape, sp: _ShapePool) -> None:
        name = f"{self.prefix}{POOL_MARK}{secrets.token_hex(6)}"
        try:
            await self.call(self.ex.client.images.get, shape.image)  # never pulls: a missing image fails here
            kw = await self.call(self.kwargs, shape, name)
            sb = await self.ex._make(SandboxSpec(POOLED, shape.image, shape.mem_mib), kw, self.call)
        except Exception as exc:  # noqa: BLE001 - docker.errors.*, ExecutorError: back off, try later
            sp.failures += 1
            lo, hi = FAIL_BACKOFF_S
            sp.failing_until = time.monotonic() + min(hi, lo * 2 ** (sp.failures - 1))
            self.stats.failed += 1
            log.warning("sandbox pool %s: cannot make a container (%s); next try in %.0f s", shape.label(),
                        exc, sp.failing_until - time.monotonic())
            return
        finally:
            sp.making -= 1
            self.wake()
        sp.failures = 0
        self.stats.made += 1
        if self.draining:
            await self._remove(sb)
            return
        sp.ready.append(sb)

    def kwargs(self, shape: Shape, name: str) -> dict[str, Any]:
        """Blocking (the hostroot ``/etc``): the ``containers.run`` arguments of a pooled container."""
        kw = self.ex._kwargs(SandboxSpec(POOLED, shape.image, shape.mem_mib))
        return pooled_kwargs(kw, shape, name, LABEL_SANDBOX, self.labels)

    async def _remove(self, sb: _Sandbox) -> None:
        if sb.spawner is not None:
            await sb.spawner.close()
        if sb.slots is not None:
            sb.slots.remove_all()
        with contextlib.suppress(Exception):  # docker.errors.*: gone already
            await self.call(self.ex.client.api.remove_container, sb.cid, force=True, v=True)
        self.stats.removed += 1

    async def _rename(self, cid: str, sandbox: str) -> None:
        import docker.errors  # optional dependency: agent/pool_requests.py imports this module on every agent

        await asyncio.sleep(QUIET_S)  # rule 1: after the sandbox's first actions
        try:
            await self.call(self.ex.client.api.rename, cid, self.ex._name(sandbox))
        except docker.errors.NotFound:
            pass  # destroyed meanwhile
        except Exception as exc:  # noqa: BLE001 - keep the claim: a restarted agent finishes it (rule 4)
            log.warning("sandbox %s: cannot rename its pooled container %s: %s", sandbox, cid[:12], exc)
            return
        self.renames.pop(cid, None)
        if not self.renames:
            self.claims.clear()

    # ------------------------------------------------------------ restart, down, close (rules 4, 5)
    async def recover(self) -> None:
        """Rule 4, before the agent's first Hello."""
        keep, counts = await self.call(self._recover)
        adopted = await self.adopt(keep)
        log.info("sandbox pool: %d claims finished, %d idle pooled containers adopted, %d removed",
                 counts["renamed"], adopted, counts["removed"])

    def _recover(self) -> tuple[list[tuple[Shape, Any]], dict[str, int]]:
        """Blocking (Docker API): rule 4 up to adoption; returns the containers to adopt, and counts."""
        ex = self.ex
        claims = self.claims.read()
        found = ex.client.containers.list(all=True, filters={"label": [LABEL_POOL]})  # ex._own picks ours
        keep: list[tuple[Shape, Any]] = []
        counts = {"renamed": 0, "removed": 0}
        for c in found:
            mine = ex._own(c) and c.labels.get(LABEL_NODE) in (None, ex.node)
            if not mine or not is_pool_name(c.name, self.prefix):
                continue
            shape = Shape.of_label(c.labels.get(LABEL_POOL, ""))
            try:
                if c.id in claims:
                    c.rename(ex._name(claims[c.id]))
                    counts["renamed"] += 1
                elif c.status == "running" and shape is not None and self._made_alike(c, shape):
                    keep.append((shape, c))
                else:
                    c.remove(force=True, v=True)
                    counts["removed"] += 1
            except Exception as exc:  # noqa: BLE001 - docker.errors.*: e.g. removed meanwhile
                log.warning("sandbox pool: cannot recover container %s: %s", c.name, exc)
        self.claims.clear()
        return keep, counts

    def _made_alike(self, c: Any, shape: Shape) -> bool:
        try:
            kw = self.kwargs(shape, c.name)
        except Exception:  # noqa: BLE001 - e.g. the image is gone
            return False
        return c.labels.get(LABEL_MAKE) == kw["labels"][LABEL_MAKE]

    async def adopt(self, keep: list[tuple[Shape, Any]]) -> int:
        """Rule 4: attach each kept container and start its spawner; into its pool, or removed."""
        self.adopt_until = time.monotonic() + ADOPT_GRACE_S
        for shape, c in keep:
            try:
                sb = await self.call(self.ex._attach, c)
                if self.ex.use_spawner and sb.cg is not None and await self.ex._spawner(sb) is None:
                    raise RuntimeError("no spawner")
            except Exception as exc:  # noqa: BLE001 - not usable: removed
                log.warning("sandbox pool: cannot adopt %s (%s): removed", c.name, exc)
                with contextlib.suppress(Exception):
                    await self.call(c.remove, force=True, v=True)
                continue
            self.pools.setdefault(shape, _ShapePool()).ready.append(sb)
            self.stats.adopted += 1
        if keep:
            self.start()
        return self.stats.adopted

    async def drain(self) -> int:
        """Rule 5 (down): remove every idle pooled container, and those being made; no refill after."""
        self.draining = True
        await self._stop_refill()
        if self._tasks:  # makes in flight end removed (see _make); renames and removals end
            await asyncio.wait(set(self._tasks), timeout=60.0)
        gone = [sb for sp in self.pools.values() for sb in sp.ready]
        for sp in self.pools.values():
            sp.ready.clear()
            sp.target = 0
        await asyncio.gather(*(self._remove(sb) for sb in gone))
        return len(gone)

    async def close(self) -> None:
        """Stop refilling; finish renames (bounded); stop the idle containers' spawners (rule 5)."""
        await self._stop_refill()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=10.0)
        for sp in self.pools.values():
            for sb in sp.ready:
                if sb.spawner is not None:
                    await sb.spawner.close()
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _stop_refill(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
