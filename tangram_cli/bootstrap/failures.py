"""What `tangram up INVENTORY` leaves behind when hosts fail, and how it says so.

* Each failed host is recorded in the cluster's ``state.json`` (``ClusterState.failed``: node,
  destination, step, reason, time); a host that comes up in a later `up` is dropped from it.
  `tangram status` shows the recorded ones as ``failed`` rows in NODES (``status_rows``), next to
  the nodes the controller knows, and still shows them when the controller is gone.
* What a failed `up` leaves running (``settle``): without ``--allow-partial`` nothing it started
  (the agents it started and a controller it started afresh are stopped again; what ran before
  it is never touched), as a multi-node launch is all or nothing for SkyPilot's `sky launch` and
  Slurm allocations; with ``--allow-partial`` the hosts that came up keep running. When no agent
  registered at all, the controller this `up` started (or restarted) is stopped too, and the
  state keeps only the failures (no controller pid, no ports, no hosts), so `status` can list
  them and the next `up` starts afresh. A controller that ran before this `up` is never stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import click

from tangram_cli import state as st
from tangram_cli.bootstrap import procs
from tangram_cli.hostlist import compress
from tangram_cli.render import status as rs

# Imported where used, not here: teardown (asyncssh) and rich. `tangram status -o json` loads this module
# when the last `up` failed on some hosts, and that path must stay fast (tangram_cli/commands/status.py).


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


@dataclass(frozen=True)
class Settled:
    """What `up` stopped again after its hosts were tried (``settle``)."""

    controller_pid: int | None = None  # the controller it stopped, or None
    agents: tuple[str, ...] = ()  # the nodes whose agents it stopped
    message: str = ""  # one line for the operator ("" when nothing was stopped)


def settle(
    state: st.ClusterState,
    results: Mapping[str, Any],
    *,
    kept: bool,
    fresh: bool,
    allow_partial: bool,
    say: Callable[[str], None],
) -> Settled:
    """After an `up` in which some host failed, stop again what it started, so that:

    * without ``allow_partial`` a failed `up` leaves nothing it started running: the agents it
      started (not those that already ran, nor those it restarted) and a controller it started
      afresh (``fresh``);
    * with ``allow_partial`` only agents that started but never registered are stopped;
    * when no agent registered at all, a controller this `up` started or restarted is stopped too.

    A controller that ran before this `up` (``kept``) is never stopped. ``state`` is updated (the
    caller writes it); HostResult.rolled_back marks each host whose agent was stopped again."""
    if all(r.ok for r in results.values()):
        return Settled()
    registered = any(r.registered for r in results.values())
    whole = not allow_partial or not registered
    agents = [n for n, r in results.items() if r.started == "started" and (whole or not r.registered)]
    stop_ctl = not kept and (fresh and whole or not registered)
    hosts = [h for h in state.hosts if h.name in agents and h.connection == "ssh"]
    if hosts:
        from tangram_cli.bootstrap import teardown  # start-up cost: see the note at the top

        for name, down in teardown.stop_hosts(hosts, state.cluster_id, purge=False).items():
            if not down.ok:
                say(f"{name}: could not stop its agent: {down.error}")
    for name in agents:
        results[name].rolled_back = True
    state.hosts = [h for h in state.hosts if h.name not in agents]
    pid = state.controller_pid if stop_ctl else None
    if stop_ctl:
        how = procs.terminate(pid, timeout_s=10.0, words=(str(st.controller_config_path(state.name)),))
        pid = None if how == "gone" else pid
        state.hosts, state.controller_pid, state.ports = [], None, {}
    return Settled(pid, tuple(agents), _settled_message(state.name, results, pid, agents, registered))


def _settled_message(
    name: str, results: Mapping[str, Any], pid: int | None, agents: list[str], registered: bool
) -> str:
    what = ([f"the controller (pid {pid})"] if pid else []) + (
        [f"the agents on {compress(agents)}"] if agents else []
    )
    if not what:
        return ""
    failed = sum(1 for r in results.values() if not r.ok)
    if not registered:
        why = "no agent registered, so nothing is left running"
    elif pid or any(results[a].registered for a in agents):
        why = (
            f"{failed} of {len(results)} host(s) failed, and without --allow-partial a failed `up` "
            "leaves nothing it started running"
        )
    else:
        why = "their hosts did not register"
    return (
        f"stopped {' and '.join(what)} that this `up` started: {why}; "
        f"`tangram status -c {name}` lists the failed hosts"
    )


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
    nodes = rs.rows(records, "nodes")
    extra = status_rows(state.failed, (rs.node_name(r) for r in nodes))
    if not extra:
        return dict(records)
    return {**records, "nodes": nodes + extra}


def print_offline(state: st.ClusterState, *, output: str) -> None:
    """`tangram status` of a cluster whose controller is gone but whose last `up` recorded failed
    hosts: print those (a NODES table, or JSON) so the reasons stay visible."""
    records = {"nodes": status_rows(state.failed)}
    if output == "json":
        doc = {**rs.to_json(records, state), "running": False}
        click.echo(json.dumps(doc, sort_keys=True, default=str))
        return
    from rich.console import Console  # start-up cost: see the note at the top

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
