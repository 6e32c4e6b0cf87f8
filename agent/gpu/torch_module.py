"""Torch runtime: an ``nn.Module`` in this process, its tensors backed up in ONE flat pinned host buffer.

Import this module only where torch exists (``agent.gpu.runtimes`` does it lazily).

* ``spec.model``: ``"package.module:factory"`` (called with ``options["factory_kwargs"]``, returns an
  ``nn.Module``), or a local file. A file is read with ``torch.load(weights_only=True)``; a state dict
  then needs ``options["factory"]`` for the architecture. A whole pickled module is refused unless
  ``options["trust_pickle"] = True`` (unpickling runs code; only for files you wrote).
* ``prepare``: builds the module on the CPU and packs every parameter and buffer (non-persistent buffers
  too; tied parameters once) back to back, each at a 256-byte aligned offset, into one contiguous
  ``uint8`` host tensor, page-locked in place with ``cudaHostRegister`` when CUDA is available (exact size;
  ``pin_memory()`` as a fallback). The module's tensors are replaced by ``meta`` tensors (the skeleton),
  so the host holds exactly one copy. The CUDA context is created here, outside any timed load.
* ``load``: (untimed: CUDA context and allocator warm-up once per device, a copy of the skeleton, one
  ``torch.empty(total, uint8)`` on the device), then, timed: ONE ``copy_(flat, non_blocking=True)`` of the
  whole buffer, the module's parameters and buffers pointed at dtype/shape views of the device buffer,
  one ``synchronize``. ``LoadResult.seconds`` is that copy + view setup; ``last_load`` has the breakdown
  (``warm_s``, ``skeleton_s``, ``alloc_s``, ``copy_s``, ``total_s``).
* Multi-GPU chunks: the module goes on the *first* GPU of the chunk; tensor-parallel sharding is out of
  scope (the other GPUs are held for the call but unused).
* ``evict``: strips the device views out of the module, drops the module and the flat device buffer
  (nothing else holds them), ``synchronize`` + ``torch.cuda.empty_cache()``; if the allocator still holds
  the bytes (a reference cycle), ``gc.collect()`` and empty the cache again. No write-back.
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
import gc
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import GpuInfo, GpuOutOfMemory, LoadResult, PrepareFailed, ServiceSpec, import_object

ALIGN = 256  # bytes; every tensor starts at a multiple of this in the flat buffers


@dataclass(frozen=True)
class TorchConfig:
    """Factory for :class:`TorchRuntime`; ``device="cpu"`` forces CPU placement (tests)."""

    device: str = "cuda"
    pin: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self, spec: ServiceSpec) -> TorchRuntime:
        return TorchRuntime(spec, self)


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class _Entry:
    """One distinct tensor in the flat buffer, and every module slot that holds it."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    is_param: bool
    slots: tuple[tuple[str, str], ...]  # (submodule path, attribute name)


def _view(flat: torch.Tensor, e: _Entry) -> torch.Tensor:
    return flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


class _HostBuffer:
    """A flat ``uint8`` host tensor, page-locked in place (``cudaHostRegister``) or a ``pin_memory`` copy."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.registered = False
        tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if pin:
            try:
                cudart = torch.cuda.cudart()
                rc = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 1))  # 1: portable
                self.registered = rc == 0
                if not self.registered and hasattr(cudart, "cudaGetLastError"):
                    cudart.cudaGetLastError()  # do not leave the failure for a later CUDA check to report
            except (RuntimeError, AssertionError, AttributeError, TypeError):
                self.registered = False
            if not self.registered:  # fallback: the caching host allocator (rounds up to a power of two)
                tensor = tensor.pin_memory()
        self.tensor: torch.Tensor | None = tensor

    @property
    def pinned(self) -> bool:
        return self.tensor is not None and (self.registered or self.tensor.is_pinned())

    def release(self) -> None:
        """Unregisters (the caller dropped every view first) and drops the host memory."""
        if self.registered:
            self.registered = False
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[union-attr]
        self.tensor = None

    def __del__(self) -> None:  # unregister before the memory goes back to malloc
        with contextlib.suppress(Exception):
            self.release()


@dataclass
class _Placement:
    module: torch.nn.Module
    flat: torch.Tensor  # the device buffer every parameter and buffer of ``module`` views
    device: torch.device


_warm_lock = threading.Lock()
_warm_devices: set[int] = set()


def warm_cuda(device: torch.device) -> float:
    """Creates the CUDA context on ``device`` and warms the allocator and the H2D copy path, once per
    device per process; returns the seconds it took (0.0 when already warm)."""
    if device.type != "cuda":
        return 0.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _warm_lock:
        if index in _warm_devices:
            return 0.0
        t0 = time.perf_counter()
        with torch.cuda.device(index):
            src = torch.ones(ALIGN, dtype=torch.uint8).pin_memory()
            dst = torch.empty(ALIGN, dtype=torch.uint8, device=device)
            dst.copy_(src, non_blocking=True)
            dst.view(torch.float32).view(8, 8)
            torch.cuda.synchronize(index)
            del src, dst
        _warm_devices.add(index)
        return time.perf_counter() - t0


class TorchRuntime:
    def __init__(self, spec: ServiceSpec, config: TorchConfig | None = None) -> None:
        self.spec = spec
        self.config = config or TorchConfig()
        self.device_kind = str(spec.options.get("device", self.config.device))
        if self.device_kind not in ("cuda", "cpu"):
            raise ValueError(f"service {spec.name}: device must be 'cuda' or 'cpu', got {self.device_kind!r}")
        self._skeleton: torch.nn.Module | None = None
        self._buffer: _HostBuffer | None = None
        self._entries: dict[str, _Entry] = {}
        self._host: dict[str, torch.Tensor] = {}  # name -> view into the flat host buffer (no extra memory)
        self._total = 0  # flat buffer size, with alignment padding
        self._placed: dict[tuple[int, ...], _Placement] = {}
        self._call_fn: Callable[..., Any] | None = None
        self.prepare_warm_s = 0.0
        self.last_load: dict[str, Any] = {}
        self.last_evict: dict[str, Any] = {}

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
        cuda = self.device_kind == "cuda" and torch.cuda.is_available()
        if cuda:  # the context exists before any load is timed (and before the host buffer is registered)
            self.prepare_warm_s = warm_cuda(torch.device("cuda", torch.cuda.current_device()))
        # every distinct tensor once (tied parameters share an entry), with all the slots that hold it
        order: list[int] = []
        found: dict[int, tuple[str, torch.Tensor, bool, list[tuple[str, str]]]] = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
                for key, t in table.items():
                    if t is None:
                        continue
                    if t.layout != torch.strided or t.is_quantized:
                        raise PrepareFailed(f"service {self.spec.name}: {mod_name}.{key} is a {t.layout} "
                                            "tensor; only dense tensors can be restored")
                    name = f"{mod_name}.{key}" if mod_name else key
                    if id(t) not in found:
                        order.append(id(t))
                        found[id(t)] = (name, t, is_param, [])
                    found[id(t)][3].append((mod_name, key))
        entries: dict[str, _Entry] = {}
        offset = 0
        for ident in order:
            name, t, is_param, slots = found[ident]
            nbytes = t.numel() * t.element_size()
            entries[name] = _Entry(offset, nbytes, t.dtype, tuple(t.shape), is_param, tuple(slots))
            offset = _align(offset + nbytes)
        buffer = _HostBuffer(offset, pin=self.config.pin and cuda)
        host = {}
        with torch.no_grad():
            for ident in order:
                name, t = found[ident][0], found[ident][1]
                view = _view(buffer.tensor, entries[name])
                view.copy_(t.detach())
                host[name] = view
            # the skeleton: the same module with meta tensors, so the CPU tensors are freed (one host copy)
            for ident in order:
                name, t, is_param, slots = found[ident]
                meta: torch.Tensor = torch.empty(t.shape, dtype=t.dtype, device="meta")
                if is_param:
                    meta = torch.nn.Parameter(meta, requires_grad=False)
                for mod_name, key in slots:
                    setattr(module.get_submodule(mod_name), key, meta)
        del found
        call = self.spec.options.get("call")
        self._call_fn = import_object(call) if call else None
        self._entries, self._host, self._buffer, self._total = entries, host, buffer, offset
        self._skeleton = module

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
            placement, seconds = await asyncio.to_thread(self._load_sync, device)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # the failed load's frames must not keep device memory
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise GpuOutOfMemory(f"service {self.spec.name}: CUDA out of memory on {device}: {exc}",
                                     gpu=gpus[0].index) from exc
            raise
        self._placed[key] = placement
        return LoadResult(seconds, self.host_bytes)

    def _load_sync(self, device: torch.device) -> tuple[_Placement, float]:
        assert self._skeleton is not None, "not prepared"
        assert self._buffer is not None, "not prepared"
        assert self._buffer.tensor is not None, "closed"
        cuda = device.type == "cuda"
        guard = torch.cuda.device(device) if cuda else contextlib.nullcontext()
        with guard, torch.no_grad():
            t_start = time.perf_counter()
            warm_s = warm_cuda(device)
            t0 = time.perf_counter()
            module = copy.deepcopy(self._skeleton)
            t1 = time.perf_counter()
            flat = torch.empty(max(self._total, 1), dtype=torch.uint8, device=device)
            if cuda:
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()  # the timed restore: one copy, the views, one synchronize
            flat.copy_(self._buffer.tensor, non_blocking=cuda)
            mods = dict(module.named_modules(remove_duplicate=False))
            for e in self._entries.values():
                view = _view(flat, e)
                value = torch.nn.Parameter(view, requires_grad=False) if e.is_param else view
                for mod_name, key in e.slots:
                    setattr(mods[mod_name], key, value)
            del mods
            if cuda:
                torch.cuda.synchronize(device)
            t3 = time.perf_counter()
        self.last_load = {
            "device": str(device), "bytes": self.host_bytes, "flat_bytes": self._total,
            "tensors": len(self._entries), "pinned": self.host_pinned, "warm_s": warm_s,
            "skeleton_s": t1 - t0, "alloc_s": t2 - t1, "copy_s": t3 - t2, "total_s": t3 - t_start,
        }
        return _Placement(module, flat, device), t3 - t2

    async def evict(self, gpus: Sequence[GpuInfo]) -> None:
        placement = self._placed.pop(_key(gpus), None)
        if placement is None:
            return
        stats = await asyncio.to_thread(self._release, placement)
        self.last_evict = stats

    def _release(self, placement: _Placement) -> dict[str, Any]:
        """Drops every reference this runtime holds to the placement's device memory, then frees it."""
        device, nbytes = placement.device, placement.flat.numel()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)  # nothing in flight may still use the buffer
            before = torch.cuda.memory_allocated(device)
        _strip(placement.module, self._entries.values())
        placement.module = placement.flat = None  # type: ignore[assignment]
        del placement
        stats: dict[str, Any] = {"device": str(device), "bytes": nbytes, "gc": False}
        if cuda:
            with torch.cuda.device(device):
                if before - torch.cuda.memory_allocated(device) < nbytes:
                    gc.collect()  # a reference cycle (a module caching device tensors) holds the buffer
                    stats["gc"] = True
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
            stats["freed_bytes"] = before - torch.cuda.memory_allocated(device)
        return stats

    # ---- call

    async def call(self, gpus: Sequence[GpuInfo], payload: dict[str, Any]) -> dict[str, Any]:
        placement = self._placed[_key(gpus)]
        module, device = placement.module, placement.device
        del placement
        try:
            result = await asyncio.to_thread(self._call_sync, module, device, payload)
        except BaseException as exc:
            # a traceback keeps every frame's locals (the module, the call's device tensors) alive for as
            # long as someone holds the error; clear them so an evict really frees the GPU memory
            del module
            traceback.clear_frames(exc.__traceback__)
            raise
        del module
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
            placement = self._placed.pop(key)
            await asyncio.to_thread(self._release, placement)
            del placement
        self._host.clear()
        self._entries = {}
        if self._buffer is not None:
            self._buffer.release()
            self._buffer = None
        self._skeleton = None

    # ---- helpers

    @property
    def host_bytes(self) -> int:
        """Bytes of parameters and buffers (alignment padding not counted)."""
        return sum(e.nbytes for e in self._entries.values())

    @property
    def host_pinned(self) -> bool:
        return self._buffer is not None and bool(self._entries) and self._buffer.pinned

    def placed_module(self, gpus: Sequence[GpuInfo]) -> torch.nn.Module | None:
        placement = self._placed.get(_key(gpus))
        return placement.module if placement else None

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


def _strip(module: torch.nn.Module | None, entries: Any) -> None:
    """Sets every restored slot back to None, so a module object that outlives the placement (a caller
    kept it) holds no device memory. ``setattr`` keeps module bookkeeping (e.g. RNN flat weights) in step."""
    if module is None:
        return
    mods = dict(module.named_modules(remove_duplicate=False))
    for e in entries:
        for mod_name, key in e.slots:
            mod = mods.get(mod_name)
            if mod is not None:
                with contextlib.suppress(Exception):
                    setattr(mod, key, None)


def _first_dtype(module: torch.nn.Module) -> torch.dtype:
    for t in module.parameters():
        return t.dtype
    return torch.float32


def _key(gpus: Sequence[GpuInfo]) -> tuple[int, ...]:
    return tuple(g.index for g in gpus)
