"""Many RL jobs live (issue 14, part 3): an in-process controller whose config gives two jobs
weights 1:3, two real agents (process executor, two cores each: four cores the scheduler hands
out), and two `AsyncClient`s that name their jobs. Counts and ratios with generous bounds, no
timings: the heavier job holds more of the cores while both wait, a small job's action is not
queued behind another job's burst, and status shows the JOBS rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram.core.resources import CPU
from tangram_cli.controller.daemon import Controller
from tangram_cli.render import status as rs

from .conftest import CONFIG, cpus_for_test, start_agent, stop_process, wait_for_node

pytestmark = pytest.mark.timeout(120)
FLAGS = ("--executor", "process", "--cpus", cpus_for_test())
JOBS_CONFIG: dict[str, Any] = {**CONFIG, "jobs": {"light": {"weight": 1}, "heavy": {"weight": 3}}}


@pytest.fixture
async def two_nodes(cluster: Any, tmp_path: Path) -> AsyncIterator[Controller]:
    """The controller with agents n1 and n2 (the same cores twice: four to hand out)."""
    c = await cluster(*FLAGS, config=JOBS_CONFIG)
    workdir = tmp_path / "agent-n2"
    workdir.mkdir()
    proc = start_agent(c.agents_addr, str(workdir), *FLAGS, name="n2")
    try:
        await wait_for_node(c, "n2")
        yield c
    finally:
        await asyncio.get_running_loop().run_in_executor(None, stop_process, proc)


async def _loop(tg: tangram.AsyncClient, stop: asyncio.Event, done: list[int]) -> None:
    """One trajectory: short one-core commands in its sandbox until ``stop``."""
    async with tg.sandbox() as env:
        while not stop.is_set():
            r = await env.exec("sleep 0.2", cpus=1, timeout=30)
            assert r.exit_code == 0
            done.append(1)


async def test_the_heavier_job_holds_more_cores_while_both_wait(two_nodes: Controller) -> None:
    c = two_nodes
    cores = sum(n.total for n in c.core.cpu.nodes.values())
    stop = asyncio.Event()
    done: dict[str, list[int]] = {"light": [], "heavy": []}
    async with (
        tangram.AsyncClient(c.submit_addr, name="light", job="light") as light,
        tangram.AsyncClient(c.submit_addr, name="heavy", job="heavy") as heavy,
    ):
        loops = [
            asyncio.ensure_future(_loop(tg, stop, done[j]))
            for j, tg in (("light", light), ("heavy", heavy))
            for _ in range(2 * cores)
        ]  # each job alone would want every core twice over
        samples: list[dict[str, int]] = []
        try:
            while sum(map(len, done.values())) < 4 * cores:  # warmed up: every sandbox placed and running
                await asyncio.sleep(0.05)
            base = _core_s(c)
            while len(samples) < 60:
                held = dict(c.core.jobs.held.get(CPU, {}))
                if c.core.pending.by_job.get("light") and c.core.pending.by_job.get("heavy"):
                    samples.append(held)  # both jobs wait: the weights decide
                await asyncio.sleep(0.05)
            used = {j: _core_s(c)[j] - base[j] for j in base}
            rows = {r["job"]: r for r in c._records(["jobs"], 10)["jobs"]}
        finally:
            stop.set()
            await asyncio.gather(*loops)
    mean = {j: sum(s.get(j, 0) for s in samples) / len(samples) for j in ("light", "heavy")}
    print(f"held cores while both wait (mean of {len(samples)} samples): {mean}; core-s: {used}")
    assert mean["heavy"] >= 1.8 * mean["light"], mean  # weights 3:1 (1:1 or FCFS would be ~1)
    assert mean["light"] >= 0.5, mean  # and the light job is not starved
    assert used["heavy"] >= 1.5 * used["light"] > 0, used
    assert rows["heavy"]["weight"] == 3.0 and rows["light"]["clients"] == 1 and rows["heavy"]["cores"] > 0
    (table,) = [t for t in rs.tables({"jobs": list(rows.values())}, sections=["jobs"]) if t[0] == "JOBS"]
    assert [r[0] for r in table[2]] == ["heavy", "light"] and table[1][:3] == ["JOB", "WEIGHT", "CLIENTS"]


def _core_s(c: Controller) -> dict[str, float]:
    rows = {r["job"]: r for r in c._records(["jobs"], 10)["jobs"]}
    return {j: float(rows.get(j, {}).get("core_s", 0.0)) for j in ("light", "heavy")}


@pytest.mark.parametrize("jobs", [True, False], ids=["jobs", "one-fcfs-queue"])
async def test_a_small_jobs_action_is_not_queued_behind_a_burst(two_nodes: Controller, jobs: bool) -> None:
    c = two_nodes
    cores = sum(n.total for n in c.core.cpu.nodes.values())
    async with (
        tangram.AsyncClient(c.submit_addr, name="burst", job="heavy" if jobs else "") as big,
        tangram.AsyncClient(c.submit_addr, name="small", job="light" if jobs else "") as small,
    ):
        envs = [await big.open_sandbox() for _ in range(4 * cores)]
        finished: list[str] = []

        async def one(env: Any) -> None:
            await env.exec("sleep 1", cpus=1, timeout=60)
            finished.append("big")

        burst = [asyncio.ensure_future(one(e)) for e in envs]  # every core busy, three times as many waiting
        while sum(c.core.pending.by_job.values()) < 2 * cores:
            await asyncio.sleep(0.02)
        async with small.sandbox() as env:
            r = await env.exec("true", cpus=1, timeout=60)
        ahead = len(finished)  # big's actions that ended before the small one did
        await asyncio.gather(*burst)
        for e in envs:
            await e.close()
    assert r.exit_code == 0
    print(f"jobs={jobs}: {ahead} of the burst's {4 * cores} actions ended before the small job's one")
    if jobs:  # it took the first core that freed: about the first wave (one per core) ended before it
        assert ahead <= 2 * cores, (ahead, cores)
    else:  # one FCFS queue: each action of the burst queued before it had to start, so end, first
        assert ahead >= 3 * cores, (ahead, cores)
