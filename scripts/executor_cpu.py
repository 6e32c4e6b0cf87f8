"""The process executor alone: CPU per no-op action on the agent's side and in the sandboxes' spawners.

No controller, no client, no ZeroMQ: ``ProcessExecutor.run`` called straight from one asyncio loop,
``--workers`` at a time over four contained sandboxes, each action ``true`` on one core, the cores
alternating (so a sandbox's actions come back to both of them, as in ``tangram bench dispatch``).
Prints one line: actions/s, and CPU ms per action of this process (the agent's side: the executor's
Python, its cgroup and pipe calls), of the spawners, and of the actions they reaped (``/proc``).
Used to compare two trees without the noise of the whole dispatch path (docs/performance.md, ninth
round): ``PYTHONPATH=TREE python3 scripts/executor_cpu.py``. Needs root (sandboxes get their own
uid and cgroups).

    python3 scripts/executor_cpu.py [-n 4000] [--workers 4] [--cpus 0-1]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
import uuid

from agent.executors.base import RunRequest, SandboxSpec
from agent.executors.process import ProcessExecutor
from tangram.units import parse_cpulist
from tangram_cli.bench.procs import children_cpu_s, cpu_delta

SANDBOXES = 4
WARM = 50  # actions per worker before measuring: spawners started, slots made


async def measure(n: int, workers: int, cpus: str) -> str:
    cores = parse_cpulist(cpus)
    root = tempfile.mkdtemp(prefix="tangram-executor-cpu-")
    ex = ProcessExecutor(root, cpus, cluster="executor-cpu", node=f"n-{uuid.uuid4().hex[:6]}", spawner=True)
    names = [f"s{i}" for i in range(SANDBOXES)]
    try:
        for name in names:
            await ex.create_sandbox(SandboxSpec(name, "", 256))

        async def worker(i: int, k: int, tag: str) -> None:
            for j in range(k):
                core = cores[(i + j) % len(cores)]
                res = await ex.run(RunRequest(f"{tag}-{i}-{j}", names[i % SANDBOXES], "true", (core,)))
                if res.exit_code != 0:
                    raise SystemExit(f"action failed: exit {res.exit_code}: {res.stderr[:200]!r}")

        await asyncio.gather(*(worker(i, WARM, "warm") for i in range(workers)))
        per = n // workers
        # the spawners are this process's children; the actions, theirs
        r0, s0 = resource.getrusage(resource.RUSAGE_SELF), children_cpu_s(os.getpid())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, per, "a") for i in range(workers)))
        t1 = time.perf_counter()
        r1, s1 = resource.getrusage(resource.RUSAGE_SELF), children_cpu_s(os.getpid())
        done = per * workers
        agent = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / done * 1e3
        spawn, acts = (s / done * 1e3 for s in cpu_delta(s0, s1))
        return (f"{done / (t1 - t0):.0f} actions/s; CPU ms per action: agent side {agent:.3f}, "
                f"spawners {spawn:.3f}, actions {acts:.3f} ({done} actions, {workers} at a time)")
    finally:
        await ex.close()
        for name in await ex.list_sandboxes():
            await ex.destroy_sandbox(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4000, help="actions measured (default 4000)")
    ap.add_argument("--workers", type=int, default=4, help="actions at a time (default 4)")
    ap.add_argument("--cpus", default="0-1", help="cores handed out (default 0-1)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root: contained sandboxes get their own uid and cgroups", file=sys.stderr)
        return 2
    print(asyncio.run(measure(args.n, args.workers, args.cpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
