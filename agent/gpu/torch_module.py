"""Torch runtime: an ``nn.Module`` in this process, its tensors backed up in pinned host memory.

Import this module only where torch exists (``agent.gpu.runtimes`` does it lazily).

* ``spec.model``: ``"package.module:factory"`` (called with ``options["factory_kwargs"]``, returns an
  ``nn.Module``), or a local file. A file is read with ``torch.load(weights_only=True)``; a state dict
  then needs ``options["factory"]`` for the architecture. A whole pickled module is refused unless
  ``options["trust_pickle"] = True`` (unpickling runs code; only for files you wrote).
* ``prepare``: builds the module on the CPU, moves every parameter and buffer (non-persistent buffers
  too) into pinned host tensors (``pin_memory()`` when CUDA is available) and keeps the module skeleton on
  the ``meta`` device, so the host holds exactly one copy.
* ``load``: skeleton -> ``to_empty(device)``, then ``copy_(pinned, non_blocking=True)`` per tensor and one
  ``synchronize``; ``LoadResult`` has the wall seconds and bytes (so bandwidth = bytes / seconds).
* Multi-GPU chunks: the module goes on the *first* GPU of the chunk; tensor-parallel sharding is out of
  scope (the other GPUs are held for the call but unused).
* ``evict``: drops the device module, then ``torch.cuda.empty_cache()``; no write-back.
* ``call``: under ``torch.inference_mode()``: ``options["call"] = "package.module:fn"`` gets
  ``fn(module, payload, device) -> dict``; the default takes ``payload["input"]`` (nested lists) and
  returns ``{"output": module(tensor).tolist()}``.
* ``options["device"] = "cpu"`` places "GPU" copies in CPU memory (for tests without CUDA).
* Devices are matched by UUID (``torch.cuda.get_device_properties(i).uuid``) so CUDA's ordinal order does
  not matter; without a match the NVML index is used (set ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import GpuInfo, GpuOutOfMemory, LoadResult, PrepareFailed, ServiceSpec, import_object


@dataclass(frozen=True)
class TorchConfig:
    """Factory for :class:`TorchRuntime`; ``device="cpu"`` forces CPU placement (tests)."""

    device: str = "cuda"
    pin: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self, spec: ServiceSpec) -> TorchRuntime:
        return TorchRuntime(spec, self)


def _named_tensors(module: torch.nn.Module) -> Any:
    return itertools.chain(module.named_parameters(), module.named_buffers())


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class TorchRuntime:
    def __init__(self, spec: ServiceSpec, config: TorchConfig | None = None) -> None:
        self.spec = spec
        self.config = config or TorchConfig()
        self.device_kind = str(spec.options.get("device", self.config.device))
        if self.device_kind not in ("cuda", "cpu"):
            raise ValueError(f"service {spec.name}: device must be 'cuda' or 'cpu', got {self.device_kind!r}")
        self._skeleton: torch.nn.Module | None = None
        self._host: dict[str, torch.Tensor] = {}
        self._placed: dict[tuple[int, ...], tuple[torch.nn.Module, torch.device]] = {}
        self._call_fn: Callable[..., Any] | None = None

    # ---- prepare

    async def prepare(self) -> int:
        if self._skeleton is None:
            await asyncio.to_thread(self._prepare_sync)
        return self.host_bytes

    def _prepare_sync(self) -> None:
        module = self._build()
        if not isinstance(module, torch.nn.Module):
            kind = type(module).__name__
            raise PrepareFailed(f"service {self.spec.name}: the model is a {kind}, not nn.Module")
        module.eval().requires_grad_(False)
        pin = self.config.pin and torch.cuda.is_available()
        host = {}
        for name, t in _named_tensors(module):
            t = t.detach().to("cpu").contiguous()
            host[name] = t.pin_memory() if pin else t.clone()
        call = self.spec.options.get("call")
        self._call_fn = import_object(call) if call else None
        self._skeleton = module.to("meta")
        self._host = host

    def _build(self) -> Any:
        model, opts = self.spec.model, self.spec.options
        kwargs = dict(opts.get("factory_kwargs", {}))
        if ":" in model and not os.path.exists(model):
            return import_object(model)(**kwargs)
        if not os.path.isfile(model):
            raise PrepareFailed(f"service {self.spec.name}: {model!r} is neither 'module:factory' nor a file")
        trusted = bool(opts.get("trust_pickle", False))
        loaded = torch.load(model, map_location="cpu", weights_only=not trusted)
        if isinstance(loaded, torch.nn.Module):
            return loaded
        if not isinstance(loaded, dict) or "factory" not in opts:
            raise PrepareFailed(
                f"service {self.spec.name}: {model!r} holds a {type(loaded).__name__}; a state dict needs "
                "options['factory'] = 'package.module:factory'"
            )
        module = import_object(str(opts["factory"]))(**kwargs)
        module.load_state_dict(loaded)
        return module

    # ---- load / evict

    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult:
        key = _key(gpus)
        if key in self._placed:
            return LoadResult(0.0, self.host_bytes, restored=False)
        device = self._device_for(gpus[0])
        try:
            module, seconds = await asyncio.to_thread(self._load_sync, device)
        except torch.cuda.OutOfMemoryError as exc:
            raise GpuOutOfMemory(f"service {self.spec.name}: CUDA out of memory on {device}: {exc}",
                                 gpu=gpus[0].index) from exc
        self._placed[key] = (module, device)
        return LoadResult(seconds, self.host_bytes)

    def _load_sync(self, device: torch.device) -> tuple[torch.nn.Module, float]:
        assert self._skeleton is not None, "not prepared"
        guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with guard, torch.no_grad():
            t0 = time.perf_counter()
            module = copy.deepcopy(self._skeleton).to_empty(device=device)
            for name, t in _named_tensors(module):
                t.copy_(self._host[name], non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return module, time.perf_counter() - t0

    async def evict(self, gpus: Sequence[GpuInfo]) -> None:
        placed = self._placed.pop(_key(gpus), None)
        if placed is None:
            return
        device = placed[1]
        del placed
        if device.type == "cuda":
            await asyncio.to_thread(_free_cuda, device)

    # ---- call

    async def call(self, gpus: Sequence[GpuInfo], payload: dict[str, Any]) -> dict[str, Any]:
        module, device = self._placed[_key(gpus)]
        result = await asyncio.to_thread(self._call_sync, module, device, payload)
        if not isinstance(result, dict):
            raise TypeError(f"service {self.spec.name} returned {type(result).__name__}, expected dict")
        return result

    def _call_sync(self, module: torch.nn.Module, device: torch.device, payload: dict[str, Any]) -> Any:
        with torch.inference_mode():
            if self._call_fn is not None:
                return self._call_fn(module, payload, device)
            x = torch.tensor(payload["input"], dtype=_first_dtype(module), device=device)
            return {"output": module(x).float().cpu().tolist()}

    async def close(self) -> None:
        for key in list(self._placed):
            placed = self._placed.pop(key)
            if placed[1].type == "cuda":
                del placed
                await asyncio.to_thread(torch.cuda.empty_cache)
        self._host.clear()
        self._skeleton = None

    # ---- helpers

    @property
    def host_bytes(self) -> int:
        return tensor_bytes(self._host.values())

    @property
    def host_pinned(self) -> bool:
        return bool(self._host) and all(t.is_pinned() for t in self._host.values())

    def placed_module(self, gpus: Sequence[GpuInfo]) -> torch.nn.Module | None:
        placed = self._placed.get(_key(gpus))
        return placed[0] if placed else None

    def _device_for(self, gpu: GpuInfo) -> torch.device:
        if self.device_kind == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available to torch in this process")
        return torch.device("cuda", cuda_ordinal(gpu))


def cuda_ordinal(gpu: GpuInfo) -> int:
    """The CUDA ordinal of this device in this process, matched by UUID when torch exposes it."""
    want = gpu.uuid.removeprefix("GPU-").lower()
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", "")).lower()
        if uuid and uuid.removeprefix("gpu-") == want:
            return i
    return gpu.index


def _free_cuda(device: torch.device) -> None:
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _first_dtype(module: torch.nn.Module) -> torch.dtype:
    for t in module.parameters():
        return t.dtype
    return torch.float32


def _key(gpus: Sequence[GpuInfo]) -> tuple[int, ...]:
    return tuple(g.index for g in gpus)
