"""`tangram bench chaos`: a steady load of mixed actions on a local cluster, and one fault per trial.

Layout (each its own process, all on 127.0.0.1): the controller (`tangram controller` on fixed
ports with `--journal`, and `--state` when it has the option), one agent (`python -m agent`,
process or Docker executor, two emulated GPUs), `--clients` load clients
(`python -m tangram_cli.bench.chaos_load`, the real `tangram.AsyncClient`), and this process,
which injects the faults and watches (status socket, /proc, Docker).

Fault kinds, one per trial, `--trials` trials per kind, one kind after another:

- `agent`: kill -9 the agent while a long action runs; start it again (same node name and work
  directory) once the controller reports it lost.
- `agent-restart`: kill -9 the agent while a long action runs and start it again at once.
- `controller`: kill -9 the controller while a long action runs and start it again at once on
  the same ports with the same journal (and state file).
- `client`: kill -9 a load client while its long action runs; a new client takes its place.
  Its sandboxes and actions must go at the controller's client grace (`--client-grace`).

After each kind the clients drain: actions without an outcome `--lost-after` seconds later are
*slow* and get their timeout (`--action-timeout`) plus 10 s more, by which the controller owes
each a final reply; those still without one are *lost*. Then the clients read their evidence
files and close their sandboxes, and the bench checks that nothing is left: cores in use, action
processes, containers. Figures only; the goals (issue 10) are
printed next to them, never asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import threading
import time
from collections import Counter
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from tangram_cli.bench.chaos_cluster import (
    NODE,
    ChaosCluster,
    LoadClient,
    drain,
    end_checks,
    markers,
    quiesce,
    quit_clients,
    wait_until,
)
from tangram_cli.bench.dispatch import _docker_url
from tangram_cli.bench.goals import styled, summary
from tangram_cli.bench.procs import Procs, bench_workdir, logs_and_json, pct, wait_nodes
from tangram_cli.bootstrap.local import ensure_hostroot

KINDS = ("agent", "controller", "client", "agent-restart")
RECOVER_GOAL_S = {"controller": 5.0, "agent": 3.0, "agent-restart": 3.0}
COUNTS = ("lost", "duplicated", "leftover", "cores_leaked")  # each one's goal is 0
GOALS: dict[str, Any] = {**dict.fromkeys(COUNTS, 0), "recover_s": RECOVER_GOAL_S}
RECOVERY = {
    "agent": "kill -> the new agent registered (status); the bench restarts it once the controller "
    "reports it lost, so the goal applies to restart -> registered",
    "agent-restart": "kill -> the new agent registered (status)",
    "controller": "kill -> first action answered OK after the restart",
    "client": "kill -> the dead client's sandboxes gone (status)",
}


# ------------------------------------------------------------------ faults


def _long_running(
    c: ChaosCluster, client: LoadClient, seconds: float, escape: bool, timeout_s: float = 8.0
) -> bool:
    """Start a CPU-bound action of `seconds` in `client` (`escape`: out of its process group) and
    wait until its process runs."""
    before = {m.tok for m in markers(c.run) if m.client == client.name}
    if not c.tell(client, f"long {seconds:g}" + (" setsid" if escape else "")):
        return False

    def running() -> bool:
        found = markers(c.run)
        return any(m.client == client.name and m.tok.endswith("-long") and m.tok not in before for m in found)

    return wait_until(running, timeout_s) is not None


def _since(t0: float, waited: float | None) -> float | None:
    return None if waited is None else round(time.time() - t0, 3)


def _hit(c: ChaosCluster, trial: int, extra_s: float = 0.0) -> dict[str, Any]:
    """The start of an agent or controller trial: a long action runs (`--long` plus `extra_s`)."""
    rec: dict[str, Any] = {"long_s": c.opts["long_s"] + extra_s, "long_escapes_group": trial % 2 == 1}
    client = c.clients[trial % len(c.clients)]
    rec["long_running"] = _long_running(c, client, rec["long_s"], rec["long_escapes_group"])
    return rec


def fault_agent(c: ChaosCluster, trial: int, phase: str, victims: dict[str, float]) -> dict[str, Any]:
    rec = _hit(c, trial, extra_s=3.0)  # it must outlive the ~3 s the controller takes to notice
    t = rec["t_kill"] = c.kill_agent()

    def lost() -> bool:
        row = c.node()
        return row is not None and row.get("agent_state") != "up"

    rec["detected_s"] = _since(t, wait_until(lost, 20))
    started = time.time()
    c.start_agent()
    rec["recover_s"] = _since(t, wait_until(c.agent_up, 30))
    rec["start_to_up_s"] = None if rec["recover_s"] is None else round(t + rec["recover_s"] - started, 3)
    return rec


def fault_agent_restart(c: ChaosCluster, trial: int, phase: str, victims: dict[str, float]) -> dict[str, Any]:
    rec = _hit(c, trial)
    restarts = int((c.node() or {}).get("restarts") or 0)
    t = rec["t_kill"] = c.kill_agent()
    c.start_agent()
    rec["recover_s"] = _since(t, wait_until(c.agent_up, 30))
    rec["start_to_up_s"] = rec["recover_s"]
    rec["restart_seen"] = int((c.node() or {}).get("restarts") or 0) > restarts
    return rec


def fault_controller(c: ChaosCluster, trial: int, phase: str, victims: dict[str, float]) -> dict[str, Any]:
    rec = _hit(c, trial, extra_s=3.0)  # it must outlive the restart and the client's outcome
    t = rec["t_kill"] = c.kill_controller()
    rec["t_restart"] = time.time()
    c.restart_controller()
    rec["bound_s"] = round(time.time() - t, 3)
    rec["agent_back_s"] = _since(t, wait_until(c.agent_up, 30))
    return rec  # recover_s: from the clients' done files once the phase has drained


def fault_client(c: ChaosCluster, trial: int, phase: str, victims: dict[str, float]) -> dict[str, Any]:
    victim = c.clients[trial % len(c.clients)]
    grace = c.opts["client_grace_s"]
    rec: dict[str, Any] = {"victim": victim.name, "long_s": grace + c.opts["long_s"]}
    rec["long_escapes_group"] = trial % 2 == 1
    rec["long_running"] = _long_running(c, victim, rec["long_s"], rec["long_escapes_group"])
    t = rec["t_kill"] = c.kill_client(victim)
    victims[victim.name] = t + grace + 2.0
    rec["settle_until"] = t + grace + 2.5
    fresh = c.spawn_client(f"{victim.name.split('.')[0]}.{trial + 1}")
    rec["replacement_ok"] = _go(c, fresh, phase)

    def reclaimed() -> bool:
        rows = c.status(("clients",)).get("clients")
        if rows is None:
            return False
        return not any(r.get("name") == victim.name and r.get("sandboxes") for r in rows)

    rec["recover_s"] = _since(t, wait_until(reclaimed, grace + 20, step=0.2))
    return rec


FAULTS = {
    "agent": fault_agent,
    "agent-restart": fault_agent_restart,
    "controller": fault_controller,
    "client": fault_client,
}


# ------------------------------------------------------------------ one kind


def _go(c: ChaosCluster, client: LoadClient, phase: str) -> bool:
    """Wait for a new client's `ready` (if any), then start its lanes for `phase`."""
    if not client.started:
        client.started = c.answer(client, 60) == "ready"
        if not client.started:
            return False
    return c.tell(client, f"go {phase}") and c.answer(client, 30) == "going"


def _settle(c: ChaosCluster, rec: dict[str, Any], victims: dict[str, float]) -> None:
    """Keep the load going and look for leftover processes until the long action would have ended."""
    until = rec.get("settle_until") or rec["t_kill"] + rec["long_s"] + 1.5
    until = max(time.time() + c.opts["post_s"], until)
    while time.time() < until:
        c.scan(victims)
        time.sleep(0.25)


def run_kind(c: ChaosCluster, kind: str, trials: int, deadline: float) -> dict[str, Any]:
    """`trials` faults of one kind under load; the clients' reports and what was left after."""
    notes = [f"{cl.name}: did not start its lanes" for cl in c.clients if not _go(c, cl, kind)]
    recs: list[dict[str, Any]] = []
    victims: dict[str, float] = {}
    for trial in range(trials):
        if time.monotonic() + c.opts["trial_reserve_s"] > deadline:
            notes.append(f"stopped after {trial} trials: --timeout")
            break
        time.sleep(c.opts["warm_s"])
        rec = FAULTS[kind](c, trial, kind, victims)
        _settle(c, rec, victims)
        recs.append(rec)
    reports = drain(c)
    ended = c.ended()
    if kind == "controller":
        _controller_recovery(recs, ended)
    held = quiesce(c, victims)  # its last scan adds to the leftovers taken below
    return {
        "trials": recs,
        "reports": reports,
        "quiesce": held,
        "leftovers": c.leftovers.take(),
        "notes": notes,
        "grace_s": c.opts["client_grace_s"],
    }


def _controller_recovery(recs: list[dict[str, Any]], ended: dict[str, tuple[float, str]]) -> None:
    """kill -> the first action answered OK after the restart, per trial (None: none before the next kill)."""
    oks = sorted(t for t, outcome in ended.values() if outcome == "ok")
    for k, rec in enumerate(recs):
        stop = recs[k + 1]["t_kill"] if k + 1 < len(recs) else float("inf")
        first = next((t for t in oks if rec["t_restart"] <= t < stop), None)
        rec["recover_s"] = None if first is None else round(first - rec["t_kill"], 3)


# ------------------------------------------------------------------ figures


def summarize(kind: str, raw: dict[str, Any], late: int) -> dict[str, Any]:
    """The figures of one fault kind from its raw material (trials, client reports, quiesce)."""
    reports = [r for r in raw["reports"] if "error" not in r]
    q, left = raw["quiesce"], raw["leftovers"]
    errors: Counter[str] = Counter()
    for r in reports:
        errors.update(r["errors"])
    detail = _detail(raw, reports, late)
    recover = [t.get("recover_s") for t in raw["trials"]]
    containers = len(q["containers"])
    out = {
        "trials": len(raw["trials"]),
        "requests": sum(r["requests"] for r in reports),
        "ok": sum(r["ok"] for r in reports),
        "lost": len(detail["lost_unanswered"]) + len(detail["lost_client_gave_up"]),
        "slow": len(detail["slow"]),  # answered only after --lost-after, within their timeout
        "duplicated": detail["duplicate_finals"] + len(detail["ran_twice_or_more"]) + late,
        "leftover": left["processes"] + containers,
        "leftover_containers": containers,
        "cores_leaked": (q["cores_used"] or 0) + left["cores_burned"],
        "errors": dict(sorted(errors.items())),
        "recover_s": recover,
        "recover_max_s": max((r for r in recover if r is not None), default=None),
        "recover_p50_s": pct([r for r in recover if r is not None], 0.5),
        "not_recovered": sum(r is None for r in recover),
        "recovery": RECOVERY[kind],
        "start_to_up_max_s": _max(raw["trials"], "start_to_up_s"),
        "detected_max_s": _max(raw["trials"], "detected_s"),
        "grace_s": raw["grace_s"],
        "detail": detail,
    }
    out["met"] = _met(kind, out)
    return out


def _detail(raw: dict[str, Any], reports: list[dict[str, Any]], late: int) -> dict[str, Any]:
    """What stands behind each figure (the lists are complete: `lost` and `duplicated` count them)."""
    q, left = raw["quiesce"], raw["leftovers"]
    local: Counter[str] = Counter()
    for r in reports:
        local.update(r["local_outcomes"])
    return {
        "lost_unanswered": [d for r in reports for d in r["unanswered"]],
        "lost_client_gave_up": [d for r in reports for d in r["gave_up"]],
        "slow": [d for r in reports for d in r.get("slow", [])],
        "outcomes_without_a_reply": dict(local),
        "duplicate_finals": sum(r["duplicate_finals"] for r in reports),
        "duplicate_final_ops": [o for r in reports for o in r.get("duplicate_final_ops", [])][:10],
        "late_duplicate_finals": late,
        "replayed_finals": sum(r.get("replayed_finals", 0) for r in reports),
        "replayed_final_ops": [o for r in reports for o in r.get("replayed_final_ops", [])][:10],
        "ran_twice_or_more": [t for r in reports for t in r["evidence"]["ran_twice_or_more"]],
        "evidence": _evidence(reports),
        "leftover_processes": left["processes"],
        "leftover_burning": left["burning"],
        "leftover_examples": left["examples"],
        "leftover_containers": q["containers"][:10],
        "cores_used_at_quiesce": q["cores_used"],
        "cores_burned_by_leftovers": left["cores_burned"],
        "quiesce": {k: v for k, v in q.items() if k != "containers"},
        "trials": [_round(t) for t in raw["trials"]],
        "client_errors": [r["error"] for r in raw["reports"] if "error" in r]
        + [e for r in reports for e in r.get("lane_errors", [])],
        "resent": sum(r.get("resent", 0) for r in reports),
        "stray_replies": sum(r.get("stray_replies", 0) for r in reports),
        "notes": raw["notes"],
    }


def _evidence(reports: list[dict[str, Any]]) -> dict[str, Any]:
    total: Counter[str] = Counter()
    unreadable: Counter[str] = Counter()
    for r in reports:
        total.update({k: v for k, v in r["evidence"].items() if isinstance(v, int)})
        unreadable.update(r["evidence"].get("unreadable_by_code") or {})
    return {**total, "unreadable_by_code": dict(unreadable)}


def _round(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}


def _max(trials: list[dict[str, Any]], key: str) -> float | None:
    return max((t[key] for t in trials if t.get(key) is not None), default=None)


def _met(kind: str, fig: dict[str, Any]) -> bool:
    """Counts at their goals, and recovery within its goal. For `agent` the bench itself waits
    until the controller reports the loss (~3 heartbeats) before it restarts the agent, so the
    recovery goal applies to restart -> registered there."""
    goal = RECOVER_GOAL_S.get(kind)
    timed = fig["start_to_up_max_s"] if kind == "agent" else fig["recover_max_s"]
    timely = goal is None or (fig["not_recovered"] == 0 and (timed or 0) <= goal)
    counts = all(fig[k] == 0 for k in COUNTS)
    return bool(fig["trials"]) and counts and timely


# ------------------------------------------------------------------ the run


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Any:
    """SIGTERM stops the run like Ctrl-C does (so everything it started is cleaned up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _docker_problem() -> str | None:
    """Why the Docker executor cannot run here (None: it can; the sandbox image is imported)."""
    if _docker_url() is None:
        return "no Docker daemon answers (set DOCKER_HOST)"

    try:
        ensure_hostroot()
    except Exception as exc:  # noqa: BLE001 - the reason is the figure
        return f"dockerd cannot run a sandbox container: {' '.join(str(exc).split())[:300]}"
    return None


def _start(c: ChaosCluster) -> None:
    ctl = c.start_controller()
    agent = c.start_agent()
    wait_nodes(ctl.status_addr, [NODE], [agent], 60)
    for k in range(c.opts["clients"]):
        c.spawn_client(f"load-{k}")


def run_chaos(
    trials: int,
    kinds: list[str],
    executor: str,
    opts: dict[str, Any],
    timeout: float,
    logs: str | None = None,
) -> dict[str, Any]:
    """The whole run, bounded by `timeout` seconds; every process and container it started is
    gone when it returns (with `logs`, the logs stay in that directory)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    out: dict[str, Any] = {
        "executor": executor,
        "kinds": kinds,
        "trials_per_kind": trials,
        "options": opts,
        "goals": GOALS,
        "layout": "controller, agent and each load client in its own process",
        "machine_cores": os.cpu_count(),
    }
    if executor == "docker" and (problem := _docker_problem()):
        out["error"] = problem
        return out
    procs = Procs(bench_workdir(logs, "tangram-chaos-"), keep=bool(logs))
    c = ChaosCluster(procs, secrets.token_hex(4), executor, opts)
    out.update(run_id=c.run, controller_state_file=c.state, controller_journal=True)
    raw: dict[str, dict[str, Any]] = {}
    late: dict[str, int] = {}
    try:
        with _sigterm_as_interrupt():
            _start(c)
            for kind in kinds:
                if time.monotonic() + opts["trial_reserve_s"] > deadline:
                    out.setdefault("skipped", []).append(kind)
                    continue
                out["interrupted_kind"] = kind  # removed once the kind is done
                raw[kind] = run_kind(c, kind, trials, deadline)
                del out["interrupted_kind"]
            late = quit_clients(c)
            out["end"] = end_checks(c)
    except (RuntimeError, TimeoutError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        out["error"] = "interrupted"
    finally:
        out["controller_log"] = procs.ctl.log_lines() if procs.ctl is not None else {}
        out["cleanup"] = c.cleanup()
        procs.close()
        c.close_pipes()
        c.cleanup()
    out["by_kind"] = {k: summarize(k, r, late.get(k, 0)) for k, r in raw.items()}
    out["met"] = bool(raw) and all(f["met"] for f in out["by_kind"].values()) and "error" not in out
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


# ------------------------------------------------------------------ output


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _recover(kind: str, f: dict[str, Any]) -> str:
    goal = RECOVER_GOAL_S.get(kind)
    text = f"{_fmt(f['recover_p50_s'])} / {_fmt(f['recover_max_s'])}"
    if f["not_recovered"]:
        text += f", {f['not_recovered']} never"
    if kind == "agent":
        text += f"; restart→up max {_fmt(f['start_to_up_max_s'])}"
    return text + (f" (≤ {goal:g})" if goal is not None else f" (grace {f['grace_s']:g})")


ROWS: list[tuple[str, str, Any]] = [
    ("trials", "", lambda k, f: str(f["trials"])),
    ("ok/requests", "", lambda k, f: f"{f['ok']}/{f['requests']}"),
    ("lost", "0", lambda k, f: str(f["lost"])),
    ("duplicated", "0", lambda k, f: str(f["duplicated"])),
    ("replayed after a resend", "", lambda k, f: str(f["detail"].get("replayed_finals", 0))),
    (
        "leftover proc+ctr",
        "0",
        lambda k, f: f"{f['detail']['leftover_processes']}+{f['leftover_containers']}",
    ),
    ("cores leaked", "0", lambda k, f: str(f["cores_leaked"])),
    ("slow (answered late)", "", lambda k, f: str(f.get("slow", 0))),
    ("recover p50/max s", "in cell", _recover),
    ("errors (allowed)", "", lambda k, f: str(sum(f["errors"].values()))),
    ("met", "all", lambda k, f: styled(f["met"])),
]


def _print(doc: dict[str, Any]) -> None:
    console = Console()
    title = (
        f"tangram bench chaos: {doc['trials_per_kind']} trials per fault kind, {doc['executor']} executor, "
        f"{doc['options']['clients']} clients x {doc['options']['lanes']} lanes"
    )
    table = Table(title=title)
    by_kind = doc.get("by_kind", {})
    table.add_column("figure")
    table.add_column("goal", justify="right")
    for kind in by_kind:
        table.add_column(kind, justify="right")
    for name, goal, cell in ROWS:
        table.add_row(name, goal, *(cell(kind, fig) for kind, fig in by_kind.items()))
    console.print(table)
    if by_kind:
        console.print(summary({k: f.get("met") for k, f in by_kind.items()}), markup=False, highlight=False)
    for kind, fig in by_kind.items():
        d = fig["detail"]
        errors = " ".join(f"{c} {n}" for c, n in fig["errors"].items()) or "none"
        lines = [f"recovery = {fig['recovery']}", f"errors: {errors}", *d["notes"], *d["client_errors"][:3]]
        lines += [f"lost: {x}" for x in (d["lost_unanswered"] + d["lost_client_gave_up"])[:3]]
        lines += [f"ran twice: {x}" for x in d["ran_twice_or_more"][:3]]
        lines += [f"two finals: {x}" for x in d["duplicate_final_ops"][:3]]
        lines += [f"replayed after a resend: {x}" for x in d.get("replayed_final_ops", [])[:3]]
        lines += [f"leftover: {x}" for x in d["leftover_examples"][:3]]
        for line in lines:
            console.print(f"  {kind}: {line}", markup=False, highlight=False, soft_wrap=True)
    for line in doc.get("controller_log", {}).get("first", [])[:5]:
        console.print(f"  controller log: {line}", markup=False, highlight=False, soft_wrap=True)
    for key in ("skipped", "error"):
        if key in doc:
            console.print(f"{key}: {doc[key]}", markup=False, highlight=False)


def _kinds(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    kinds = [k.strip() for k in value.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise click.BadParameter(f"expected a comma list of {', '.join(KINDS)}; got {value!r}")
    return kinds


# (flag, the opts key it sets or None for a parameter of its own, type, default, help)
OPTIONS: list[tuple[str, str | None, Any, Any, str]] = [
    ("--trials", None, click.IntRange(1, 10_000), 5, "Faults per kind (the issue's goal: 100)."),
    ("--executor", None, click.Choice(["process", "docker"]), "process", "The agent's executor."),
    ("--clients", "clients", click.IntRange(1, 16), 2, "Load client processes."),
    ("--lanes", "lanes", click.IntRange(1, 64), 2, "Action loops per client, each with its own sandbox."),
    (
        "--client-grace",
        "client_grace_s",
        click.FloatRange(1, 600),
        5.0,
        "The controller's client grace (s): a dead client's sandboxes go then.",
    ),
    (
        "--long",
        "long_s",
        click.FloatRange(1, 120),
        4.0,
        "Seconds of the CPU-bound action running when a fault hits (agent: +3 s; client: + the grace).",
    ),
    (
        "--lost-after",
        "lost_after_s",
        click.FloatRange(1, 600),
        10.0,
        "After a kind's last trial: an action with no outcome this much later is slow (and lost "
        "if it has none by its timeout + 10 s).",
    ),
    ("--action-timeout", "action_timeout_s", click.FloatRange(1, 3600), 30.0, "Each action's timeout (s)."),
    (
        "--timeout",
        None,
        click.FloatRange(10, 86400),
        1800,
        "Seconds the whole run may take; kinds and trials that do not fit are skipped.",
    ),
]


def _options(fn: Any) -> Any:
    for flag, key, kind, default, text in reversed(OPTIONS):
        name = key or flag.lstrip("-").replace("-", "_")
        fn = click.option(flag, name, type=kind, default=default, show_default=True, help=text)(fn)
    return fn


@click.command("chaos")
@click.option(
    "--kinds", default=",".join(KINDS), show_default=True, callback=_kinds, help="Fault kinds, in this order."
)
@click.option(
    "--staging/--no-staging",
    default=None,
    help="Run the controller with staged starts on or off (scheduler.stage_starts); default: the "
    "controller's default.",
)
@_options
@logs_and_json
def chaos(
    kinds: list[str],
    staging: bool | None,
    trials: int,
    executor: str,
    timeout: float,
    logs: str | None,
    as_json: bool,
    **given: Any,
) -> None:
    """Kill -9 agents, the controller and clients under a steady mixed load; count what is lost,
    run twice, left running or left holding cores, and how long recovery takes."""
    opts = {**given, "stage_starts": staging, "warm_s": 1.0, "post_s": 1.0}
    opts["trial_reserve_s"] = 20.0 + given["long_s"]
    doc = run_chaos(trials, kinds, executor, opts, timeout, logs)
    if as_json:
        click.echo(json.dumps({"chaos": doc}, indent=2, default=str))
    else:
        _print(doc)
    if "error" in doc and not doc.get("by_kind"):
        raise SystemExit(1)
