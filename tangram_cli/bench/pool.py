"""`tangram bench pool`: opening a sandbox and running its first command, with and without a warm
sandbox pool, on the live path (docs/scheduler.md, "Warm sandbox pools").

Per mode (`no pool`: the controller's `sandbox_pool` off; `pool`: `{"min": P, "max": P}`), a fresh
controller (`tangram controller`, its own process) and one real Docker agent (`python -m agent`):

- Sequential: `-n` times, open a sandbox and run `true` in it (timed together: *open + first exec*),
  run `true` again (*later exec*), close it, wait `--gap` (the pool refills meanwhile). p50 of each and
  their ratio; the goal (issue 14) is open + first exec p50 within 2x the later exec's.
- Burst: `--burst` sandboxes opened at once, each running `true`: p50 and p99 of open + first exec,
  and how many of their containers were made before the burst (served from the pool).
- Refill beside running actions: `true` runs again and again in an open sandbox for `--refill-window`,
  once before the burst (quiet) and once right after it (while the pool refills `--burst` containers):
  the two p50s (the refill should not delay running actions; in the `no pool` mode nothing refills).

Figures only; the goal is printed with PASS/FAIL, never asserted. On a shared or loaded machine the
figures move from run to run: the printed load average says how busy it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import click

from tangram_cli.bench.goals import at_most, styled, summary
from tangram_cli.bench.procs import ControllerProc, pct, start_real_agent, stop_proc, wait_nodes
from tangram_cli.bench.raw_spawn import default_cpus
from tangram_cli.state import query_status

NODE = "poolbench"
MEM_MIB = 256  # every sandbox's memory (a shape of its own: the pool holds `--burst` of them in any node)
RATIO_GOAL = 2.0


def _ms(values: list[float], q: float) -> float | None:
    v = pct(values, q)
    return None if v is None else v * 1e3


def _docker() -> Any:
    import docker  # start-up cost (~0.3 s): only when this benchmark runs

    client = docker.from_env(timeout=30)
    client.ping()
    return client


def _bench_containers(client: Any) -> list[dict[str, Any]]:
    flt = {"label": ["tangram.cluster=bench", f"tangram.node={NODE}"]}
    return client.api.containers(all=True, filters=flt)  # type: ignore[no-any-return]


async def _idle_pooled(status_addr: str, want: int, timeout_s: float) -> bool:
    """Whether the agent reports `want` idle pooled sandboxes (its heartbeats) within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            rows = await asyncio.to_thread(query_status, status_addr, sections=("nodes",), timeout_s=5)
            if any(r.get("node") == NODE and r.get("pool_idle") == want for r in rows.get("nodes", [])):
                return True
        await asyncio.sleep(0.2)
    return False


async def _sequential(tg: Any, n: int, gap_s: float) -> tuple[list[float], list[float]]:
    first, later = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await tg.open_sandbox(mem=MEM_MIB)
        await sb.exec("true", timeout=120)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await sb.exec("true", timeout=120)
        later.append(time.perf_counter() - t0)
        await sb.close()
        await asyncio.sleep(gap_s)
    return first, later


async def _burst(tg: Any, k: int) -> tuple[list[float], list[Any]]:
    async def one() -> tuple[float, Any]:
        t0 = time.perf_counter()
        sb = await tg.open_sandbox(mem=MEM_MIB)
        await sb.exec("true", timeout=300)
        return time.perf_counter() - t0, sb

    done = await asyncio.gather(*(one() for _ in range(k)))
    return [d for d, _ in done], [sb for _, sb in done]


async def _during_refill(sb: Any, window_s: float) -> list[float]:
    out = []
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await sb.exec("true", timeout=120)
        out.append(time.perf_counter() - t0)
    return out


async def _measure(addr: str, status: str, pool: int, n: int, burst: int, gap_s: float,
                   window_s: float, client: Any) -> dict[str, Any]:
    """One mode against a started controller and agent: the figures of the module doc."""
    import tangram

    out: dict[str, Any] = {}
    if pool and not await _idle_pooled(status, pool, 120):
        out["warning"] = f"the pool did not fill to {pool} within 120 s"
    async with tangram.AsyncClient(addr, name="bench-pool") as tg:
        first, later = await _sequential(tg, n, gap_s)
        out.update(first_p50_ms=_ms(first, 0.5), first_p99_ms=_ms(first, 0.99), later_p50_ms=_ms(later, 0.5))
        if out["later_p50_ms"]:
            out["ratio"] = out["first_p50_ms"] / out["later_p50_ms"]
        probe = await tg.open_sandbox(mem=MEM_MIB)  # where execs run back to back, quiet and during refill
        await probe.exec("true", timeout=120)  # placed (and claimed) now
        await asyncio.sleep(2.0)  # the agent's next heartbeats tell the refill's progress
        if pool:
            await _idle_pooled(status, pool, 120)
        out["quiet_p50_ms"] = _ms(await _during_refill(probe, window_s), 0.5)
        made_before = {c["Id"] for c in await asyncio.to_thread(_bench_containers, client)}
        times, boxes = await _burst(tg, burst)
        out.update(burst=burst, burst_p50_ms=_ms(times, 0.5), burst_p99_ms=_ms(times, 0.99))
        out["during_refill_p50_ms"] = _ms(await _during_refill(probe, window_s), 0.5)
        ids = {c["Names"][0].lstrip("/"): c["Id"] for c in await asyncio.to_thread(_bench_containers, client)}
        out["burst_from_pool"] = sum(ids.get(f"tangram-bench-{sb.id}") in made_before for sb in boxes)
        for sb in [*boxes, probe]:
            await sb.close()
    return out


async def _mode(name: str, pool: int, n: int, burst: int, gap_s: float, window_s: float, cpus: str,
                image: str | None, client: Any) -> dict[str, Any]:
    wd = tempfile.mkdtemp(prefix="tangram-bench-pool-")
    shapes = [{"image": "", "mem_mib": MEM_MIB}]
    config = {"sandbox_pool": {"min": pool, "max": pool, "shapes": shapes}} if pool else {}
    ctl = await asyncio.to_thread(ControllerProc(wd, config=config).start)
    env = {"DOCKER_HOST": os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")}
    agent = start_real_agent(ctl.agents_addr, NODE, "docker", cpus, wd, image, env)
    row: dict[str, Any] = {"mode": name, "pool": pool, "n": n}
    try:
        await asyncio.to_thread(wait_nodes, ctl.status_addr, [NODE], [agent], 60)
        row.update(await _measure(ctl.submit_addr, ctl.status_addr, pool, n, burst, gap_s, window_s, client))
    except Exception as exc:  # noqa: BLE001 - report the mode, keep going
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):  # `tangram down`: sandboxes and the idle pool go
            os.kill(ctl.proc.pid, signal.SIGUSR1)  # type: ignore[union-attr]
        await asyncio.to_thread(lambda: agent.wait(60) if agent.poll() is None else None)
        await asyncio.to_thread(stop_proc, agent)
        await asyncio.to_thread(ctl.stop)
        for c in await asyncio.to_thread(_bench_containers, client):  # whatever a failed run left
            with contextlib.suppress(Exception):
                await asyncio.to_thread(client.api.remove_container, c["Id"], force=True, v=True)
        shutil.rmtree(wd, ignore_errors=True)
    return row


def goals_met(row: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's goal for a pooled run: open + first exec p50 within 2x a later exec's."""
    if not row.get("pool"):
        return {}
    return {"ratio": at_most(row.get("ratio"), RATIO_GOAL)}


_FIGURES = (
    ("open + first exec p50 / p99", ("first_p50_ms", "first_p99_ms"), " ms"),
    ("later exec p50", ("later_p50_ms",), " ms"),
    ("ratio (goal with a pool: <= 2x)", ("ratio",), "x"),
    ("burst: open + first exec p50 / p99", ("burst_p50_ms", "burst_p99_ms"), " ms"),
    ("burst: served from the pool", ("burst_from_pool", "burst"), ""),
    ("back-to-back exec p50: quiet / refilling", ("quiet_p50_ms", "during_refill_p50_ms"), " ms"),
)


def _cell(v: Any) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def _print(rows: list[dict[str, Any]], load: tuple[float, ...]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench pool: open + first exec, with and without a warm sandbox pool (docker)")
    table.add_column("figure")
    for r in rows:
        table.add_column(f"{r['mode']} ({r['pool']})" if r["pool"] else r["mode"], justify="right")
    for label, keys, unit in _FIGURES:
        cells = []
        for r in rows:
            text = " / ".join(_cell(r.get(k)) for k in keys)
            met = goals_met(r).get(keys[0]) if keys == ("ratio",) else None
            cells.append(text + unit + (f" {styled(met)}" if met is not None else ""))
        table.add_row(label, *cells)
    console = Console()
    console.print(table)
    for r in rows:
        if r.get("pool"):
            console.print(f"{r['mode']}: {summary(goals_met(r))}", markup=False, highlight=False)
        for key in ("warning", "error"):
            if key in r:
                console.print(f"{r['mode']}: {r[key]}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"load average before the run: {' '.join(f'{x:.2f}' for x in load)} "
                  f"on {os.cpu_count()} cores (a shared or busy machine moves these figures)",
                  markup=False, highlight=False)


@click.command("pool")
@click.option("-n", "n", type=click.IntRange(1, 10_000), default=20, show_default=True,
              help="Sequential opens per mode.")
@click.option("--burst", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Sandboxes opened at once (the pool's size in the pooled mode).")
@click.option("--gap", "gap", type=click.FloatRange(0, 600), default=2.0, show_default=True,
              help="Time between sequential opens (the pool refills meanwhile).")
@click.option("--refill-window", "refill_window", type=click.FloatRange(0.1, 600), default=3.0,
              show_default=True,
              help="Time of execs measured while the pool refills after the burst.")
@click.option("--cpus", default=None, help="Cores the agent hands out (default: 0-1, or 0 on one core).")
@click.option("--image", default=None, help="Sandbox image (default: the agent's).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def pool(n: int, burst: int, gap: float, refill_window: float, cpus: str | None, image: str | None,
         as_json: bool) -> None:
    """Open + first exec p50 against a later exec's, with and without a warm sandbox pool, and a burst."""
    if cpus is None:
        cpus = default_cpus()
    try:
        client = _docker()
    except Exception as exc:  # noqa: BLE001 - any failure means "no docker"
        raise click.UsageError(f"bench pool needs dockerd ({exc}); set DOCKER_HOST") from None
    load = os.getloadavg()

    async def run_all() -> list[dict[str, Any]]:
        return [await _mode(name, p, n, burst, gap, refill_window, cpus, image, client)
                for name, p in (("no pool", 0), ("pool", burst))]

    try:
        rows = asyncio.run(run_all())
    finally:
        client.close()
    for r in rows:
        r["met"] = goals_met(r)
    if as_json:
        click.echo(json.dumps({"rows": rows, "loadavg": list(load)}, indent=2, sort_keys=True))
        return
    _print(rows, load)
