"""Restore-bandwidth bench: pinned and pageable host->device copies, and a full torch-runtime restore.

``python -m agent.gpu.bench [--sizes-mib 256,1024,4096] [--device 0] [--json]``. Needs torch with CUDA;
prints one line per measurement (best of ``--repeat``), to compare with docs/gpu.md, "emulated" (≈53-57
GB/s pinned on PCIe Gen5 x16, ≈25 GB/s on Gen4, pageable a few GB/s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from .base import ServiceSpec
from .host import GpuHost
from .nvml import discover, memory_used_mib

MiB = 1 << 20


def copy_gbps(torch: Any, size_mib: int, device: Any, pinned: bool, repeat: int) -> float:
    host = torch.empty(size_mib * MiB, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    dev = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del dev, host
    torch.cuda.empty_cache()
    return size_mib * MiB / best / 1e9


async def runtime_restore(size_mib: int, device_index: int) -> dict[str, Any]:
    """prepare + load + evict of a ``size_mib`` blob module through GpuHost and the torch runtime."""
    from .torch_module import TorchConfig  # torch is optional: main() checks it before this runs

    gpus, reason = discover()
    if not gpus:
        raise RuntimeError(reason or "no GPU")
    gpu = gpus[device_index]
    host = GpuHost([gpu], {"torch": TorchConfig()}, reserve_mib=1024)
    spec = ServiceSpec("blob", "torch", "agent.gpu.demo_services:blob", gpu_mem_mib=size_mib + 512,
                       options={"factory_kwargs": {"mib": size_mib, "tensors": 16}})
    t0 = time.perf_counter()
    await host.prepare("blob", spec)  # also creates the CUDA context, so `before` already includes it
    prepare_s = time.perf_counter() - t0
    runtime = host._services["blob"].runtime
    before = memory_used_mib(gpu.uuid)
    res = await host.load("blob", 0, 1)
    load_stats = dict(runtime.last_load)
    loaded = memory_used_mib(gpu.uuid)
    await host.evict("blob", 0, 1)
    after = _settled(memory_used_mib, gpu.uuid, before)
    evict_stats = dict(runtime.last_evict)
    again = await host.load("blob", 0, 1)  # a second restore: nothing left to warm
    await host.evict("blob", 0, 1)
    pinned = runtime.host_pinned
    await host.aclose()
    return {"size_mib": size_mib, "prepare_s": round(prepare_s, 3), "load_s": round(res.seconds, 4),
            "gbps": round(res.bandwidth_gbps, 2), "pinned": pinned, "nvml_before_mib": before,
            "nvml_loaded_mib": loaded, "nvml_after_evict_mib": after,
            "prepare_warm_s": round(runtime.prepare_warm_s, 4),
            "load_breakdown_s": {k: round(v, 4) for k, v in load_stats.items() if k.endswith("_s")},
            "second_load_s": round(again.seconds, 4), "second_gbps": round(again.bandwidth_gbps, 2),
            "evict": evict_stats}


def _settled(probe: Any, uuid: str, floor: Any, deadline_s: float = 3.0) -> Any:
    """NVML used MiB once it stops falling toward ``floor`` (frees can land a moment later), bounded."""
    last, end = probe(uuid), time.monotonic() + deadline_s
    while last is not None and floor is not None and last > floor and time.monotonic() < end:
        time.sleep(0.05)
        now = probe(uuid)
        if now is None or now >= last:
            break
        last = now
    return last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="256,1024,4096")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runtime-mib", type=int, default=2048, help="GpuHost restore size (0: skip)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        import torch  # optional (the gpu extra): a missing torch is reported, not a traceback
    except ImportError:
        print("bench: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench: CUDA is not available to torch", file=sys.stderr)
        return 2
    device = torch.device("cuda", args.device)
    rows: list[dict[str, Any]] = []
    torch.cuda.init()
    print(f"device {args.device}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for size in (int(s) for s in args.sizes_mib.split(",") if s):
        for pinned in (True, False) if size <= 1024 else (True,):
            gbps = copy_gbps(torch, size, device, pinned, args.repeat)
            rows.append({"what": "h2d", "size_mib": size, "pinned": pinned, "gbps": round(gbps, 2)})
            print(f"h2d {'pinned  ' if pinned else 'pageable'} {size:>6} MiB: {gbps:6.2f} GB/s")
    if args.runtime_mib > 0:
        row = asyncio.run(runtime_restore(args.runtime_mib, args.device))
        rows.append({"what": "torch-runtime-restore", **row})
        print(f"torch runtime restore {row['size_mib']} MiB: {row['load_s']} s = {row['gbps']} GB/s "
              f"(pinned={row['pinned']}; NVML used MiB before/loaded/after evict: "
              f"{row['nvml_before_mib']}/{row['nvml_loaded_mib']}/{row['nvml_after_evict_mib']})")
        b, ev = row["load_breakdown_s"], row["evict"]
        print(f"  restore breakdown s: copy+views {b.get('copy_s')} (timed), alloc {b.get('alloc_s')}, "
              f"skeleton {b.get('skeleton_s')}, warm-up {b.get('warm_s')} (+{row['prepare_warm_s']} at "
              f"prepare), total {b.get('total_s')}; second restore {row['second_load_s']} s = "
              f"{row['second_gbps']} GB/s; evict freed {ev.get('freed_bytes', 0) >> 20} MiB "
              f"(gc={ev.get('gc')})")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
