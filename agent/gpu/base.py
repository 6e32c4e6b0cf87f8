"""Shared GPU-service types: devices, service specs, load results, the runtime interface and typed errors.

Error tree (every error has ``hint`` and ``retryable``)::

    GpuError
    ├── UnknownService      invoke/load/evict of a service that was never prepared
    ├── SpecMismatch        prepare again with a different spec
    ├── BadChunk            [start, end) outside the node's GPUs, or empty
    ├── GpuOutOfMemory      the load would exceed a GPU's budget (the host never evicts for you)
    ├── GpuUnhealthy        the GPU failed too many times in a row
    ├── LoadFailed          the runtime could not restore the service (traceback in ``detail``)
    │   └── PrepareFailed   the host backup could not be built
    ├── EvictFailed         the runtime could not free the memory (state unchanged; retry)
    ├── ServiceError        the service function raised (traceback in ``detail``)
    ├── CallTimeout         the call passed its ``timeout_s`` (the GPU stays held until the work ends)
    └── HostClosed          the host is shutting down (``aclose``)
"""
from __future__ import annotations

import importlib
import re
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

MiB = 1 << 20
GiB = 1 << 30
RUNTIMES = ("emulated", "torch", "vllm", "sglang")
RuntimeName = Literal["emulated", "torch", "vllm", "sglang"]
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,127}$")

Chunk = tuple[int, int]


class GpuError(Exception):
    """Base of GPU-service errors. ``detail`` carries a traceback or a longer explanation."""

    hint = ""
    retryable = False

    def __init__(self, message: str, *, detail: str = "", hint: str = "") -> None:
        super().__init__(message)
        self.detail = detail
        if hint:
            self.hint = hint


class UnknownService(GpuError):
    hint = "send Prepare with the service spec first"


class SpecMismatch(GpuError):
    hint = "a service name is bound to one spec; use a new name for a new spec"


class BadChunk(GpuError, ValueError):
    hint = "a chunk is [start, end) with 0 <= start < end <= number of GPUs"


class GpuOutOfMemory(GpuError):
    hint = "evict services from these GPUs first (eviction policy is the controller's job)"
    retryable = True

    def __init__(self, message: str, *, gpu: int = -1, need_mib: int = 0, used_mib: int = 0,
                 budget_mib: int = 0, detail: str = "") -> None:
        super().__init__(message, detail=detail)
        self.gpu, self.need_mib, self.used_mib, self.budget_mib = gpu, need_mib, used_mib, budget_mib


class GpuUnhealthy(GpuError):
    hint = "the GPU failed repeatedly; check the driver (nvidia-smi) and restart the agent"


class LoadFailed(GpuError):
    hint = "check the service's model path and runtime options"
    retryable = True


class PrepareFailed(LoadFailed):
    hint = "check that the model import path or file exists on this node and fits in host memory"


class EvictFailed(GpuError):
    hint = "the memory was not released in time; evict again or restart the service"
    retryable = True


class ServiceError(GpuError):
    hint = "the service function raised; its traceback is in `detail`"


class CallTimeout(GpuError):
    hint = "raise timeout_s, or make the service faster; the GPU stays busy until the call ends"
    retryable = True


class HostClosed(GpuError):
    hint = "the agent is stopping; the controller resends elsewhere"
    retryable = True


def format_exc(exc: BaseException) -> str:
    """The full traceback text of ``exc``."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@dataclass(frozen=True)
class GpuInfo:
    """One device of the node. ``index`` is the NVML index (or the emulated index); memory in MiB."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int = 0
    cpus: tuple[int, ...] = ()
    pci_bus_id: str = ""
    emulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name,
            "memory_total_mib": self.memory_total_mib, "memory_used_mib": self.memory_used_mib,
            "cpus": list(self.cpus), "pci_bus_id": self.pci_bus_id, "emulated": self.emulated,
        }


def emulated_gpus(count: int, memory_mib: int = 80 * 1024, node: str = "local") -> list[GpuInfo]:
    """``count`` emulated devices of ``memory_mib`` each (e.g. ``emulated_gpus(8, 80 * 1024)``)."""
    if count < 0 or memory_mib <= 0:
        raise ValueError(f"need count >= 0 and memory_mib > 0, got {count}, {memory_mib}")
    return [
        GpuInfo(index=i, uuid=f"EMU-{node}-{i}", name="Emulated GPU", memory_total_mib=memory_mib,
                emulated=True)
        for i in range(count)
    ]


@dataclass(frozen=True)
class ServiceSpec:
    """One GPU service (each chunk size of a service is its own service to the scheduler).

    ``gpu_mem_mib`` is the footprint on *each* GPU of a chunk (the host charges it on every GPU).
    ``weight_bytes`` is what a restore copies; 0 means ``host_mem_mib`` MiB, else ``gpu_mem_mib`` MiB.
    ``model``: emulated -> ``"package.module:function"`` (payload dict -> result dict); torch ->
    ``"package.module:factory"`` or a local file (see ``agent.gpu.torch_module``); vllm/sglang -> the model
    name the server serves (the server's URL is in ``options["url"]``).
    """

    name: str
    runtime: RuntimeName
    model: str
    gpu_mem_mib: int
    host_mem_mib: int = 0
    weight_bytes: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"invalid service name {self.name!r}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"service {self.name!r} needs a model")
        for key in ("gpu_mem_mib", "host_mem_mib", "weight_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
        if not isinstance(self.options, Mapping):
            raise TypeError("options must be a mapping")

    @property
    def restore_bytes(self) -> int:
        """Bytes a restore moves from host memory to each GPU."""
        return self.weight_bytes or self.host_mem_mib * MiB or self.gpu_mem_mib * MiB

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> ServiceSpec:
        """From the Prepare message's ``spec`` map (unknown keys are refused)."""
        known = {"runtime", "model", "gpu_mem_mib", "host_mem_mib", "weight_bytes", "options", "name"}
        extra = sorted(set(raw) - known)
        if extra:
            raise ValueError(f"unknown service spec keys {extra}; known: {sorted(known)}")
        if raw.get("name", name) != name:
            raise ValueError(f"spec name {raw.get('name')!r} differs from service {name!r}")
        args = {k: v for k, v in raw.items() if k != "name"}
        return cls(name=name, **args)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime, "model": self.model, "gpu_mem_mib": self.gpu_mem_mib,
            "host_mem_mib": self.host_mem_mib, "weight_bytes": self.weight_bytes,
            "options": dict(self.options),
        }


@dataclass(frozen=True)
class LoadResult:
    """A restore: wall seconds and bytes moved per GPU; ``restored`` is False when it was already resident."""

    seconds: float
    bytes: int
    restored: bool = True

    @property
    def bandwidth_gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@runtime_checkable
class Runtime(Protocol):
    """One service's runtime on one node: a host backup and zero or more GPU placements.

    Rules: ``prepare`` is called once before anything else; ``load``/``evict``/``call`` for one placement
    (the chunk's ``GpuInfo`` tuple) are never concurrent (the host serializes them); ``evict`` of a placement
    that is not loaded is a no-op; ``close`` drops everything, host backup included.
    """

    async def prepare(self) -> int:
        """Build the host backup; returns its size in bytes."""
        ...

    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult: ...

    async def evict(self, gpus: Sequence[GpuInfo]) -> None: ...

    async def call(self, gpus: Sequence[GpuInfo], payload: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class RuntimeFactory(Protocol):
    def __call__(self, spec: ServiceSpec) -> Runtime: ...


def import_object(path: str) -> Any:
    """``"package.module:attr"`` -> the object (raises ImportError/AttributeError/ValueError)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected 'package.module:name', got {path!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
