"""`tangram down [INVENTORY] [-c NAME]`: stop a cluster. Idempotent.

SIGTERM to the controller (it drains, sends ``Shutdown(reason="down")`` to every agent, and the
agents remove their containers), SIGKILL after ``--timeout``. Then the safety nets: local agents
still running are stopped by pid, agents over SSH by pidfile (``plan.stop_command``), and any
container labelled ``tangram.cluster=<name>`` is removed with the Docker SDK. Finally the state
file goes (``--purge`` also removes logs and node workdirs).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import click

from tangram_cli import state as st


def down_cluster(
    name: str, *, force: bool, purge: bool, timeout_s: float, echo: Callable[[str], None] = click.echo
) -> int:
    """Stop cluster ``name``; returns the exit code (0, or 3 when some SSH host could not be reached)."""
    from tangram_cli.bootstrap import local

    with st.locked(name, timeout_s=timeout_s + 30):
        state = st.load(name)
        if state is None:
            removed = local.remove_labelled_containers(name)
            if removed:
                echo(f"removed {removed} leftover container(s) labelled tangram.cluster={name}")
            if purge:
                st.remove(name, purge=True)
            echo(f"nothing is running for cluster {name!r}")
            return 0
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
            echo(f"controller of {name!r} was not running (stale state)")
        stopped = local.stop_local_agents(
            state, timeout_s=5.0 if not force else 1.0, grace_s=5.0 if alive and not force else 0.5
        )
        for s in stopped:
            echo(f"stopped agent {s} by pid")
        code = 0
        remote_hosts = [h for h in state.hosts if h.connection == "ssh"]
        if remote_hosts:
            from tangram_cli.bootstrap import remote

            failures = remote.stop_agents(state, purge=purge, echo=echo)
            if failures:
                for host, why in failures.items():
                    echo(f"  {host}: {why}")
                code = 3
        removed = local.remove_labelled_containers(name)
        if removed:
            echo(f"removed {removed} container(s) labelled tangram.cluster={name}")
        st.remove(name, purge=purge)
        echo(f"cluster {name} is down" + (" (purged)" if purge else ""))
        return code


@click.command("down")
@click.argument("inventory", required=False)
@click.option(
    "-c", "--cluster", "cluster", metavar="NAME", help="Cluster name (default: from the inventory, or local)."
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option(
    "--timeout",
    default=20.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds to wait for the controller before SIGKILL.",
)
@click.option("--force", is_flag=True, help="Do not wait long for agents; kill by pid / pidfile.")
@click.option("--purge", is_flag=True, help="Also delete logs, journal and node workdirs.")
def command(
    inventory: str | None, cluster: str | None, yes: bool, timeout: float, force: bool, purge: bool
) -> None:
    """Stop a cluster: drain, remove its sandboxes, stop agents and the controller.

    Running it again when nothing runs is fine (exit 0).
    """
    name = cluster
    if name is None and inventory:
        from tangram_cli.bootstrap import remote

        name = remote.cluster_name(inventory)
    if name is None:
        live = st.running()
        name = live[0].name if len(live) == 1 else st.DEFAULT_CLUSTER
    sys.exit(down_cluster(name, force=force, purge=purge, timeout_s=timeout))
