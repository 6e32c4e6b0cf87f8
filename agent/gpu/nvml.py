"""GPU discovery through NVML (package ``nvidia-ml-py``): never raises, says why when it finds nothing.

``discover()`` returns ``(gpus, reason)``: ``reason`` is None when NVML answered (``gpus`` may still be
empty), else one line saying what is missing. Memory uses the v2 counters when the driver has them
(``used`` then excludes driver-reserved memory); CPU affinity comes from ``nvmlDeviceGetCpuAffinity``.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from .base import GpuInfo, MiB

# pynvml (nvidia-ml-py) is optional on a node: imported where used, so this module loads without it.

_AFFINITY_WORDS = 64  # 64 x 64 bits = 4096 CPUs


@contextlib.contextmanager
def _session() -> Iterator[Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _memory(nv: Any, handle: Any) -> tuple[int, int]:
    """(total, used) in bytes; v2 counters when available."""
    version = getattr(nv, "nvmlMemory_v2", None)
    if version is not None:
        with contextlib.suppress(Exception):
            info = nv.nvmlDeviceGetMemoryInfo(handle, version=version)
            return int(info.total), int(info.used)
    info = nv.nvmlDeviceGetMemoryInfo(handle)
    return int(info.total), int(info.used)


def cpus_from_mask(words: Any, bits: int = 64) -> tuple[int, ...]:
    """NVML's affinity bitmask (array of unsigned longs, lowest CPU first) -> CPU numbers."""
    out = []
    for w, word in enumerate(words):
        word = int(word)
        for b in range(bits):
            if word >> b & 1:
                out.append(w * bits + b)
    return tuple(out)


def _affinity(nv: Any, handle: Any) -> tuple[int, ...]:
    with contextlib.suppress(Exception):
        return cpus_from_mask(nv.nvmlDeviceGetCpuAffinity(handle, _AFFINITY_WORDS))
    return ()


def _device(nv: Any, index: int) -> GpuInfo:
    handle = nv.nvmlDeviceGetHandleByIndex(index)
    total, used = _memory(nv, handle)
    bus = ""
    with contextlib.suppress(Exception):
        bus = _text(nv.nvmlDeviceGetPciInfo(handle).busId)
    return GpuInfo(
        index=index, uuid=_text(nv.nvmlDeviceGetUUID(handle)), name=_text(nv.nvmlDeviceGetName(handle)),
        memory_total_mib=total // MiB, memory_used_mib=used // MiB, cpus=_affinity(nv, handle),
        pci_bus_id=bus,
    )


def discover() -> tuple[list[GpuInfo], str | None]:
    """Every NVML device, by index; ``([], reason)`` when the library or driver is missing."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return [], "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        with _session() as nv:
            return [_device(nv, i) for i in range(nv.nvmlDeviceGetCount())], None
    except Exception as exc:  # noqa: BLE001 -- NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], f"NVML unavailable: {type(exc).__name__}: {exc}"


_live: Any = None
_live_lock = threading.Lock()


def _live_nvml() -> Any:
    """A process-wide NVML handle for frequent reads (NVML init is reference counted; kept open)."""
    global _live
    with _live_lock:
        if _live is None:
            import pynvml

            pynvml.nvmlInit()
            _live = pynvml
        return _live


def memory_used_mib(uuid: str) -> int | None:
    """Current used memory of the device with this UUID (v2 counters when available); None on any failure."""
    try:
        nv = _live_nvml()
        return _memory(nv, nv.nvmlDeviceGetHandleByUUID(uuid))[1] // MiB
    except Exception:  # noqa: BLE001 -- a probe: any failure means "no reading"
        return None


def device_memory(info: GpuInfo) -> int | None:
    """``GpuHost(device_memory=...)`` hook: NVML used MiB for real devices, None for emulated ones."""
    return None if info.emulated else memory_used_mib(info.uuid)
