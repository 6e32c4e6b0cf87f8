"""`tangram status [INVENTORY] [-c NAME] [--watch [DURATION]] [-o table|wide|json]`.

Reads the controller's status socket (``StatusReq`` -> ``Status.records``) and renders a header
line and NODES / SERVICES / APIS / QUEUE tables (tangram_cli/render/status.py). Exit 4 with a
hint when no cluster is recorded or its controller does not answer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import UTC, datetime

import click

from tangram.errors import ClusterNotFound, ControllerUnreachable
from tangram_cli import state as st
from tangram_cli.params import Duration, output_option
from tangram_cli.render import status as rs

# Imported where used, not here: `tangram_cli.bootstrap` (only an inventory argument or a failed
# `up` needs it) and rich (only tables need it). Scripts poll `status -o json`; both would add to
# every call's start-up time.


def _target(inventory: str | None, cluster: str | None, output: str = "table") -> st.ClusterState:
    name = cluster
    if name is None and inventory:
        from tangram_cli.bootstrap import remote

        name = remote.cluster_name(inventory)
    try:
        return st.find(name)
    except ClusterNotFound:
        old = st.load(name or os.environ.get("TANGRAM_CLUSTER") or st.DEFAULT_CLUSTER)
        if old is None or not old.failed or old.controller_alive():
            raise
        from tangram_cli.bootstrap import failures  # a failed `up` stopped it: show why

        failures.print_offline(old, output=output)
        raise ClusterNotFound(
            f"cluster {old.name!r} is not running: its last `tangram up` failed on every host and stopped "
            "the controller",
            hint=f"fix each REASON above, then `tangram up {old.inventory}`; `tangram down -c {old.name}` "
            "forgets the cluster",
        ) from None


def _fetch(state: st.ClusterState, limit: int) -> dict:
    try:
        records = st.query_status(state.status_address, limit=limit, timeout_s=3.0, certs=state.certs or None)
    except ControllerUnreachable as exc:
        raise ControllerUnreachable(
            f"cluster {state.name}: the controller at {state.status_address} does not answer ({exc})",
            hint=f"check {st.logs_dir(state.name) / 'controller.log'}; `tangram down -c {state.name}` "
            "then `tangram up` restarts it",
        ) from None
    if not state.failed:
        return records
    from tangram_cli.bootstrap import failures  # hosts the last `up` could not bootstrap

    return failures.with_failures(records, state)


@click.command("status")
@click.argument("inventory", required=False)
@click.option("-c", "--cluster", metavar="NAME", help="Cluster name (default: the running one, else local).")
@click.option(
    "-w",
    "--watch",
    "watch",
    is_flag=False,
    flag_value=2.0,
    default=None,
    type=Duration(0.2, 3600),
    metavar="[DURATION]",
    help="Redraw every DURATION (2s without a value; 5, 5s, 500ms, 1m).",
)
@output_option(
    "table",
    "wide",
    "json",
    json_alias=True,
    help="table; wide: every column and section, all running actions; json: the records, for scripts.",
)
@click.option(
    "-a", "--all", "show_all", is_flag=True, help="Every section and column, all running actions (-o wide)."
)
@click.option("-R", "--unhealthy", is_flag=True, help="Only nodes that are not healthy.")
@click.option("--nodes", "only", flag_value="nodes", help="Only the NODES table.")
@click.option("--services", "only", flag_value="services", help="Only the SERVICES table.")
@click.option("--apis", "only", flag_value="apis", help="Only the APIS table (and KEYS: API key pools).")
@click.option("--jobs", "only", flag_value="jobs", help="Only the JOBS table (RL jobs, their shares).")
@click.option("--queue", "only", flag_value="queue", help="Only the QUEUE table.")
@click.option(
    "--limit",
    default=20,
    show_default=True,
    type=click.IntRange(0, 10_000),
    help="Rows of waiting and of running actions to fetch.",
)
def command(
    inventory: str | None,
    cluster: str | None,
    watch: float | None,
    output: str,
    show_all: bool,
    unhealthy: bool,
    only: str | None,
    limit: int,
) -> None:
    """Show nodes, services, APIs, running actions and the queue of a running cluster.

    Running actions are listed first (at most 10; -a or -o wide: all that were fetched), then the
    waiting ones (PD) with why they wait; a line says how many more there are.
    """
    state = _target(inventory, cluster, output)
    sections = (only,) if only else rs.KNOWN_SECTIONS
    wide = output == "wide" or show_all

    def draw() -> object:
        records = _fetch(state, limit)
        return rs.renderable(records, state, wide=wide, unhealthy_only=unhealthy, sections=sections)

    if output == "json":
        if watch is None:
            click.echo(json.dumps(rs.to_json(_fetch(state, limit), state), sort_keys=True, default=str))
            return
        try:
            while True:
                click.echo(json.dumps(rs.to_json(_fetch(state, limit), state), sort_keys=True, default=str))
                sys.stdout.flush()
                time.sleep(watch)
        except KeyboardInterrupt:
            return

    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=False, width=250)
    if watch is None:
        console.print(draw())
        return
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(draw(), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(watch)
                    live.update(draw())
        else:
            while True:
                stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                console.print(f"--- {stamp}")
                console.print(draw())
                sys.stdout.flush()
                time.sleep(watch)
    except KeyboardInterrupt:
        return
