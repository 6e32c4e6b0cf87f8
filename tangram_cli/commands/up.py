"""`tangram up [INVENTORY]`: start a cluster and wait until every agent has registered.

Without an inventory (no argument, no ``-i``, no ``TANGRAM_INVENTORY``) it starts the local
default: controller plus one agent on this machine (bootstrap/local.py). With one it bootstraps
every host over SSH (bootstrap/remote.py). A controller that died is restarted in place, on its
recorded ports (bootstrap/restart.py). Exit codes: 0 up, 1 failed, 2 bad inventory or
usage, 3 some hosts failed (with ``--allow-partial``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import click

from tangram.errors import ConfigError
from tangram_cli import state as st


def _gpu_mem(value: str | None) -> int | None:
    if value is None:
        return None
    from tangram_cli.inventory import parse_size_mib

    try:
        return parse_size_mib(value)
    except ValueError as exc:
        raise ConfigError(f"--gpu-mem: {exc}", hint="write e.g. --gpu-mem 16GiB") from None


def _duration_s(value: str) -> float:
    from tangram_cli.inventory import parse_duration_ms

    try:
        return float(value) if value.replace(".", "", 1).isdigit() else parse_duration_ms(value) / 1000
    except ValueError as exc:
        raise ConfigError(f"--timeout: {exc}", hint="write e.g. --timeout 300s") from None


def print_ready(state: st.ClusterState, *, started: bool, how: str = "", summary: str | None = None) -> None:
    """The closing lines of `up`. ``how``: "started", "running" or "restarted" (in place)."""
    agents = len(state.hosts)
    how = how or ("started" if started else "running")
    verb = {"started": "is up", "restarted": "is up again", "running": "is already running"}.get(how, "is up")
    if summary:
        click.echo(summary)
    click.echo(
        f"cluster {state.name} {verb}: controller {state.address} (pid {state.controller_pid}), "
        f"{agents} agent{'s' if agents != 1 else ''}"
        + (f", executor {state.executor}" if state.executor else "")
        + (f", gpus {state.gpus}" if state.gpus else "")
    )
    if state.inventory == "<local default>":
        from tangram_cli.bootstrap.local import security_line

        click.echo(security_line(state))
    click.echo(f"logs: {st.logs_dir(state.name)}")
    click.echo("next: `tangram status`, `tangram demo`, `tangram down`")
    click.echo(f"export TANGRAM_ADDR={state.address}")
    if state.certs:
        click.echo(f"export TANGRAM_CERTS={state.certs}")


@click.command("up")
@click.argument("inventory", required=False)
@click.option(
    "-i", "--inventory", "inventory_opt", metavar="FILE", help="Inventory file (or TANGRAM_INVENTORY)."
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask (there is nothing to confirm yet).")
@click.option("--dry-run", is_flag=True, help="Print the bootstrap plan and stop.")
@click.option("--limit", metavar="HOSTLIST", help="Only these nodes (a hostlist such as cpu-[01-02]).")
@click.option(
    "--parallel", default=8, show_default=True, type=click.IntRange(1, 64), help="SSH connections in flight."
)
@click.option("--timeout", "timeout", default="300s", show_default=True, help="Wait this long for agents.")
@click.option(
    "--allow-partial", is_flag=True, help="Exit 3 (not 1) and keep the cluster when some hosts fail."
)
@click.option("--force", is_flag=True, help="Restart agents even where they already run.")
@click.option("--foreground", is_flag=True, help="Stay attached; Ctrl-C stops the cluster.")
@click.option(
    "--executor",
    type=click.Choice(["auto", "docker", "process"]),
    default="auto",
    show_default=True,
    help="Local default: sandbox executor.",
)
@click.option(
    "--gpus", type=click.IntRange(0, 64), default=None, help="Local default: emulated GPU count (8)."
)
@click.option(
    "--gpu-mem", default=None, metavar="SIZE", help="Local default: memory per emulated GPU (80GiB)."
)
@click.option(
    "--curve/--insecure",
    default=True,
    show_default=True,
    help="Local default: CURVE keys (default; an inventory always uses them), or --insecure: plain TCP "
    "on 127.0.0.1 that any local user can connect to, as agent or client (development only).",
)
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.pass_context
def command(
    ctx: click.Context,
    inventory: str | None,
    inventory_opt: str | None,
    yes: bool,
    dry_run: bool,
    limit: str | None,
    parallel: int,
    timeout: str,
    allow_partial: bool,
    force: bool,
    foreground: bool,
    executor: str,
    gpus: int | None,
    gpu_mem: str | None,
    curve: bool,
    output: str,
) -> None:
    """Start a cluster from INVENTORY over SSH, or the local default when none is given.

    Blocks until every agent has registered with the controller, then prints the
    `export TANGRAM_ADDR=...` line rollout jobs need. Re-running it on a running cluster
    changes nothing but starting dead agents again; after a controller crash it restarts the
    controller on the same ports (running agents and clients reconnect to it).
    """
    if inventory and inventory_opt and inventory != inventory_opt:
        raise click.UsageError("give the inventory once: as an argument or with -i")
    path = inventory or inventory_opt or os.environ.get("TANGRAM_INVENTORY") or None
    timeout_s = _duration_s(timeout)
    verbose = (ctx.obj or {}).get("verbose", 0)
    if path:
        from tangram_cli.bootstrap import remote

        code = remote.up_command(
            path,
            dry_run=dry_run,
            limit=limit,
            parallel=parallel,
            timeout_s=timeout_s,
            allow_partial=allow_partial,
            force=force,
            output=output,
            verbose=verbose,
        )
        if foreground and code in (0, 3) and not dry_run:
            _stay(remote.cluster_name(path))
        sys.exit(code)

    if dry_run:
        click.echo(
            "local default: start `tangram controller` on 127.0.0.1 (free ports) and one agent "
            "(`python -m agent`) on this machine; no SSH; "
            + ("CURVE keys in the cluster's certs directory" if curve else "plain TCP (--insecure)")
        )
        return
    name = _up_local(executor, gpus, gpu_mem, min(timeout_s, 120.0), curve, quiet=output == "json")
    if foreground:
        _stay(name)


def _up_local(
    executor: str, gpus: int | None, gpu_mem: str | None, timeout_s: float, curve: bool, *, quiet: bool
) -> str:
    """The local default: start, keep or restart it in place; print the outcome. Returns its name."""
    from tangram_cli.bootstrap import local

    def say(msg: str) -> None:
        if not quiet:
            click.echo(f"  {msg}", err=True)

    if not quiet:
        click.echo("tangram up: the local cluster (controller + 1 agent on this machine)...", err=True)
    result = local.bring_up_local(
        executor=executor,
        gpus=gpus,
        gpu_mem_mib=_gpu_mem(gpu_mem),
        timeout_s=timeout_s,
        on_event=say,
        curve=curve,
    )
    if quiet:
        import json

        click.echo(json.dumps(result.to_dict(), sort_keys=True))
    else:
        print_ready(result.state, started=result.started, how=result.how, summary=result.summary())
    return result.state.name


def _stay(name: str) -> None:
    """--foreground: follow the controller's log until Ctrl-C or SIGTERM, then `down`."""
    from tangram_cli.commands.down import down_cluster

    stop = {"now": False}

    def handler(_sig: int, _frame: object) -> None:
        stop["now"] = True

    old = signal.signal(signal.SIGTERM, handler)
    log = st.logs_dir(name) / "controller.log"
    click.echo(f"running in the foreground (Ctrl-C stops cluster {name}); controller log follows", err=True)
    try:
        with open(log, errors="replace") as fh:
            fh.seek(0, os.SEEK_END)
            while not stop["now"]:
                line = fh.readline()
                if line:
                    click.echo(line.rstrip("\n"), err=True)
                    continue
                cur = st.load(name)
                if cur is None or not cur.controller_alive():
                    click.echo("the controller stopped", err=True)
                    break
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
    down_cluster(name, force=False, purge=False, timeout_s=20.0, echo=lambda m: click.echo(m, err=True))
