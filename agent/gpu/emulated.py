"""Emulated GPU runtime: real host bytes, real copies, restore time = setup_s + bytes / bandwidth.

Model (numbers from published host-to-device copy measurements, as docs/gpu.md states them):

* The host backup is a real ``bytes`` object. A 14 GB model would not fit CI, so the backup holds
  ``restore_bytes // scale`` bytes (default scale 1024, capped at ``cap_bytes``, default 64 MiB, at least
  one byte when the service has weights): the copy is real, its size is scaled.
* A restore copies the backup into one buffer per GPU of the chunk (its "device memory"), then sleeps
  the rest of ``setup_s + restore_bytes / bandwidth``: the *logical* bytes set the time. GPUs of a chunk
  restore in parallel (each has its own PCIe link), so the time does not grow with the chunk size.
  Default bandwidth 25 GB/s (pinned H2D on PCIe Gen4, nvbandwidth on A100); H200 hosts on Gen5 reach
  ~53-57 GB/s. ``setup_s`` (the fixed t0 of a measured restore, T = t0 + S/BW, t0 0.1-0.2 s) defaults to 0.
* ``spec.options`` may override ``bandwidth_gbps`` and ``setup_s`` per service.
* Calls run the service's Python function (``spec.model = "package.module:function"``) in a worker
  thread, so the event loop stays free. Memory budgets are enforced by the host, not here.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .base import GpuInfo, LoadResult, MiB, PrepareFailed, ServiceSpec, import_object

DEFAULT_BANDWIDTH_GBPS = 25.0
DEFAULT_SCALE = 1024
DEFAULT_CAP_BYTES = 64 * MiB


@dataclass(frozen=True)
class EmulatedConfig:
    """Node-wide emulation settings (the factory; ``spec.options`` may override bandwidth and setup)."""

    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    setup_s: float = 0.0
    scale: int = DEFAULT_SCALE
    cap_bytes: int = DEFAULT_CAP_BYTES

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or self.setup_s < 0 or self.scale < 1 or self.cap_bytes < 1:
            raise ValueError(f"invalid emulation settings {self}")

    def __call__(self, spec: ServiceSpec) -> EmulatedRuntime:
        return EmulatedRuntime(spec, self)


def backup_size(restore_bytes: int, scale: int, cap_bytes: int) -> int:
    """Bytes really held in host memory for ``restore_bytes`` logical bytes."""
    if restore_bytes <= 0:
        return 0
    return max(1, min(restore_bytes // scale, cap_bytes))


def restore_seconds(restore_bytes: int, bandwidth_gbps: float, setup_s: float = 0.0) -> float:
    """Modelled restore time: setup_s + bytes / bandwidth."""
    return setup_s + restore_bytes / (bandwidth_gbps * 1e9)


def _pattern(size: int, seed: str) -> bytes:
    """Deterministic, service-specific contents (so a wrong copy is detectable)."""
    block = hashlib.sha256(seed.encode()).digest() * 2048  # 64 KiB
    reps, rest = divmod(size, len(block))
    return block * reps + block[:rest]


class EmulatedRuntime:
    """One service on emulated devices: a host backup plus one byte buffer per GPU it is restored on."""

    def __init__(self, spec: ServiceSpec, config: EmulatedConfig | None = None) -> None:
        self.spec = spec
        self.config = config or EmulatedConfig()
        opts = spec.options
        self.bandwidth_gbps = float(opts.get("bandwidth_gbps", self.config.bandwidth_gbps))
        self.setup_s = float(opts.get("setup_s", self.config.setup_s))
        if not self.bandwidth_gbps > 0 or self.setup_s < 0:
            raise ValueError(f"service {spec.name}: bandwidth_gbps must be > 0 and setup_s >= 0")
        self._fn: Callable[[dict[str, Any]], Any] | None = None
        self._backup: bytes | None = None
        self._device: dict[tuple[int, ...], list[bytearray]] = {}

    async def prepare(self) -> int:
        if self._backup is not None:
            return len(self._backup)
        try:
            fn = import_object(self.spec.model)
        except Exception as exc:
            msg = f"service {self.spec.name}: cannot import {self.spec.model!r}: {exc}"
            raise PrepareFailed(msg) from exc
        if not callable(fn):
            raise PrepareFailed(f"service {self.spec.name}: {self.spec.model!r} is not callable")
        size = backup_size(self.spec.restore_bytes, self.config.scale, self.config.cap_bytes)
        self._backup = await asyncio.to_thread(_pattern, size, self.spec.name)
        self._fn = fn
        return size

    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult:
        key = _key(gpus)
        if key in self._device:
            return LoadResult(0.0, self.spec.restore_bytes, restored=False)
        backup = self._need_backup()
        t0 = time.perf_counter()
        buffers = await asyncio.to_thread(_copy_to, backup, len(gpus))
        target = restore_seconds(self.spec.restore_bytes, self.bandwidth_gbps, self.setup_s)
        left = target - (time.perf_counter() - t0)
        if left > 0:
            await asyncio.sleep(left)
        self._device[key] = buffers
        return LoadResult(time.perf_counter() - t0, self.spec.restore_bytes)

    async def evict(self, gpus: Sequence[GpuInfo]) -> None:
        self._device.pop(_key(gpus), None)  # no write-back: the weights never change

    async def call(self, gpus: Sequence[GpuInfo], payload: dict[str, Any]) -> dict[str, Any]:
        if _key(gpus) not in self._device:
            raise RuntimeError(f"service {self.spec.name} is not resident on GPUs {_key(gpus)}")
        assert self._fn is not None
        result = await asyncio.to_thread(self._fn, payload)
        if not isinstance(result, dict):
            raise TypeError(f"service {self.spec.name} returned {type(result).__name__}, expected dict")
        return result

    async def close(self) -> None:
        self._device.clear()
        self._backup = None

    # ---- inspection (tests, facts)

    @property
    def host_bytes(self) -> int:
        return len(self._backup) if self._backup is not None else 0

    def device_digest(self, gpus: Sequence[GpuInfo]) -> list[str]:
        """sha256 of each GPU's buffer of a placement ([] when not resident)."""
        return [hashlib.sha256(buf).hexdigest() for buf in self._device.get(_key(gpus), [])]

    def backup_digest(self) -> str:
        return hashlib.sha256(self._need_backup()).hexdigest()

    def _need_backup(self) -> bytes:
        if self._backup is None:
            raise RuntimeError(f"service {self.spec.name} was not prepared")
        return self._backup


def _key(gpus: Sequence[GpuInfo]) -> tuple[int, ...]:
    return tuple(g.index for g in gpus)


def _copy_to(backup: bytes, copies: int) -> list[bytearray]:
    """One real copy of the backup per GPU."""
    out = []
    for _ in range(copies):
        buf = bytearray(len(backup))
        buf[:] = backup
        out.append(buf)
    return out
