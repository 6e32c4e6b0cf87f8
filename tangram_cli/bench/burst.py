"""`tangram bench burst`: many no-op execs submitted at once by several client processes.

Layout (each its own process): the controller (`tangram controller`), the agent (the real
`python -m agent --executor process`, or with `--instant` bench agents that answer every Spawn
at once, so the run measures the controller alone; it offers 256 cores by default, one node of
`tangram bench scale`'s cluster: a smaller one bounds the run by its round trips, at most twice its
cores in flight), `--clients` client processes
(`python -m tangram_cli.bench.burst`), and this process, which only starts them, samples the
status socket every 0.5 s and the controller's memory, and adds up the clients' reports.

Each client opens `--sandboxes` sandboxes, runs one warm-up exec in each, waits for the
common go, then submits its share of `--actions` as concurrent `sb.exec("true")` tasks at
once. It counts final replies per request id on the wire (each request must get exactly one),
errors by code, its resends after reconnects and its RetryLater retries, and its own CPU from the
go to its last reply (`clients_cpu_s`: the client library and this bench's bookkeeping).

Figures only; the goals (issue 9) are printed next to them with PASS/FAIL, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import click
from rich.console import Console
from rich.table import Table

import tangram
from tangram import protocol
from tangram.errors import TangramError
from tangram_cli.bench.agents import start_bench_agents
from tangram_cli.bench.goals import at_least, at_most, styled, summary
from tangram_cli.bench.procs import (
    ControllerProc,
    Procs,
    bench_workdir,
    controller_figures,
    logs_and_json,
    pct,
    run_clients,
    start_real_agent,
    wait_nodes,
)

GOALS = {
    "status_answer_max_s": 1.0,
    "controller_rss_peak_mib": 300,
    "resent_fraction": 0.01,
    "instant_actions_per_s": 5000,
}
INSTANT_CORES = 256  # the instant agent's default: one node of `tangram bench scale`'s cluster


class FinalCounter:
    """Counts final replies (`Result`/`Error`) per request id as they arrive, duplicates
    included, by wrapping the client transport's message handler; reports the requests the
    transport resent after a reconnect or restart (`Transport.resent`).

    A request the transport resent (its controller restarted or its connection changed) may be
    answered twice: once by the old connection, once by the reply cache of the controller that
    got the copy. The second final is then byte for byte the first (a replay: the library keeps
    the first and drops the other as a stray) and is counted in `replays`, not as a duplicate.
    A second final for a request that was never resent, or one that differs from the first,
    is a duplicate (`finals` keeps every final; `duplicates` only those)."""

    def __init__(self, transport: Any) -> None:
        self.finals: dict[int, int] = {}
        self.replays: dict[int, int] = {}  # request id -> identical finals after a resend
        self._first: dict[int, bytes] = {}  # request id -> digest of its first final
        self._resent: set[int] = set()
        self.unknown = 0
        self.transport = transport  # its `resent`: requests sent again after a reconnect or restart
        self.rewelcomes = 0
        self._final_types = {protocol.Result.TYPE, protocol.Error.TYPE}
        self.ok = all(hasattr(transport, a) for a in ("request", "_on_envelope", "_on_welcome", "_pending"))
        if not self.ok:
            return
        request, on_envelope, on_welcome = transport.request, transport._on_envelope, transport._on_welcome

        def counted_request(*args: Any, **kwargs: Any) -> Any:
            pending = request(*args, **kwargs)
            self.finals.setdefault(pending.request_id, 0)
            return pending

        def counted_envelope(env: Any) -> None:  # each message, the items of a batch one by one
            if env.type in self._final_types:
                self._count(env)
            on_envelope(env)

        def counted_welcome(msg: Any) -> None:
            if transport._welcome is not None and transport._welcome.done():
                self.rewelcomes += 1
            self._resent.update(transport._pending)  # what a resend after this Welcome may send again
            on_welcome(msg)

        transport.request, transport._on_envelope, transport._on_welcome = (
            counted_request,
            counted_envelope,
            counted_welcome,
        )
        resend = getattr(transport, "_resend", None)
        if resend is not None:  # a reconnect resends too (no Welcome)

            def noted_resend(*args: Any, **kwargs: Any) -> Any:
                self._resent.update(transport._pending)
                return resend(*args, **kwargs)

            transport._resend = noted_resend

    def _count(self, env: Any) -> None:
        rid = env.request_id
        if rid not in self.finals:
            self.unknown += 1
            return
        self.finals[rid] += 1
        if rid not in self._resent:  # only a resent request can be replayed: it was pending when it was
            return  # resent, so even its first final came later; the others need no digest (it is costly)
        digest = hashlib.blake2b(repr((env.type, env.msg, env.blobs)).encode(), digest_size=16).digest()
        first = self._first.setdefault(rid, digest)
        if self.finals[rid] > 1 and rid in self._resent and digest == first:
            self.replays[rid] = self.replays.get(rid, 0) + 1

    def duplicates(self, rid: int) -> int:
        """Finals for `rid` beyond the first that are not replays of it."""
        return max(0, self.finals.get(rid, 0) - 1 - self.replays.get(rid, 0))

    def summary(self) -> dict[str, Any]:
        if not self.ok:
            return {"checked": False}
        by = Counter(self.finals.values())
        return {
            "checked": True,
            "requests": len(self.finals),
            "answered_once": by.get(1, 0),
            "unanswered": by.get(0, 0),
            "answered_twice_or_more": sum(n for k, n in by.items() if k > 1),
            "replayed_after_resend": sum(self.replays.values()),
            "finals_for_unknown_ids": self.unknown,
            "resent_after_reconnect": getattr(self.transport, "resent", 0),
            "rewelcomes": self.rewelcomes,
        }


# ------------------------------------------------------------------ the client process


async def _client(addr: str, name: str, actions: int, sandboxes: int, exec_timeout: float) -> dict[str, Any]:
    """One client: set up, print `ready`, wait for `go` on stdin, burst, return the report."""
    out: dict[str, Any] = {"name": name, "actions": actions}
    async with tangram.AsyncClient(addr, name=name, connect_timeout=60) as tg:
        counter = FinalCounter(tg._transport)
        sbs = [await tg.open_sandbox(mem="64MiB") for _ in range(max(1, sandboxes))]
        for sb in sbs:
            await sb.exec("true", timeout=120)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        errors: Counter[str] = Counter()
        nonzero = 0
        latency: list[float] = []
        retried_before = tg.retried_later

        async def one(i: int) -> None:
            nonlocal nonzero
            t0 = time.perf_counter()
            try:
                r = await sbs[i % len(sbs)].exec("true", timeout=exec_timeout)
            except TangramError as exc:
                errors[str(exc.code.value if exc.code else type(exc).__name__)] += 1
                return
            latency.append(time.perf_counter() - t0)
            nonzero += r.exit_code != 0

        out["go"] = time.time()
        cpu0 = time.process_time()
        await asyncio.gather(*(one(i) for i in range(actions)))
        out["end"] = time.time()
        out["cpu_s"] = time.process_time() - cpu0
        out.update(
            completed=len(latency),
            failed=dict(errors),
            nonzero_exit=nonzero,
            latency_p50_s=pct(latency, 0.5),
            latency_p99_s=pct(latency, 0.99),
            retried_later=tg.retried_later - retried_before,
            wire=counter.summary(),
        )
        for sb in sbs:
            with contextlib.suppress(TangramError):
                await sb.close()
    return out


def client_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tangram_cli.bench.burst", description="A burst client.")
    ap.add_argument("--addr", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--actions", type=int, required=True)
    ap.add_argument("--sandboxes", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0)
    ns = ap.parse_args(argv)
    report = asyncio.run(_client(ns.addr, ns.name, ns.actions, ns.sandboxes, ns.timeout))
    print(json.dumps(report), flush=True)
    return 0


# ------------------------------------------------------------------ the orchestrator


def _spawn_clients(
    addr: str, shares: list[int], sandboxes: int, timeout: float, workdir: str
) -> list[subprocess.Popen[str]]:
    procs = []
    for k, n in enumerate(shares):
        argv = [
            sys.executable,
            "-m",
            "tangram_cli.bench.burst",
            "--addr",
            addr,
            "--name",
            f"burst-{k}",
            "--actions",
            str(n),
            "--sandboxes",
            str(sandboxes),
            "--timeout",
            str(timeout),
        ]
        with open(os.path.join(workdir, f"client-{k}.log"), "ab") as log:
            procs.append(
                subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            )
    return procs


def _sum_clients(reports: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in reports if "error" not in r]
    failed: Counter[str] = Counter()
    wire: Counter[str] = Counter()
    for r in ok:
        failed.update(r["failed"])
        wire.update({k: v for k, v in r["wire"].items() if isinstance(v, int) and not isinstance(v, bool)})
    go = min((r["go"] for r in ok), default=0.0)
    end = max((r["end"] for r in ok), default=0.0)
    completed = sum(r["completed"] for r in ok)
    wall = end - go
    return {
        "completed": completed,
        "failed": dict(failed),
        "nonzero_exit": sum(r["nonzero_exit"] for r in ok),
        "client_errors": [r["error"] for r in reports if "error" in r],
        "answered_once_ok": bool(ok)
        and all(r["wire"].get("checked") for r in ok)
        and wire["unanswered"] == 0
        and wire["answered_twice_or_more"] == 0,
        "wire": dict(wire),
        "retried_later": sum(r["retried_later"] for r in ok),
        "wall_s": round(wall, 3),
        "actions_per_s": round(completed / wall, 1) if wall > 0 else None,
        "latency_p50_ms": _ms(max((r["latency_p50_s"] or 0) for r in ok) if ok else None),
        "latency_p99_ms": _ms(max((r["latency_p99_s"] or 0) for r in ok) if ok else None),
        "clients_cpu_s": round(sum(r.get("cpu_s", 0.0) for r in ok), 2),
    }


def _per_action(doc: dict[str, Any]) -> dict[str, Any]:
    """The controller's and the clients' CPU per completed action (ms)."""
    n = doc.get("completed") or 0
    ctl = (doc.get("controller") or {}).get("cpu_s")
    return {
        "controller_cpu_ms_per_action": round(ctl * 1e3 / n, 4) if n and ctl is not None else None,
        "clients_cpu_ms_per_action": round(doc["clients_cpu_s"] * 1e3 / n, 4) if n else None,
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 3)


def _agent_cores(instant: bool, agent_cores: int | None) -> int:
    """The cores the agent offers: `agent_cores`, or the default (`INSTANT_CORES`; this machine's)."""
    if instant:
        return agent_cores or INSTANT_CORES
    ncpu = len(os.sched_getaffinity(0))
    return min(ncpu, agent_cores or ncpu)


def _start_agent(procs: Procs, instant: bool, cores: int) -> None:
    """One agent named `bench` offering `cores` (`_agent_cores`): the instant bench agent, or the real
    agent with the process executor on cores 0 to `cores` - 1."""
    assert procs.ctl is not None
    ctl = procs.ctl
    if instant:
        procs.bench = start_bench_agents(ctl.agents_addr, ["bench"], 1, cores, "instant", procs.workdir)
        wait_nodes(ctl.status_addr, ["bench"], [a for a, _ in procs.bench], 30)
        return
    cpus = f"0-{cores - 1}" if cores > 1 else "0"
    procs.agents.append(start_real_agent(ctl.agents_addr, "bench", "process", cpus, procs.workdir))
    wait_nodes(ctl.status_addr, ["bench"], procs.agents, 30)


def _resent(doc: dict[str, Any]) -> dict[str, Any]:
    """Resent frames seen from both ends (the gateway's joined + replayed, the clients' own count):
    the larger of the two, and as a fraction of the requests."""
    c = doc["controller"]["counters"]
    requests = doc["wire"].get("requests") or 0
    gateway = c.get("joined", 0) + c.get("replayed", 0)
    resent = max(gateway, doc["wire"].get("resent_after_reconnect", 0))
    return {
        "resent_frames": resent,
        "resent_frames_gateway": gateway,
        "resent_fraction": round(resent / requests, 6) if requests else None,
    }


def run_burst(
    clients: int,
    actions: int,
    sandboxes: int,
    instant: bool,
    agent_cores: int | None,
    timeout: float,
    logs: str | None = None,
) -> dict[str, Any]:
    """The whole run; bounded by `timeout` seconds from the go (set-up has its own 60 s). With
    `logs`, every process's log and the status timeline (status.jsonl) are kept there."""
    out: dict[str, Any] = {
        "clients": clients,
        "actions": actions,
        "sandboxes_per_client": sandboxes,
        "agent": "instant bench agent" if instant else "python -m agent --executor process",
        "agent_cores": _agent_cores(instant, agent_cores),
        "layout": "controller, agent and each client in its own process",
        "machine_cores": os.cpu_count(),
        "goals": GOALS,
    }
    procs = Procs(bench_workdir(logs, "tangram-burst-"), keep=bool(logs))
    try:
        ctl = procs.ctl = ControllerProc(procs.workdir, log_level="INFO" if logs else "WARNING").start()
        _start_agent(procs, instant, out["agent_cores"])
        shares = [actions // clients + (1 if k < actions % clients else 0) for k in range(clients)]
        procs.clients = _spawn_clients(ctl.submit_addr, shares, sandboxes, timeout, procs.workdir)
        cpu0 = ctl.cpu_s() or 0.0
        sampler = procs.start_sampler()
        reports = run_clients(procs.clients, time.monotonic() + 60 + timeout)
        status = sampler.stop()
        out.update(_sum_clients(reports))
        out["controller"] = controller_figures(ctl, status, cpu0)
        out.update(_resent(out))
        out.update(_per_action(out))
    except (RuntimeError, TimeoutError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stats = procs.close()
        if stats:
            out["bench_agent"] = stats
    return out


def goals_met(doc: dict[str, Any]) -> dict[str, bool | None]:
    """Each goal's PASS (True) / FAIL (False) / not measured (None) for a run's document."""
    c = doc.get("controller", {})
    st = c.get("status", {})
    instant = str(doc.get("agent", "")).startswith("instant")
    done = doc.get("completed")
    return {
        "all_completed": None if done is None else done == doc.get("actions"),
        "none_failed": None if "failed" not in doc else not doc["failed"],
        "answered_once": doc.get("answered_once_ok"),
        "status_answer_max_s": at_most(st.get("answer_max_s"), GOALS["status_answer_max_s"]),
        "controller_rss_peak_mib": at_most(c.get("rss_peak_mib"), GOALS["controller_rss_peak_mib"]),
        "resent_fraction": at_most(doc.get("resent_fraction"), GOALS["resent_fraction"]),
        "instant_actions_per_s": (
            at_least(doc.get("actions_per_s"), GOALS["instant_actions_per_s"]) if instant else None
        ),
    }


# table row (figure) -> the goal it is checked against
_ROW_GOAL = {
    "completed": "all_completed",
    "failed (by code)": "none_failed",
    "answered exactly once": "answered_once",
    "actions/s": "instant_actions_per_s",
    "status answer max / p99": "status_answer_max_s",
    "controller RSS peak": "controller_rss_peak_mib",
    "resent frames / requests": "resent_fraction",
}


def _rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, measured, goal) rows of the table."""
    c = doc.get("controller", {})
    st, w, log = c.get("status", {}), doc.get("wire", {}), c.get("log", {})
    once = f"{w.get('answered_once', 0)}/{w.get('requests', 0)}"
    if not doc["answered_once_ok"]:
        once += f" (NOT OK: {w.get('answered_twice_or_more', 0)} twice, {w.get('unanswered', 0)} never)"
    decide = c.get("decide") or {}
    return [
        ("completed", f"{doc['completed']}/{doc['actions']}", "all"),
        ("failed (by code)", json.dumps(doc["failed"]) if doc["failed"] else "0", "0"),
        ("answered exactly once", once, "all"),
        ("actions/s", f"{doc['actions_per_s']}", f"≥ {GOALS['instant_actions_per_s']} (instant)"),
        (
            "agents lost / restarts",
            f"{c.get('counters', {}).get('agents_lost', '-')} / {c.get('agent_restarts')}",
            "0 / 0",
        ),
        (
            "status answer max / p99",
            f"{_fmt(st.get('answer_max_s'))} / {_fmt(st.get('answer_p99_s'))} s "
            + f"({st.get('unanswered', 0)} unanswered)",
            f"≤ {GOALS['status_answer_max_s']} s",
        ),
        ("controller RSS peak", f"{c.get('rss_peak_mib')} MiB", f"≤ {GOALS['controller_rss_peak_mib']} MB"),
        (
            "CPU: controller / clients (per action)",
            f"{c.get('cpu_s')} s / {doc.get('clients_cpu_s')} s "
            f"({_fmt(doc.get('controller_cpu_ms_per_action'))} / "
            f"{_fmt(doc.get('clients_cpu_ms_per_action'))} ms)",
            "-",
        ),
        (
            "decide p99 (highest sample) / max",
            f"{_fmt(st.get('decide_p99_max_ms'))} / {_fmt(decide.get('max_ms'))} ms",
            "-",
        ),
        ("loop lag max (sampled)", f"{_fmt(st.get('loop_lag_max_s'))} s", "-"),
        (
            "resent frames / requests",
            f"{doc.get('resent_frames')} ({_fmt(doc.get('resent_fraction'))})",
            f"≤ {GOALS['resent_fraction']:.0%}",
        ),
        (
            "RetryLater refusals / client retries",
            f"{c.get('counters', {}).get('retry_later_client', '-')} / {doc.get('retried_later')}",
            "-",
        ),
        ("controller log warnings / errors", f"{log.get('warnings')} / {log.get('errors')}", "0 / 0"),
    ]


def _print(doc: dict[str, Any]) -> None:
    console = Console()
    if "error" in doc and "completed" not in doc:
        console.print(f"burst failed: {doc['error']}", markup=False, highlight=False)
        return
    title = f"tangram bench burst: {doc['actions']} no-op execs, {doc['clients']} clients ({doc['agent']}, "
    title += f"{doc.get('agent_cores')} cores)"
    table = Table(title=title)
    met = goals_met(doc)
    for col in ("figure", "measured", "goal", "met"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for row in _rows(doc):
        goal = _ROW_GOAL.get(row[0])
        table.add_row(*row, styled(met[goal]) if goal else "")
    console.print(table)
    console.print(summary(met), markup=False, highlight=False)
    c = doc.get("controller", {})
    for line in [*(c.get("log", {}).get("first") or []), *doc.get("client_errors", [])]:
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if "error" in doc:
        console.print(f"error: {doc['error']}", markup=False, highlight=False)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


@click.command("burst")
@click.option(
    "--clients",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Client processes; each submits its share at once.",
)
@click.option(
    "--actions",
    type=click.IntRange(1, 10_000_000),
    default=10_000,
    show_default=True,
    help="No-op execs in total (the issue's full run: --clients 10 --actions 100000).",
)
@click.option(
    "--sandboxes",
    type=click.IntRange(1, 1024),
    default=4,
    show_default=True,
    help="Sandboxes per client; its execs go round-robin over them.",
)
@click.option(
    "--instant", is_flag=True, help="A bench agent answers every Spawn at once: the controller alone."
)
@click.option(
    "--agent-cores",
    type=click.IntRange(1, 4096),
    default=None,
    help=f"Cores the agent offers (default: this machine's; {INSTANT_CORES} with --instant, one node of "
    "`tangram bench scale`: fewer bound the run by the agent's round trips).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(1, 7200),
    default=600,
    show_default=True,
    help="Seconds the burst may take; each exec's timeout too.",
)
@logs_and_json
def burst(
    clients: int,
    actions: int,
    sandboxes: int,
    instant: bool,
    agent_cores: int | None,
    timeout: float,
    logs: str | None,
    as_json: bool,
) -> None:
    """No-op execs submitted all at once by several client processes, against a local agent."""
    doc = run_burst(clients, actions, sandboxes, instant, agent_cores, timeout, logs)
    if as_json:
        if "completed" in doc:
            doc["met"] = goals_met(doc)
        click.echo(json.dumps({"burst": doc}, indent=2, default=str))
    else:
        _print(doc)
    if "error" in doc and "completed" not in doc:
        raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(client_main())
