"""`tangram down [INVENTORY] [-c NAME]`: stop a cluster. Idempotent.

SIGTERM to the controller (it drains, sends ``Shutdown(reason="down")`` to every agent, and the
agents remove their containers), SIGKILL after ``--timeout``. Then the safety nets: local agents
still running are stopped by pid, agents over SSH by pidfile (``plan.stop_command``), and the
containers of *this* cluster (labels ``tangram.cluster=<name>`` and ``tangram.cluster-id=<id>``, the
unique id in its state, see tangram_cli/state.py) are removed with the Docker SDK (over SSH with
``docker rm``). Finally the state file goes (``--purge`` also removes logs and node workdirs).

Containers are only ever found by the cluster's id, never by its bare name, which another cluster
(another user, or another TANGRAM_HOME, on the same Docker daemon) may share: without a state nothing
is removed, and a legacy state (written before ids) leaves the containers to its agents.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from tangram.errors import TangramError
from tangram_cli import state as st
from tangram_cli.hostlist import compress
from tangram_cli.params import Duration, output_option

# Imported where used, not here (start-up cost): bootstrap.teardown and bootstrap.remote (asyncssh) and the
# inventory (pydantic, yaml) only for a cluster with SSH nodes; bootstrap.local only for local agents.


def down_cluster(
    name: str,
    *,
    force: bool,
    purge: bool,
    timeout_s: float,
    echo: Callable[[str], None] = click.echo,
    inventory: str | None = None,
) -> int:
    """Stop cluster ``name``; returns the exit code (0, or 3 when some SSH host could not be reached,
    or could not be purged). With ``purge`` the nodes of ``inventory`` are purged too, state or not."""
    with st.locked(name, timeout_s=timeout_s + 30):
        state = st.load(name)
        hosts, optional = _ssh_hosts(name, state, inventory, purge=purge)
        if state is None and not hosts:
            if purge:
                st.remove(name, purge=True)
            echo(
                f"nothing is running for cluster {name!r} (no state in {st.cluster_dir(name)}: "
                "no containers were removed, as only a cluster's state names its containers)"
            )
            return 0
        if state is not None:
            _stop_here(state, force=force, timeout_s=timeout_s, echo=echo)
        else:
            echo(f"nothing is running for cluster {name!r}; purging what `up` left on {len(hosts)} node(s)")
        failed = _visit(hosts, optional, state.cluster_id if state else "", purge=purge, echo=echo)
        if state is not None:
            _sweep_containers(state, echo)
        return _forget(name, purge=purge, failed=failed, inventory=inventory, echo=echo)


def _visit(
    hosts: list[Any], optional: set[str], cluster_id: str, *, purge: bool, echo: Callable[[str], None]
) -> list[Any]:
    """Stop (and purge) the SSH hosts; returns those that failed, except ``optional`` ones (inventory
    nodes `up` never logged in to: they hold nothing of the cluster), which are only mentioned."""
    from tangram_cli.bootstrap import teardown  # start-up cost: see the note at the top

    done = teardown.stop_hosts(hosts, cluster_id, purge=purge) if hosts else {}
    for host, d in done.items():
        if d.ok and d.did:
            echo(f"{host}: {d.did}")
        elif not d.ok and host in optional:
            echo(
                f"  {host}: skipped ({d.error}): `up` never logged in there, so it holds nothing "
                "of this cluster"
            )
        elif not d.ok:
            echo(f"  {host}: {d.error}" + (f"\n    To fix: {d.hint}" if d.hint else ""))
    return [h for h in hosts if not done[h.name].ok and h.name not in optional]


def _stop_here(state: st.ClusterState, *, force: bool, timeout_s: float, echo: Callable[[str], None]) -> None:
    """The controller (SIGUSR1: its `down` path), then local agents still running, by pid."""
    from tangram_cli.bootstrap import local  # start-up cost: see the note at the top

    alive = state.controller_alive()
    if alive:
        echo(f"stopping controller pid {state.controller_pid} (drain, shut agents down)...")
        # SIGUSR1 is the controller's `down` path: Shutdown("down") to every agent, which then
        # removes its sandboxes; SIGTERM alone would leave the agents running for a restart.
        how = local.terminate(
            state.controller_pid, timeout_s=timeout_s, words=("tangram",), first=signal.SIGUSR1
        )
        if how == "killed":
            echo(f"controller did not stop within {timeout_s:g}s: killed")
    else:
        echo(f"controller of {state.name!r} was not running (stale state)")
    stopped = local.stop_local_agents(
        state, timeout_s=5.0 if not force else 1.0, grace_s=5.0 if alive and not force else 0.5
    )
    for s in stopped:
        echo(f"stopped agent {s} by pid")


def _ssh_hosts(
    name: str, state: st.ClusterState | None, inventory: str | None, *, purge: bool
) -> tuple[list[Any], set[str]]:
    """The SSH hosts `down` visits: those running agents; with ``purge`` also every host `up` logged in
    to (the footprint) and every node of ``inventory``, and the names of the inventory's nodes that
    the footprint shows `up` never logged in to (nothing to purge there). A purge that would strand
    a node's copy of the cluster's keys (no footprint, no inventory: a cluster recorded before
    footprints) is refused."""
    from tangram_cli.bootstrap import teardown  # start-up cost: see the note at the top

    running = [h for h in state.hosts if h.connection == "ssh"] if state else []
    if not purge:
        return running, set()
    from_inventory = []
    if inventory:
        from tangram_cli.inventory import load_inventory  # start-up cost: see the note at the top

        inv = load_inventory(inventory)
        from_inventory = [teardown.host_state(n, inv.cluster) for n in inv.nodes if n.connection == "ssh"]
    recorded = teardown.load_footprint(name)
    hosts = teardown.merge(running, recorded or [], from_inventory)
    touched = {h.name for h in [*running, *(recorded or [])]}
    optional = {h.name for h in from_inventory if h.name not in touched} if recorded is not None else set()
    unknown = [] if inventory else teardown.unrecorded_nodes(name, [*(state.hosts if state else []), *hosts])
    if unknown:
        raise TangramError(
            f"cannot purge cluster {name!r}: nodes {', '.join(unknown)} may hold its keys (agent.key_secret, "
            "controller.key), and no record says where they are; deleting the local state would strand them",
            hint="give the inventory: `tangram down INVENTORY --purge` reaches its nodes; or, if those "
            f"nodes are gone, delete {st.cluster_dir(name)} yourself",
        )
    return hosts, optional


def _forget(
    name: str, *, purge: bool, failed: list[Any], inventory: str | None, echo: Callable[[str], None]
) -> int:
    """Delete the local state; with ``purge`` only once every node was purged: else state.json goes
    (nothing runs) but the cluster directory stays, its footprint listing the nodes still to purge."""
    if purge and failed:
        from tangram_cli.bootstrap import teardown  # start-up cost: see the note at the top

        st.remove(name)
        teardown.write_footprint(name, failed)
        again = f"tangram down {inventory} --purge" if inventory else f"tangram down -c {name} --purge"
        echo(
            f"kept {st.cluster_dir(name)}: {compress([h.name for h in failed])} could not be purged and "
            f"still hold the cluster's files (agent.key_secret, controller.key); run `{again}` once they "
            "can be reached, or delete that directory yourself to give up on them"
        )
        echo(f"cluster {name} is down (not purged)")
        return 3
    st.remove(name, purge=purge)
    echo(f"cluster {name} is down" + (" (purged)" if purge else ""))
    return 3 if failed else 0


def _sweep_containers(state: st.ClusterState, echo: Callable[[str], None]) -> None:
    """Remove the containers left by this cluster's local agents (by its id); a legacy state has no id,
    so nothing is swept and the message says how to find them by hand."""
    from tangram_cli.bootstrap import local  # start-up cost: see the note at the top

    if not state.cluster_id:
        echo(
            f"the state of cluster {state.name!r} has no cluster id (written by an older tangram): "
            f"containers labelled only tangram.cluster={state.name} were left alone, since another "
            "cluster of that name may own them; list yours with "
            f"`docker ps -a --filter label=tangram.cluster={state.name}`"
        )
        return
    removed = local.remove_cluster_containers(state.name, state.cluster_id)
    if removed:
        echo(f"removed {removed} container(s) of cluster {state.name} (id {state.cluster_id})")


@click.command("down")
@click.argument("inventory", required=False)
@click.option(
    "-c", "--cluster", "cluster", metavar="NAME", help="Cluster name (default: from the inventory, or local)."
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option(
    "--timeout",
    default="20s",
    show_default=True,
    type=Duration(0.1, 3600),
    help="Wait this long for the controller before SIGKILL (20, 20s, 1m).",
)
@click.option("--force", is_flag=True, help="Do not wait long for agents; kill by pid / pidfile.")
@click.option("--purge", is_flag=True, help="Also delete logs, journal and node workdirs.")
@output_option("text", "json", help="text; json: what was stopped, as one document on stdout.")
def command(
    inventory: str | None,
    cluster: str | None,
    yes: bool,
    timeout: float,
    force: bool,
    purge: bool,
    output: str,
) -> None:
    """Stop a cluster: drain, remove its sandboxes, stop agents and the controller.

    Running it again when nothing runs is fine (exit 0).
    """
    name = cluster
    if name is None and inventory:
        from tangram_cli.bootstrap import remote  # start-up cost: see the note at the top

        name = remote.cluster_name(inventory)
    if name is None:
        live = st.running()
        name = live[0].name if len(live) == 1 else st.DEFAULT_CLUSTER
    if output != "json":
        sys.exit(down_cluster(name, force=force, purge=purge, timeout_s=timeout, inventory=inventory))
    before = st.load(name)
    was_running = bool(before and before.controller_alive())
    messages: list[str] = []

    def echo(msg: str) -> None:
        messages.append(msg)
        click.echo(msg, err=True)

    code = down_cluster(name, force=force, purge=purge, timeout_s=timeout, echo=echo, inventory=inventory)
    doc = {
        "cluster": name,
        "found": before is not None,
        "controller_was_running": was_running,
        "cluster_id": before.cluster_id if before else None,
        "purged": purge,
        "exit_code": code,
        "messages": messages,
    }
    click.echo(json.dumps(doc, sort_keys=True))
    sys.exit(code)
