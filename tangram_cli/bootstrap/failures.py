"""What `tangram up INVENTORY` leaves behind when hosts fail, and how it says so.

* Each failed host is recorded in the cluster's ``state.json`` (``ClusterState.failed``: node,
  destination, step, reason, time); a host that comes up in a later `up` is dropped from it.
  `tangram status` shows the recorded ones as ``failed`` rows in NODES (``status_rows``), next to
  the nodes the controller knows, and still shows them when the controller is gone.
* When no agent registered at all, nothing is left half-running: the controller this `up`
  started (or restarted) is stopped, as are agents it started that never registered, and the
  state keeps only the failures (no controller pid, no ports, no hosts), so `status` can list
  them and the next `up` starts afresh. A controller that was already running before this `up`
  is never stopped.
* The closing table and the exit code (``report``): 0 all up, 3 some failed with
  ``--allow-partial``, else 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from tangram_cli import state as st
from tangram_cli.bootstrap import procs


def record(state: st.ClusterState, results: Mapping[str, Any], roles: Mapping[str, str]) -> None:
    """Update ``state.failed`` from this `up`'s per-host ``results`` (remote.HostResult values)."""
    now = time.time()
    kept = [f for f in state.failed if f.get("node") not in results]
    new = [
        {
            "node": r.node,
            "role": roles.get(r.node, ""),
            "destination": r.destination,
            "step": r.step,
            "reason": r.reason,
            "at": now,
        }
        for r in results.values()
        if not r.ok
    ]
    state.failed = kept + new


def stop_if_idle(state: st.ClusterState, *, kept: bool, say: Callable[[str], None]) -> str | None:
    """After an `up` in which no agent registered: unless the controller ran before this `up`
    (``kept``), stop its agents that started but never registered and the controller, and forget
    both in ``state`` (the caller writes it). Returns what was done, or None."""
    if kept:
        return None
    pid = state.controller_pid
    ssh_hosts = [h for h in state.hosts if h.connection == "ssh"]
    if ssh_hosts:
        from tangram_cli.bootstrap import remote

        for name, why in remote.stop_agents(state, purge=False, echo=say).items():
            say(f"{name}: could not stop its agent: {why}")
    how = procs.terminate(pid, timeout_s=10.0, words=(str(st.controller_config_path(state.name)),))
    state.hosts = []
    state.controller_pid = None
    state.ports = {}
    if how == "gone":
        return None
    return (
        f"stopped the controller (pid {pid}) that this `up` started: no agent registered, so nothing "
        f"is left running; `tangram status -c {state.name}` lists the failed hosts"
    )


def _hosts_json(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "node": r.node,
            "destination": r.destination,
            "ok": bool(r.ok),
            "step": r.step,
            "reason": r.reason,
            "started": r.started,
        }
        for r in results.values()
    ]


def report(
    results: Mapping[str, Any],
    state: st.ClusterState,
    *,
    path: str,
    json_out: bool,
    allow_partial: bool,
    stopped: str | None,
) -> int:
    """Print the per-host outcome (a table, or one JSON document) and return the exit code."""
    ok = [r for r in results.values() if r.ok]
    failed = [r for r in results.values() if not r.ok]
    if json_out:
        doc = {"cluster": state.name, "address": None if stopped else state.address, "certs": state.certs}
        doc.update(hosts=_hosts_json(results), controller_stopped=bool(stopped))
        click.echo(json.dumps(doc, sort_keys=True))
    else:
        _print_table(results, state, ok_count=len(ok), stopped=bool(stopped))
    if stopped:
        click.echo(stopped, err=True)
    if not failed:
        return 0
    if ok and allow_partial:
        click.echo(f"error: {len(failed)} host(s) failed: {', '.join(r.node for r in failed)}", err=True)
        click.echo(
            "To fix: see REASON above; rerun `tangram up` after fixing (running agents are kept)", err=True
        )
        return 3
    click.echo(f"error: {len(failed)} of {len(results)} host(s) failed", err=True)
    hint = "see REASON above; rerun `tangram up` after fixing"
    if ok:
        hint += ", or pass --allow-partial to run on the rest"
    tail = "" if stopped else f"; `tangram down {path}` stops what started"
    click.echo(f"To fix: {hint}{tail}", err=True)
    return 1


def _print_table(results: Mapping[str, Any], state: st.ClusterState, *, ok_count: int, stopped: bool) -> None:
    from rich.console import Console

    from tangram_cli.bootstrap.remote import result_table

    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=250)
    out.print(result_table(dict(results)))
    where = "(the controller was stopped)" if stopped else f"with controller {state.address}"
    out.print(f"{ok_count}/{len(results)} agents registered {where}")
    if ok_count:
        out.print(f"export TANGRAM_ADDR={state.address}")
        if state.certs:
            out.print(f"export TANGRAM_CERTS={state.certs}")


# ---------------------------------------------------------------- `tangram status`


def status_rows(failed: Iterable[Mapping[str, Any]], known: Iterable[str] = ()) -> list[dict[str, Any]]:
    """NODES rows for the recorded failures of hosts the controller does not list (``known``)."""
    seen = set(known)
    out = []
    for f in failed:
        name = str(f.get("node") or "?")
        if name in seen:
            continue
        step = f.get("step") or "?"
        out.append(
            {
                "node": name,
                "role": f.get("role") or None,
                "state": "failed",
                "address": f.get("destination"),
                "reason": f"`up` failed at {step}: {f.get('reason') or 'unknown'}",
            }
        )
    return out


def with_failures(records: Mapping[str, Any], state: st.ClusterState) -> dict[str, Any]:
    """The controller's status records plus a ``failed`` row per recorded failure it does not list."""
    from tangram_cli.render import status as rs

    nodes = rs.rows(records, "nodes")
    extra = status_rows(state.failed, (rs.node_name(r) for r in nodes))
    if not extra:
        return dict(records)
    return {**records, "nodes": nodes + extra}


def print_offline(state: st.ClusterState, *, output: str) -> None:
    """`tangram status` of a cluster whose controller is gone but whose last `up` recorded failed
    hosts: print those (a NODES table, or JSON) so the reasons stay visible."""
    from tangram_cli.render import status as rs

    records = {"nodes": status_rows(state.failed)}
    if output == "json":
        doc = {**rs.to_json(records, state), "running": False}
        click.echo(json.dumps(doc, sort_keys=True, default=str))
        return
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=False, width=250)
    from rich import box
    from rich.table import Table

    console.print(f"cluster {state.name}  controller not running  failed hosts {len(records['nodes'])}")
    for _title, headers, body in rs.tables(records, sections=("nodes",)):
        headers, body = rs.drop_empty_columns(headers, body)
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for h in headers:
            t.add_column(h, no_wrap=True)
        for row in body:
            t.add_row(*row)
        console.print(t)
