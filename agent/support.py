"""Pure pieces of the agent link (``link``): the reply outbox, reconnect backoff, reading a request id from
frames that did not decode, GPU chunks, and the mapping from exceptions to wire errors (docs/agent.md,
"Errors")."""
from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from agent.executors.base import ExecutorError, PathRejected, SandboxNotFound, TooLarge
from tangram import protocol as p
from tangram.errors import (
    ActionTimeout,
    BadRequest,
    InternalError,
    RemoteError,
    RetryLater,
    SandboxLost,
    TangramError,
)

log = logging.getLogger("agent")

REJECT_RETRYABLE = ("duplicate", "already", "retry", "later", "restart", "grace", "busy")


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
    try:  # GPU modules load on the GPU path only (node.py): without them, no GPU error is possible
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
    import docker.errors  # docker-py is optional on a node: only the docker executor calls this

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise BadRequest(f"image {image!r} is not on node {node}; the agent never pulls",
                         hint="docker load or docker import it on the node first") from None
