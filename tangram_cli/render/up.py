"""What `tangram up INVENTORY` shows: per-host progress as it happens, then the per-host table, the
counts and the exit hint (the work itself is bootstrap/remote.py's, which returns an UpOutcome).

Progress goes to stderr. On a terminal, a live table (one row per host: step, seconds, detail)
with retries and failures also printed above it; elsewhere one line per finished step, with
timings, one per retry, one per failure (``-v`` adds a line as each step starts):

    [  0.31s] node-a: connect 0.29s
    [  5.40s] node-d: connect: attempt 1/3 failed: timed out after 5s connecting to ...; retrying in 0.6s
    [ 17.20s] node-d: connect FAILED after 17.18s: timed out after 5s connecting to ... (3 attempts)
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tangram_cli.bootstrap.hoststeps import HostResult, StepEvent
from tangram_cli.hostlist import compress


def _console(stderr: bool = False) -> Any:
    out = Console(stderr=stderr, highlight=False, markup=False)  # names and reasons are not markup
    return out if out.is_terminal else Console(stderr=stderr, highlight=False, markup=False, width=250)


class Progress:
    """Consumes the StepEvents of one `up` and shows them (a row per host, made at its first event);
    ``quiet`` shows nothing."""

    def __init__(self, *, quiet: bool = False, verbose: int = 0) -> None:
        self.console = _console(stderr=True)
        self.quiet, self.verbose = quiet, verbose
        self.t0 = time.monotonic()
        self.rows: dict[str, dict[str, Any]] = {}
        self.live: Any = None

    def __enter__(self) -> Progress:
        if self.console.is_terminal and not self.quiet:
            self.live = Live(self._table(), console=self.console, refresh_per_second=8, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def __call__(self, ev: StepEvent) -> None:
        if self.quiet:
            return
        row = self.rows.setdefault(ev.node, {"since": time.monotonic()})
        row.update(step=ev.step, kind=ev.kind, detail=ev.detail)
        if ev.kind == "failed" or (ev.step == "wait" and ev.kind == "done"):
            row["until"] = time.monotonic()  # the host is finished: its clock stops
        line = self._line(ev)
        if self.live is not None:
            if line and ev.kind in ("retry", "failed"):
                self.live.console.print(line)
            self.live.update(self._table())
        elif line:
            self.console.print(line, soft_wrap=True)

    def say(self, message: str) -> None:
        """A line about the cluster as a whole (the controller started, kept, restarted)."""
        if not self.quiet:
            (self.live.console if self.live is not None else self.console).print(message, soft_wrap=True)

    def _line(self, ev: StepEvent) -> str:
        at = f"[{time.monotonic() - self.t0:7.2f}s] {ev.node}: {ev.step}"
        took = f"{ev.seconds:.2f}s" if ev.seconds is not None else ""
        if ev.kind == "done":
            return f"{at} {took}" + (f": {ev.detail}" if ev.detail else "")
        if ev.kind == "failed":
            return f"{at} FAILED after {took}: {ev.detail}"
        if ev.kind == "retry":
            return f"{at}: {ev.detail}"
        if ev.kind == "progress" and ev.step != "wait":
            return f"{at}: {ev.detail}"
        if ev.kind == "start" and self.verbose:
            return f"{at} ..."
        return ""

    def _table(self) -> Any:
        t = Table(box=None, header_style="bold", pad_edge=False)
        for h in ("NODE", "STEP", "TIME", "DETAIL"):
            t.add_column(h, no_wrap=True)
        now = time.monotonic()
        for node, row in self.rows.items():
            detail = {"failed": "FAILED: ", "retry": "retry: "}.get(row.get("kind", ""), "") + row.get(
                "detail", ""
            )
            t.add_row(node, row.get("step", ""), f"{row.get('until', now) - row['since']:.1f}s", detail[:100])
        return t


# ---------------------------------------------------------------- the result


def result_word(r: HostResult) -> str:
    if r.ok:
        return "ok (stopped again)" if r.rolled_back else (f"ok ({r.started})" if r.started else "ok")
    return "FAILED (agent registered)" if r.registered else "FAILED"


def result_table(results: dict[str, HostResult]) -> Any:
    t = Table(box=None, header_style="bold", pad_edge=False)
    for h in ("NODE", "DESTINATION", "RESULT", "STEP", "TIME"):
        t.add_column(h, no_wrap=True)
    t.add_column("REASON", no_wrap=False)
    for r in results.values():
        total = f"{sum(r.timings.values()):.2f}s" if r.timings else "-"
        t.add_row(r.node, r.destination, result_word(r), r.step, total, r.reason or "-")
    return t


def hosts_json(results: dict[str, HostResult]) -> list[dict[str, Any]]:
    keys = ("node", "destination", "step", "reason", "hint", "started", "registered", "attempts")
    out = []
    for r in results.values():
        doc = {k: getattr(r, k) for k in keys}
        doc.update(ok=bool(r.ok), bootstrapped=bool(r.bootstrapped), rolled_back=r.rolled_back)
        doc["timings"] = {k: round(v, 3) for k, v in r.timings.items()}
        out.append(doc)
    return out


def counts_line(outcome: Any) -> str:
    """``7/8 agents registered with controller tcp://...; 7/8 hosts bootstrapped; ...``"""
    n, state = len(outcome.results), outcome.state
    where = (
        "(the controller was stopped)" if state.controller_pid is None else f"with controller {state.address}"
    )
    line = (
        f"{outcome.count('registered')}/{n} agents registered {where}; "
        f"{outcome.count('bootstrapped')}/{n} hosts bootstrapped"
    )
    anyway = [r.node for r in outcome.results.values() if r.registered and not r.bootstrapped]
    if anyway:
        line += f"; {compress(anyway)}: not bootstrapped, but the agent already running there is registered"
    return line


def print_outcome(outcome: Any, *, json_out: bool) -> int:
    """The table (or one JSON document on stdout), what was stopped again, the error and hint;
    returns the exit code."""
    state, code = outcome.state, outcome.exit_code
    if json_out:
        doc = {"cluster": state.name, "address": state.address if state.controller_pid else None}
        doc.update(certs=state.certs, hosts=hosts_json(outcome.results), exit_code=code)
        doc.update(
            controller_stopped=bool(outcome.settled.controller_pid), stopped=list(outcome.settled.agents)
        )
        doc["counts"] = {w: outcome.count(w) for w in ("bootstrapped", "registered")}
        click.echo(json.dumps(doc, sort_keys=True))
    else:
        out = _console()
        out.print(result_table(outcome.results))
        out.print(counts_line(outcome), soft_wrap=True)
        if state.controller_pid is not None and (outcome.count("registered") or outcome.others):
            out.print(f"export TANGRAM_ADDR={state.address}")
            if state.certs:
                out.print(f"export TANGRAM_CERTS={state.certs}")
    if outcome.settled.message:
        click.echo(outcome.settled.message, err=True)
    if code:
        _print_error(outcome, code)
    return code


def _print_error(outcome: Any, code: int) -> None:
    failed = outcome.failed
    click.echo(
        f"error: {len(failed)} of {len(outcome.results)} host(s) failed: {', '.join(r.node for r in failed)}",
        err=True,
    )
    limit = f" --limit {outcome.options.limit}" if outcome.options.limit else ""
    hint = f"see REASON above; rerun `tangram up {outcome.path}{limit}` after fixing"
    if code == 3:
        hint += " (running agents are kept)"
    elif len(failed) < len(outcome.results):
        hint += ", or pass --allow-partial to keep the hosts that came up running"
    if outcome.others and outcome.state.controller_pid is not None:
        hint += f"; the cluster's {outcome.others} other agent(s) keep running"
    click.echo(f"To fix: {hint}", err=True)
    by_hint: dict[str, list[str]] = {}
    for r in failed:
        if r.hint:
            by_hint.setdefault(r.hint, []).append(r.node)
    for text, nodes in by_hint.items():
        click.echo(f"  {compress(nodes)}: {text}", err=True)
