"""The built-in agentic-RL workload of `tangram demo` (docs/cli.md, `tangram demo`).

A batch of trajectories starts at once, as a rollout step does. Each trajectory opens one sandbox,
places the test-run script (``testrun.py`` beside this module) in it, then for every turn:

    think (seeded sleep: the policy model generating)  ->  a short command (read the repo)
    -> every other turn, a web search under API ``search``'s lease  ->  an elastic test run
       (fixed total CPU work split over ``{dop}`` processes)

and finally asks the emulated GPU reward model (service ``reward``) for a score.

It runs twice on the same cluster and the same seeds:

* ``tangram``: per-action scheduling. Sandboxes hold no cores; each command gets cores only while
  it runs, and the test run asks for ``(1, C)`` cores with an elasticity profile.
* ``static``: trajectory-level allocation, as a Kubernetes pod per trajectory would be:
  ``sandbox(reserve=k)`` holds k cores from open to close (at most C/k trajectories run at a
  time, the rest wait for their "pod"), and every command runs on those k cores.

ACT (action completion time) is measured from when the trajectory wants the action to when the
result is back: queueing plus run time, including, for a trajectory's first action, the wait for
its sandbox. Core-seconds: *reserved* is what the policy held (static: k x sandbox lifetime;
tangram: cores x run time of each command), *busy* is cores x run time of the commands.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tangram

TESTRUN_PATH = "testrun.py"
HASHES_PER_UNIT = 100_000  # ~30 ms of one core per unit on the development machine
SEARCH_S = (0.05, 0.15)


def testrun_source() -> bytes:
    return (Path(__file__).with_name("testrun.py")).read_bytes()


@dataclass(frozen=True)
class DemoConfig:
    trajectories: int = 8
    turns: int = 4
    seed: int = 0
    think_s: tuple[float, float] = (1.0, 3.0)
    test_units: int = 20  # work of one test run, in units of HASHES_PER_UNIT hashes
    cores: int = 2  # C: cores of the cluster's CPU nodes (both policies get the same)
    reserve: int = 1  # k: cores per trajectory under the static policy
    reward_service: str = "reward"
    api: str = "search"
    timeout_s: float = 600.0

    def actions_per_trajectory(self) -> int:
        searches = self.turns // 2
        return self.turns * 2 + searches + 1


@dataclass
class Act:
    trajectory: int
    turn: int
    kind: str  # cmd | test | search | reward
    act_s: float
    run_s: float = 0.0
    cores: int = 0
    dop: int = 0


@dataclass
class PolicyResult:
    policy: str
    acts: list[Act] = field(default_factory=list)
    makespan_s: float = 0.0
    reserved_core_s: float = 0.0
    busy_core_s: float = 0.0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def act_values(self, kind: str | None = None) -> list[float]:
        return sorted(a.act_s for a in self.acts if kind is None or a.kind == kind)

    def metrics(self) -> dict[str, Any]:
        acts = self.act_values()
        tests = [a for a in self.acts if a.kind == "test"]
        return {
            "policy": self.policy,
            "actions": len(acts),
            "mean_act_s": _mean(acts),
            "p50_act_s": percentile(acts, 50),
            "p99_act_s": percentile(acts, 99),
            "mean_test_act_s": _mean(self.act_values("test")),
            "mean_test_dop": _mean([float(a.dop) for a in tests]),
            "makespan_s": self.makespan_s,
            "reserved_core_s": self.reserved_core_s,
            "busy_core_s": self.busy_core_s,
            "busy_over_reserved": (self.busy_core_s / self.reserved_core_s) if self.reserved_core_s else None,
            "failed_trajectories": self.failed,
            "errors": self.errors[:5],
        }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def percentile(sorted_xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_xs:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_xs)))
    return sorted_xs[min(rank, len(sorted_xs)) - 1]


Progress = Callable[[str, str], None]  # (policy, event): event is "action" or "trajectory"


async def _trajectory(
    client: Any, cfg: DemoConfig, policy: str, i: int, t0: float, out: PolicyResult, progress: Progress
) -> None:
    rng = random.Random(cfg.seed * 1_000_003 + i)
    static = policy == "static"
    k = cfg.reserve
    want = time.monotonic()  # the trajectory wants its environment from the start of the batch

    def record(turn: int, kind: str, start: float, run_s: float = 0.0, cores: int = 0, dop: int = 0) -> None:
        out.acts.append(Act(i, turn, kind, time.monotonic() - start, run_s, cores, dop))
        progress(policy, "action")

    think = [rng.uniform(*cfg.think_s) for _ in range(cfg.turns)]
    search = [rng.uniform(*SEARCH_S) for _ in range(cfg.turns)]
    async with client.sandbox(reserve=k if static else 0, timeout=cfg.timeout_s) as env:
        opened = time.monotonic()
        await env.put(TESTRUN_PATH, testrun_source())
        try:
            first_start: float | None = want
            for turn in range(cfg.turns):
                await asyncio.sleep(think[turn])
                start = first_start if first_start is not None else time.monotonic()
                first_start = None
                r = await env.exec(
                    f"ls -la . && head -c 200 {TESTRUN_PATH} >/dev/null && echo turn {turn}",
                    **exec_args(cfg, "cmd", static),
                )
                _check(r, "command")
                out.busy_core_s += len(r.cores) * r.run_s
                record(turn, "cmd", start, r.run_s, len(r.cores), 1)
                if turn % 2 == 1:
                    start = time.monotonic()
                    async with client.api(cfg.api, timeout=cfg.timeout_s):
                        await asyncio.sleep(search[turn])  # the HTTP request this lease pays for
                    record(turn, "search", start)
                start = time.monotonic()
                cmd = f"python3 {TESTRUN_PATH} {{dop}} {cfg.test_units} {HASHES_PER_UNIT}"
                r = await env.exec(cmd, **exec_args(cfg, "test", static))
                _check(r, "test run")
                out.busy_core_s += len(r.cores) * r.run_s
                record(turn, "test", start, r.run_s, len(r.cores), r.dop or len(r.cores))
        finally:
            closed = time.monotonic()
            if static:
                out.reserved_core_s += k * (closed - opened)
    start = time.monotonic()
    c = await client.call(
        cfg.reward_service,
        {"response": f"trajectory {i} patch", "reference": "trajectory patch"},
        gpus=1,
        timeout=cfg.timeout_s,
    )
    del c
    record(cfg.turns, "reward", start)
    progress(policy, "trajectory")


CMD_HINT_S = 0.05  # a command's run time (ls, head): tens of ms


def exec_args(cfg: DemoConfig, kind: str, static: bool) -> dict[str, Any]:
    """Keyword arguments of ``env.exec`` for a turn's command (``cmd``) or test run (``test``).

    Under ``tangram`` both carry a duration hint: without one the core takes a running command
    to last its default estimate (1 s), longer than the test run itself, so a test run arriving
    while a command holds the other core never waits for it and runs on one core. With the hint
    it waits the few ms for the core and runs on both (tests/cli/test_demo_output.py)."""
    if static:
        return {"cpus": 1 if kind == "cmd" else cfg.reserve, "timeout": cfg.timeout_s}
    if kind == "cmd":
        return {"cpus": 1, "duration_hint": CMD_HINT_S, "timeout": cfg.timeout_s}
    return {
        "cpus": (1, max(1, cfg.cores)),
        "elastic": "synthetic",
        "duration_hint": cfg.test_units * 0.03,
        "timeout": cfg.timeout_s,
    }


def speed_sentence(ratio: float | None, tolerance: float = 0.05) -> str | None:
    """How Tangram's mean ACT compares, from static / tangram: a ratio >= 1 either way."""
    if not ratio or ratio <= 0:
        return None
    if abs(ratio - 1.0) <= tolerance:
        return f"mean ACT: Tangram and the static per-trajectory allocation are about the same ({ratio:.2f}x)"
    if ratio > 1.0:
        return f"mean ACT: Tangram is {ratio:.2f}x faster than the static per-trajectory allocation"
    return f"mean ACT: Tangram is {1 / ratio:.2f}x slower than the static per-trajectory allocation"


def _check(r: Any, what: str) -> None:
    if r.exit_code != 0:
        raise RuntimeError(f"{what} exited {r.exit_code}: {(r.stderr or r.stdout).strip()[-200:]}")


async def run_policy(address: str, cfg: DemoConfig, policy: str, progress: Progress) -> PolicyResult:
    out = PolicyResult(policy)
    async with tangram.AsyncClient(address, name=f"demo-{policy}", default_timeout=cfg.timeout_s) as client:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(_trajectory(client, cfg, policy, i, t0, out, progress) for i in range(cfg.trajectories)),
            return_exceptions=True,
        )
        out.makespan_s = time.monotonic() - t0
    for r in results:
        if isinstance(r, BaseException):
            out.failed += 1
            out.errors.append(f"{type(r).__name__}: {r}")
    if policy == "tangram":
        out.reserved_core_s = out.busy_core_s  # cores are held only while a command runs
    return out


def compare(results: dict[str, PolicyResult]) -> dict[str, Any]:
    m = {p: r.metrics() for p, r in results.items()}
    ratio: dict[str, float | None] = {}
    if "tangram" in m and "static" in m:
        for key in ("mean_act_s", "p99_act_s", "makespan_s", "mean_test_act_s"):
            a, b = m["static"].get(key), m["tangram"].get(key)
            ratio[key] = (a / b) if a and b else None
    return {"policies": m, "static_over_tangram": ratio}


def config_dict(cfg: DemoConfig) -> dict[str, Any]:
    return asdict(cfg)
