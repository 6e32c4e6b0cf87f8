"""Real-GPU checks (``-m gpu``): NVML discovery by UUID, pinned restore bandwidth and memory release.

Skipped, with the reason, where NVML finds no device. Figures are printed (run with ``-s`` or read the log).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from agent.gpu import GpuHost, ServiceSpec, build_host, nvml

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

GPUS, REASON = nvml.discover()
if not GPUS:
    pytest.skip(f"no NVML device: {REASON}", allow_module_level=True)

RESTORE_MIB = 4096  # 4 GiB state dict: in the 2-8 GiB range, a few seconds to build and pin


def test_discovery_by_uuid() -> None:
    uuids = [g.uuid for g in GPUS]
    assert len(set(uuids)) == len(uuids) and all(u.startswith(("GPU-", "MIG-")) for u in uuids)
    for g in GPUS:
        assert g.memory_total_mib > 1024 and g.name
        used = nvml.memory_used_mib(g.uuid)
        assert used is not None and 0 <= used <= g.memory_total_mib
        print(f"GPU {g.index} {g.uuid} {g.name} {g.memory_total_mib} MiB total, {used} MiB used, "
              f"bus {g.pci_bus_id}, {len(g.cpus)} local CPUs")
    host, reason = build_host()
    assert reason is None and [g["uuid"] for g in host.facts()["gpus"]] == uuids


def test_torch_sees_the_same_devices_by_uuid() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from agent.gpu.torch_module import cuda_ordinal

    for g in GPUS[: torch.cuda.device_count()]:
        i = cuda_ordinal(g)
        assert 0 <= i < torch.cuda.device_count()
        assert torch.cuda.get_device_name(i) == g.name or g.name in torch.cuda.get_device_name(i)


def _settle(uuid: str, since_mib: int, deadline_s: float = 5.0) -> int:
    """NVML used MiB once it stops falling (the allocator frees asynchronously), bounded."""
    last, end = nvml.memory_used_mib(uuid) or 0, time.monotonic() + deadline_s
    while time.monotonic() < end and last > since_mib:
        time.sleep(0.05)
        now = nvml.memory_used_mib(uuid) or 0
        if now >= last:
            break
        last = now
    return last


def _raw_pinned_gbps(torch, dev, mib: int) -> float:
    """Best of 3 plain pinned host->device copies of ``mib`` MiB: the line rate to compare restores with."""
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    del host, dst
    torch.cuda.empty_cache()
    return (mib << 20) / best / 1e9


async def test_torch_pinned_restore_bandwidth_and_memory_returns() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from agent.gpu.torch_module import TorchConfig, cuda_ordinal

    gpu = GPUS[0]
    dev = torch.device("cuda", cuda_ordinal(gpu))
    torch.empty(1, device=dev)  # create the CUDA context first so it is not counted as restore memory
    torch.cuda.synchronize(dev)
    host = GpuHost([gpu], {"torch": TorchConfig()}, reserve_mib=1024, device_memory=nvml.device_memory)
    spec = ServiceSpec("blob", "torch", "agent.gpu.demo_services:blob", gpu_mem_mib=RESTORE_MIB + 512,
                       options={"factory_kwargs": {"mib": RESTORE_MIB, "tensors": 16}})
    await host.prepare("blob", spec)
    rt = host._services["blob"].runtime
    assert rt.host_pinned
    raw_gbps = _raw_pinned_gbps(torch, dev, 1024)
    base = _settle(gpu.uuid, 0)
    assert base is not None
    results = []
    for _ in range(2):
        res = await host.load("blob", 0, 1)
        stats = dict(rt.last_load)
        loaded = nvml.memory_used_mib(gpu.uuid) or 0
        await host.evict("blob", 0, 1)
        after = _settle(gpu.uuid, base)
        results.append((res, loaded, after, rt.last_evict))
        print(f"restore {res.bytes / 2**30:.2f} GiB in {res.seconds:.3f} s = {res.bandwidth_gbps:.1f} GB/s "
              f"(raw pinned copy {raw_gbps:.1f} GB/s); NVML used MiB: before {base}, loaded {loaded}, "
              f"after evict {after}; breakdown {stats}; evict {rt.last_evict}")
    for res, loaded, after, evicted in results:
        assert res.restored and res.bytes == RESTORE_MIB * 2**20
        assert loaded - base >= RESTORE_MIB * 0.95  # the weights really were on the device
        assert evicted["freed_bytes"] >= res.bytes  # the allocator let go of the whole flat buffer
        assert after - base < 128, f"evict left {after - base} MiB on the GPU"  # and NVML sees it back
        assert res.bandwidth_gbps > 0.5 * raw_gbps  # one flat pinned copy: near the H2D line rate
    out = await host.invoke("blob", 0, 1, {"input": [1.0]}, timeout_s=60)  # reloads by itself
    assert out["output"][0] == pytest.approx(1.0 + 16 * 8.0)
    await host.aclose()


async def test_two_gpu_chunk_and_parallel_restores() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or len(GPUS) < 2 or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from agent.gpu.torch_module import TorchConfig

    host = GpuHost(GPUS[:2], {"torch": TorchConfig()}, reserve_mib=1024)
    for name in ("a", "b"):
        await host.prepare(name, ServiceSpec(name, "torch", "agent.gpu.demo_services:blob", gpu_mem_mib=2048,
                                             options={"factory_kwargs": {"mib": 1024, "tensors": 8}}))
    t0 = time.perf_counter()
    ra, rb = await asyncio.gather(host.load("a", 0, 1), host.load("b", 1, 2))
    print(f"parallel restores on 2 GPUs: {ra.bandwidth_gbps:.1f} + {rb.bandwidth_gbps:.1f} GB/s, "
          f"wall {time.perf_counter() - t0:.3f} s")
    pair = await host.load("a", 0, 2)  # a 2-GPU chunk: module on the first GPU
    assert pair.restored
    await host.evict("a", 0, 2)
    await host.aclose()
