"""GPU services on one node: evict-on-execution with host-memory backups (see docs/gpu.md).

Public API: :class:`GpuHost` (the service host the agent's link calls), :func:`build_host`,
:class:`ServiceSpec`, :class:`GpuInfo`, :class:`LoadResult` and the typed errors. Importing this package
never imports torch.
"""
from .base import (
    BadChunk,
    CallTimeout,
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
    emulated_gpus,
)
from .emulated import EmulatedConfig
from .host import GpuHost, chunk_of
from .runtimes import build_host, default_runtimes

__all__ = [
    "BadChunk",
    "CallTimeout",
    "EmulatedConfig",
    "EvictFailed",
    "GpuError",
    "GpuHost",
    "GpuInfo",
    "GpuOutOfMemory",
    "GpuUnhealthy",
    "HostClosed",
    "LoadFailed",
    "LoadResult",
    "PrepareFailed",
    "Runtime",
    "RuntimeFactory",
    "ServiceError",
    "ServiceSpec",
    "SpecMismatch",
    "UnknownService",
    "build_host",
    "chunk_of",
    "default_runtimes",
    "emulated_gpus",
]
