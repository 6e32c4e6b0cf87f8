"""`tangram bench dispatch`: per-action overhead and control-plane throughput on this machine.

Starts a controller (in this process) and one real agent (`python -m agent`, a subprocess) on
127.0.0.1 random ports, once per executor: `process`, and `docker` when dockerd answers.

- Overhead: `-n` no-op actions (`true`, 1 core) one after another from one client; per
  action, overhead = client-measured submit -> result time minus the agent-measured run time
  (setup included: cpuset change, process start). Reported as p50/p99 with the end-to-end
  latency next to it.
- Throughput: `--clients` clients, each with its own sandbox, submit `-n` no-op actions in
  total as fast as replies come back; actions per second over the whole run.

Figures only; nothing is asserted (the fast-path goals are a later issue).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import click


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def _docker_url() -> str | None:
    try:
        import docker
    except ImportError:
        return None
    url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if url.startswith("unix://") and not os.path.exists(url[len("unix://") :]):
        return None
    try:
        client = docker.DockerClient(base_url=url, timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no docker"
        return None
    return url


async def _bench_one(
    executor: str, n: int, clients: int, cpus: str, image: str | None, env: dict[str, str]
) -> dict[str, Any]:
    import tangram
    from tangram_cli.controller.config import ControllerConfig
    from tangram_cli.controller.daemon import Controller, Options

    out: dict[str, Any] = {"executor": executor, "n": n, "clients": clients}
    controller = Controller(ControllerConfig(cluster="bench"), Options())
    controller.start()
    workdir = tempfile.mkdtemp(prefix="tangram-bench-")
    argv = [
        sys.executable,
        "-m",
        "agent",
        "--controller",
        controller.agents_addr,
        "--name",
        "bench",
        "--executor",
        executor,
        "--cpus",
        cpus,
        "--workdir",
        workdir,
        "--cluster",
        "bench",
        "--log-level",
        "WARNING",
    ]
    if image:
        argv += ["--image", image]
    log = open(os.path.join(workdir, "agent.log"), "ab")  # noqa: SIM115 - closed below
    agent = subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 30
        while "bench" not in controller.core.cpu.nodes:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the agent did not register (see its log in " + workdir + ")")
            await asyncio.sleep(0.05)
        async with (
            tangram.AsyncClient(controller.submit_addr, name="bench-overhead") as tg,
            tg.sandbox(mem="256MiB") as sb,
        ):
            for _ in range(min(5, n)):  # warm-up: sandbox creation, first exec
                await sb.exec("true", timeout=60)
            latency, overhead, ctl = [], [], []
            for _ in range(n):
                t0 = time.perf_counter()
                r = await sb.exec("true", timeout=60)
                total = time.perf_counter() - t0
                latency.append(total)
                overhead.append(max(0.0, total - r.run_s))
                ctl.append(r.overhead_s)
        out.update(
            {
                "latency_p50_ms": _pct(latency, 0.5) * 1e3,
                "latency_p99_ms": _pct(latency, 0.99) * 1e3,
                "overhead_p50_ms": _pct(overhead, 0.5) * 1e3,
                "overhead_p99_ms": _pct(overhead, 0.99) * 1e3,
                "controller_overhead_p50_ms": _pct(ctl, 0.5) * 1e3,
                "overhead_mean_ms": statistics.fmean(overhead) * 1e3 if overhead else float("nan"),
            }
        )

        async def worker(k: int, count: int) -> int:
            async with (
                tangram.AsyncClient(controller.submit_addr, name=f"bench-{k}") as c,
                c.sandbox(mem="64MiB") as s,
            ):
                await s.exec("true", timeout=60)
                for _ in range(count):
                    await s.exec("true", timeout=120)
            return count

        per = [n // clients + (1 if k < n % clients else 0) for k in range(clients)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(worker(k, c) for k, c in enumerate(per) if c))
        wall = time.perf_counter() - t0
        out.update(
            {
                "throughput_actions_per_s": sum(done) / wall if wall > 0 else float("nan"),
                "throughput_wall_s": wall,
            }
        )
    except Exception as exc:  # noqa: BLE001 - report per executor, keep going
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if agent.poll() is None:
            agent.terminate()
            try:
                await asyncio.get_running_loop().run_in_executor(None, agent.wait, 10)
            except subprocess.TimeoutExpired:
                agent.kill()
        log.close()
        await controller.stop()
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    return out


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tangram bench dispatch (no-op actions, one local agent)")
    for col in (
        "executor",
        "n",
        "overhead p50",
        "overhead p99",
        "latency p50",
        "latency p99",
        "throughput",
        "clients",
    ):
        table.add_column(col, justify="left" if col == "executor" else "right")
    errors = []
    for r in rows:
        if "error" in r:
            table.add_row(r["executor"], str(r["n"]), "failed", "-", "-", "-", "-", str(r["clients"]))
            errors.append(f"{r['executor']}: {r['error']}")
            continue
        table.add_row(
            r["executor"],
            str(r["n"]),
            f"{r['overhead_p50_ms']:.2f} ms",
            f"{r['overhead_p99_ms']:.2f} ms",
            f"{r['latency_p50_ms']:.2f} ms",
            f"{r['latency_p99_ms']:.2f} ms",
            f"{r['throughput_actions_per_s']:.0f} /s",
            str(r["clients"]),
        )
    console = Console()
    console.print(table)
    for line in errors:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


@click.command("dispatch")
@click.option(
    "-n",
    "n",
    type=click.IntRange(1, 1_000_000),
    default=200,
    show_default=True,
    help="No-op actions per measurement.",
)
@click.option(
    "--clients",
    type=click.IntRange(1, 1024),
    default=16,
    show_default=True,
    help="Concurrent clients for the throughput run.",
)
@click.option(
    "--executor",
    "executors",
    type=click.Choice(["process", "docker"]),
    multiple=True,
    help="Executor(s) to measure (default: process, and docker when dockerd answers).",
)
@click.option("--cpus", default=None, help="Cores the agent hands out (default: 0-1, or 0 on one core).")
@click.option("--image", default=None, help="Sandbox image for the docker executor (default: the agent's).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def dispatch(
    n: int, clients: int, executors: tuple[str, ...], cpus: str | None, image: str | None, as_json: bool
) -> None:
    """Per-action overhead (p50/p99) and control-plane throughput, per executor."""
    import logging

    logging.getLogger("tangram").setLevel(logging.ERROR)
    if cpus is None:
        cpus = "0-1" if len(os.sched_getaffinity(0)) >= 2 else "0"
    chosen = list(executors) or ["process"]
    docker_env: dict[str, str] = {}
    if not executors or "docker" in executors:
        url = _docker_url()
        if url is not None:
            docker_env["DOCKER_HOST"] = url
            if "docker" not in chosen:
                chosen.append("docker")
        elif "docker" in executors:
            raise click.UsageError("--executor docker: no dockerd answers (set DOCKER_HOST)")

    async def run_all() -> list[dict[str, Any]]:
        rows = []
        for ex in chosen:
            rows.append(
                await _bench_one(
                    ex,
                    n,
                    clients,
                    cpus,
                    image if ex == "docker" else None,
                    docker_env if ex == "docker" else {},
                )
            )
        return rows

    rows = asyncio.run(run_all())
    if as_json:
        click.echo(json.dumps({"dispatch": rows}, indent=2, default=str))
    else:
        _print_table(rows)
