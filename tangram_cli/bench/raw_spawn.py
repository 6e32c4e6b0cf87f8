"""The raw spawn baselines of `tangram bench dispatch` (docs/performance.md, "raw spawn"): an asyncio
loop spawning `taskset -c N true` with the cores in turn, and plain `os.posix_spawn`s reaped through
pidfds, both at the clients' concurrency; measured before any daemon starts."""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import subprocess
import time
from typing import Any

from tangram_cli.bench.procs import pct


def pct_or_nan(values: list[float], q: float) -> float:
    """``procs.pct`` (the nearest-rank q-quantile), NaN instead of None when empty."""
    v = pct(values, q)
    return float("nan") if v is None else v


def cores_of(cpus: str) -> list[int]:
    """The cores of a cpuset list such as ``0-1,4`` (``[0]`` for an empty one)."""
    out: list[int] = []
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out or [0]


def default_cpus() -> str:
    """The benches' default cores for their agent (and the floor's actions): 0-1, or 0 on one core."""
    return "0-1" if len(os.sched_getaffinity(0)) >= 2 else "0"


def _spawn_argv(core: int) -> list[str]:
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(core), "true"] if taskset else ["true"]


async def raw_spawn_asyncio(n: int, concurrency: int, cpus: str) -> dict[str, Any]:
    """`n` spawns of `taskset -c N true` from `concurrency` asyncio workers; rate and latency."""
    cores, latency = cores_of(cpus), []
    argvs = [_spawn_argv(c) for c in cores]
    left = iter(range(n))

    async def worker() -> None:
        for i in left:
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                *argvs[i % len(argvs)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
            await proc.wait()
            latency.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    wall = time.perf_counter() - t0
    return {"actions_per_s": n / wall, "p50_ms": pct_or_nan(latency, 0.5) * 1e3, "cmd": " ".join(argvs[0])}


def raw_posix_spawn(n: int, concurrency: int, cpus: str) -> dict[str, Any]:
    """`n` `os.posix_spawn`s of `taskset -c N true`, `concurrency` in flight, reaped via pidfds."""
    argvs = [_spawn_argv(c) for c in cores_of(cpus)]
    env = dict(os.environ)
    poller = select.poll()
    running: dict[int, tuple[int, float]] = {}  # pidfd -> (pid, start)
    latency: list[float] = []
    started = 0
    t0 = time.perf_counter()
    while started < n or running:
        while started < n and len(running) < max(1, concurrency):
            argv = argvs[started % len(argvs)]
            t = time.perf_counter()
            pid = os.posix_spawn(argv[0], argv, env)
            fd = os.pidfd_open(pid)
            poller.register(fd, select.POLLIN)
            running[fd] = (pid, t)
            started += 1
        for fd, _ in poller.poll(1000):
            pid, t = running.pop(fd)
            os.waitpid(pid, 0)
            latency.append(time.perf_counter() - t)
            poller.unregister(fd)
            os.close(fd)
    wall = time.perf_counter() - t0
    return {"actions_per_s": n / wall, "p50_ms": pct_or_nan(latency, 0.5) * 1e3}


async def raw_baselines(n: int, concurrency: int, cpus: str) -> dict[str, Any]:
    """Both baselines at the clients' concurrency, as the dispatch row's `raw_*` figures."""
    a = await raw_spawn_asyncio(n, concurrency, cpus)
    out = {
        "raw_spawn_cmd": a["cmd"],
        "raw_spawn_actions_per_s": a["actions_per_s"],
        "raw_spawn_p50_ms": a["p50_ms"],
    }
    if hasattr(os, "pidfd_open") and hasattr(os, "posix_spawn"):
        b = raw_posix_spawn(n, concurrency, cpus)
        out.update(raw_posix_spawn_actions_per_s=b["actions_per_s"], raw_posix_spawn_p50_ms=b["p50_ms"])
    return out
