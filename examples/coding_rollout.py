"""A coding-style agentic rollout against a running Tangram cluster.

Each trajectory opens its own sandbox (state kept for the whole trajectory, cores only while a
command runs), alternates "thinking" (the LLM generating, simulated by a sleep) with short
shell commands, and ends with an elastic test run that uses `{dop}` worker processes.

Start a local cluster, point the client at it, then run this file:

    tangram up
    eval "$(tangram env)"        # TANGRAM_ADDR, TANGRAM_CERTS (optional here: the client finds `local`)
    python examples/coding_rollout.py --trajectories 4 --turns 3

The test run's scaling is passed inline (``elastic=SELFTEST_SCALING``), so no controller profile is
needed; a profile named in ``profiles`` of the controller's configuration works the same by name.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import tangram

# The "test suite" each trajectory writes into its sandbox: CPU-bound work split over N processes.
TEST_SCRIPT = r"""
import sys, multiprocessing as mp
def work(n):
    s = 0
    for i in range(n):
        s += i * i % 7
    return s
if __name__ == "__main__":
    procs = int(sys.argv[1]); total = int(sys.argv[2])
    with mp.Pool(procs) as pool:
        print(sum(pool.map(work, [total // procs] * procs)), "with", procs, "processes")
"""

# How the test run scales with cores: efficiency per core count (the scheduler picks the DoP from it).
SELFTEST_SCALING = {1: 1.0, 2: 0.95, 4: 0.9, 8: 0.8}


async def trajectory(tg: tangram.AsyncClient, i: int, turns: int, rng: random.Random) -> dict[str, float]:
    t0 = time.monotonic()
    async with tg.sandbox(mem="512MiB", timeout=600) as env:
        await env.put("solution.py", f"def answer():\n    return {i}\n")
        await env.put("selftest.py", TEST_SCRIPT)
        for turn in range(turns):
            await asyncio.sleep(rng.uniform(0.2, 0.8))  # the policy model "thinks"
            r = await env.exec(
                f"ls && python3 -c 'import solution; print(solution.answer() + {turn})'", cpus=1, timeout=30
            )
            r.stdout.strip()  # a real rollout feeds this back into the prompt
        test = await env.exec(
            "python3 selftest.py {dop} 3000000",
            cpus=(1, 8),
            elastic=SELFTEST_SCALING,
            duration_hint=2.0,
            timeout=120,
            check=True,
        )
    return {
        "act_s": time.monotonic() - t0,
        "test_run_s": test.run_s,
        "dop": float(test.dop),
        "queued_s": test.queued_s,
        "overhead_s": test.overhead_s,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", default=None, help="submit address (default: $TANGRAM_ADDR)")
    ap.add_argument("--trajectories", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    async with tangram.AsyncClient(args.addr, name="coding-rollout", default_timeout=120) as tg:
        # return_exceptions: every trajectory ends (and closes its sandbox) before the client does
        done = await asyncio.gather(
            *(trajectory(tg, i, args.turns, random.Random(rng.random())) for i in range(args.trajectories)),
            return_exceptions=True,
        )
    failed = [r for r in done if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    results = [r for r in done if not isinstance(r, BaseException)]
    for i, r in enumerate(results):
        print(
            f"trajectory {i}: ACT {r['act_s']:.2f}s, "
            f"test run {r['test_run_s']:.2f}s on {int(r['dop'])} cores, "
            f"queued {r['queued_s'] * 1000:.1f}ms, overhead {r['overhead_s'] * 1000:.1f}ms"
        )
    print(f"mean ACT {statistics.mean(r['act_s'] for r in results):.2f}s")


if __name__ == "__main__":
    asyncio.run(main())
