"""Runtime factories for a node and a one-call host builder from agent settings.

``build_host(emulated=2, gpu_memory_mib=16384)`` -> emulated devices; ``build_host()`` -> NVML devices
(none, with a reason, where there is no driver). The torch runtime is offered only when torch imports.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from . import nvml
from .base import GpuInfo, PrepareFailed, Runtime, RuntimeFactory, ServiceSpec, emulated_gpus
from .emulated import EmulatedConfig
from .external import ExternalConfig
from .host import GpuHost


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


class _LazyTorch:
    """Imports ``agent.gpu.torch_module`` (and torch) on first use only."""

    def __init__(self, **config: Any) -> None:
        self.config = config

    def __call__(self, spec: ServiceSpec) -> Runtime:
        try:  # torch is optional (the gpu extra): without it this runtime says how to get it
            from .torch_module import TorchConfig
        except ImportError as exc:
            hint = "pip install 'tangram-rl[gpu]'"
            raise PrepareFailed(f"torch runtime unavailable: {exc}", hint=hint) from exc
        return TorchConfig(**self.config)(spec)


def default_runtimes(
    emulated: EmulatedConfig | None = None, torch_config: Mapping[str, Any] | None = None,
    external: ExternalConfig | None = None,
) -> dict[str, RuntimeFactory]:
    """emulated, vllm and sglang always; torch when it is installed."""
    runtimes: dict[str, RuntimeFactory] = {"emulated": emulated or EmulatedConfig()}
    ext = external or ExternalConfig()
    runtimes["vllm"] = ext
    runtimes["sglang"] = ext
    if torch_available():
        runtimes["torch"] = _LazyTorch(**dict(torch_config or {}))
    return runtimes


def build_host(
    emulated: int = 0, gpu_memory_mib: int = 80 * 1024, *, node: str = "local",
    bandwidth_gbps: float | None = None, reserve_mib: int | None = None, **host_kwargs: Any,
) -> tuple[GpuHost, str | None]:
    """A host for this node and, when it has no GPUs, why. ``emulated > 0`` never touches NVML."""
    gpus: list[GpuInfo]
    reason: str | None = None
    emu = EmulatedConfig() if bandwidth_gbps is None else EmulatedConfig(bandwidth_gbps=bandwidth_gbps)
    if emulated > 0:
        gpus = emulated_gpus(emulated, gpu_memory_mib, node=node)
        reserve = reserve_mib or 0
    else:
        gpus, reason = nvml.discover()
        if not gpus and reason is None:
            reason = "NVML finds no GPU"
        reserve = 1024 if reserve_mib is None else reserve_mib  # CUDA context and allocator slack
        host_kwargs.setdefault("device_memory", nvml.device_memory)
    host = GpuHost(gpus, default_runtimes(emu), reserve_mib=reserve, **host_kwargs)
    return host, reason
