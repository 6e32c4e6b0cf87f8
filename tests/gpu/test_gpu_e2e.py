"""The whole real path on a CUDA machine (``-m gpu``): client -> in-process controller -> a real agent
subprocess that finds the GPU through NVML and hosts two torch services on it.

* ``blob_a`` (1.5 GiB, ``agent.gpu.demo_services:blob``): the first call restores it (``loaded``), the
  forward runs on the GPU and its value is checked; the second call finds it resident (not ``loaded``,
  faster); NVML used memory rose by about its size.
* ``blob_b`` (1 GiB): both services declare ``gpu_mem_mib`` = 60 % of the GPU, so they cannot be
  resident together: the controller's core must Evict ``blob_a`` and Load ``blob_b`` (``loaded``), and
  NVML used memory stays at one service. Then ``blob_a`` again (the core evicts ``blob_b``).

Figures (restore seconds and GB/s from the agent's log, call times, NVML MiB) are printed: run with
``-s``. Skipped, with the reason, without NVML devices (the ``gpu`` marker) or without torch + CUDA.
Bounded: every step has a timeout, the whole scenario 110 s, and the agent process is always stopped.
No CPU variant: the agent has no option that forces its torch runtime onto the CPU (with
``--emulated-gpus`` it offers only the emulated runtime), and without GPUs it hosts no services.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.agents import start_agent, stop_process

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(150)]

SIZES_MIB = {"blob_a": 1536, "blob_b": 1024}  # real bytes restored (bfloat16 parameters)
TENSORS = {"blob_a": 8, "blob_b": 4}  # blob's forward: x + 8 * tensors
SLACK_MIB = 256  # NVML used memory beyond the weights (allocator blocks, the call's tensors)
RESTORED = re.compile(r"service (\S+) on GPUs (\d+)-(\d+): restored in ([0-9.]+) s")
EVICTED = re.compile(r"service (\S+) evicted from GPUs (\d+)-(\d+)")


def _torch_cuda_problem() -> str | None:
    """Why the agent could not use torch on CUDA here (checked in a child: no CUDA context in this
    process, whose NVML readings are the measurement), or None."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        rc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=90, check=False
        ).returncode
    except subprocess.TimeoutExpired:
        return "importing torch took over 90 s"
    return None if rc == 0 else ("torch has no usable CUDA" if rc == 3 else "torch is not importable")


def _config(n_gpus: int, gpu_total_mib: int) -> dict[str, Any]:
    # 60 % of a GPU each: one fits, two do not (in the core's bookkeeping and the agent host's budget)
    declared = int(gpu_total_mib * 0.6)
    services = [
        {
            "name": name,
            "runtime": "torch",
            "model": "agent.gpu.demo_services:blob",
            "gpu_mem_mib": declared,
            "chunk_sizes": [n_gpus],  # [1] on a one-GPU machine; the whole node elsewhere, so it must evict
            "load_s": 0.2,
            "t_ori": 0.05,
            "options": {"factory_kwargs": {"mib": mib, "tensors": TENSORS[name], "dtype": "bfloat16"}},
        }
        for name, mib in SIZES_MIB.items()
    ]
    return {"cluster": "gpu-e2e", "scheduler": {"client_grace_s": 30}, "services": services}


def _start_agent(addr: str, workdir: Path) -> subprocess.Popen[bytes]:
    cpus = "0-1" if len(os.sched_getaffinity(0)) >= 2 else "0"
    flags = ("--executor", "process", "--cpus", cpus, "--log-level", "INFO")
    return start_agent(addr, str(workdir), *flags, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})


def _log(workdir: Path) -> str:
    path = workdir / "agent.log"
    return path.read_text(errors="replace") if path.exists() else ""


async def _until(what: str, check: Any, within_s: float, workdir: Path, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            break
        await asyncio.sleep(0.1)
    state = f"agent exited {proc.returncode}" if proc.poll() is not None else f"not within {within_s:g} s"
    raise AssertionError(f"{what}: {state}; agent log tail:\n{_log(workdir)[-4000:]}")


async def _used_mib(uuid: str, settle_s: float = 0.0, want: Any = None) -> int:
    """NVML used MiB on the device; with ``want``, polled (bounded) until ``want(used)`` holds."""
    from agent.gpu import nvml

    deadline = time.monotonic() + settle_s
    while True:
        used = await asyncio.to_thread(nvml.memory_used_mib, uuid)
        assert used is not None, f"NVML cannot read {uuid}"
        if want is None or want(used) or time.monotonic() >= deadline:
            return used
        await asyncio.sleep(0.05)


async def _timed_call(tg: Any, service: str, x: list[float], n_gpus: int) -> tuple[Any, float]:
    t0 = time.perf_counter()
    r = await asyncio.wait_for(tg.call(service, {"input": x}, gpus=n_gpus, timeout=60), 75)
    return r, time.perf_counter() - t0


async def test_torch_services_restore_call_and_evict_through_the_controller(tmp_path: Path) -> None:
    from agent.gpu import nvml

    gpus, reason = nvml.discover()
    if not gpus:
        pytest.skip(f"no NVML device: {reason}")
    if problem := await asyncio.to_thread(_torch_cuda_problem):
        pytest.skip(problem)
    import tangram
    from tangram_cli.controller.config import parse_config
    from tangram_cli.controller.daemon import Controller, Options

    n = len(gpus)
    total = min(g.memory_total_mib for g in gpus)
    uuid = gpus[0].uuid  # the torch runtime places a chunk's module on its first GPU
    workdir = tmp_path / "agent"
    workdir.mkdir()
    c = Controller(parse_config(_config(n, total)), Options(bind="127.0.0.1"))
    c.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        async with asyncio.timeout(110):
            proc = _start_agent(c.agents_addr, workdir)
            await _until(
                "agent registers with its GPUs",
                lambda: (
                    (a := c.agents.agents.get("n1")) is not None
                    and a.live
                    and c.core.gpu.nodes.get("n1") is not None
                ),
                45,
                workdir,
                proc,
            )
            # both host backups built (and the agent's CUDA context created) before the baseline
            await _until(
                "both services prepared",
                lambda: all(f"service {s} prepared" in _log(workdir) for s in SIZES_MIB),
                60,
                workdir,
                proc,
            )
            base = await _used_mib(uuid)
            print(
                f"\nGPU {gpus[0].name} x{n}, {total} MiB; services declare {int(total * 0.6)} MiB each; "
                f"NVML used after prepare: {base} MiB"
            )

            async with tangram.AsyncClient(c.submit_addr, name="gpu-e2e", connect_timeout=10) as tg:
                # first call: restore from the pinned host copy, then a forward on the GPU
                r1, wall1 = await _timed_call(tg, "blob_a", [1.0, 2.0], n)
                assert r1.value == {"output": [65.0, 66.0]}, r1
                assert r1.loaded, r1
                assert r1.node == "n1", r1
                assert list(r1.gpus) == list(range(n)), r1
                a_mib = SIZES_MIB["blob_a"]
                used_a = await _used_mib(uuid, 3.0, lambda u: u - base >= 0.95 * a_mib)
                assert 0.95 * a_mib <= used_a - base <= a_mib + SLACK_MIB, (base, used_a)

                # second call: resident, no restore
                r2, wall2 = await _timed_call(tg, "blob_a", [3.0, 4.0], n)
                assert r2.value == {"output": [67.0, 68.0]}, r2
                assert not r2.loaded, r2
                assert wall2 < wall1, (wall1, wall2)
                assert await _used_mib(uuid) - base <= a_mib + SLACK_MIB

                # another service that does not fit beside it: the core evicts blob_a, loads blob_b
                r3, wall3 = await _timed_call(tg, "blob_b", [1.0, 2.0], n)
                assert r3.value == {"output": [33.0, 34.0]}, r3
                assert r3.loaded, r3
                b_mib = SIZES_MIB["blob_b"]
                used_b = await _used_mib(uuid, 5.0, lambda u: u - base <= b_mib + SLACK_MIB)
                assert 0.95 * b_mib <= used_b - base <= b_mib + SLACK_MIB, (base, used_a, used_b)

                # and back: blob_b goes, blob_a is restored again
                r4, wall4 = await _timed_call(tg, "blob_a", [5.0, 6.0], n)
                assert r4.value == {"output": [69.0, 70.0]}, r4
                assert r4.loaded, r4
                used_a2 = await _used_mib(uuid, 5.0, lambda u: u - base <= a_mib + SLACK_MIB)
                assert 0.95 * a_mib <= used_a2 - base <= a_mib + SLACK_MIB, (base, used_a2)

            def both_evictions_logged() -> str:
                text = _log(workdir)
                return text if len(EVICTED.findall(text)) >= 2 else ""

            log = await _until("the agent logged both evictions", both_evictions_logged, 10, workdir, proc)
            restores = [(m[0], float(m[3])) for m in RESTORED.findall(log)]
            evicts = [m[0] for m in EVICTED.findall(log)]
            assert [s for s, _ in restores] == ["blob_a", "blob_b", "blob_a"], restores
            assert evicts == ["blob_a", "blob_b"], evicts
            for (service, seconds), r in zip(restores, (r1, r3, r4), strict=True):
                gib = SIZES_MIB[service] / 1024
                rate = SIZES_MIB[service] * 2**20 / seconds / 1e9 if seconds > 0 else float("inf")
                print(
                    f"restore {service}: {gib:.2f} GiB in {seconds:.4f} s = {rate:.1f} GB/s; call "
                    f"queued {r.queued_s:.3f} s, run {r.run_s:.3f} s, overhead {r.overhead_s:.3f} s"
                )
            print(
                f"call wall s: blob_a first {wall1:.3f} (restore), second {wall2:.3f} (resident), "
                f"blob_b {wall3:.3f} (evict+restore), blob_a again {wall4:.3f}"
            )
            print(
                f"NVML used MiB over baseline {base}: blob_a {used_a - base}, blob_b (after evicting "
                f"blob_a) {used_b - base}, blob_a again {used_a2 - base}"
            )
    finally:
        if proc is not None:
            # 15 s: the agent releases its torch services and their GPU memory before it exits
            await asyncio.to_thread(stop_process, proc, 15.0)
        await asyncio.wait_for(c.stop(), 15)
    assert proc.returncode == 0, f"agent exit status {proc.returncode}; log tail:\n{_log(workdir)[-3000:]}"
