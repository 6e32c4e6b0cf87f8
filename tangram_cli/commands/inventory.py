"""`tangram inventory validate|show`: check an inventory without touching the network."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from tangram_cli.errors import InventoryError
from tangram_cli.hostlist import compress
from tangram_cli.inventory import format_cpuset, load_inventory, local_default, to_json
from tangram_cli.params import output_option

ENV = "TANGRAM_INVENTORY"
FILE_HELP = f"FILE defaults to ${ENV}, or to the embedded local default when that is unset."


def _load(file: str | None) -> tuple[Any, str]:
    path = file or os.environ.get(ENV) or None
    if path is None:
        return local_default(), "<local default>"
    return load_inventory(Path(path)), path


def _summary(inv: Any) -> str:
    roles: dict[str, list[str]] = {}
    for node in inv.nodes:
        roles.setdefault(node.role, []).append(node.name)
    parts = [f"{len(names)} {role}: {compress(names)}" for role, names in sorted(roles.items())]
    n = len(inv.nodes)
    return f"ok: {n} node{'s' if n != 1 else ''} ({'; '.join(parts)}), cluster {inv.cluster}"


@click.group("inventory")
def command() -> None:
    """Validate an inventory file or show its resolved form.

    Neither subcommand uses the network: hosts are checked for syntax, not reachability.
    See inventory/README.md for the format and inventory/example.yaml for a cluster.
    """


@command.command("validate")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@output_option("text", "json", json_alias=True, help="text; json: {ok, source, cluster, nodes, errors}.")
def validate(file: str | None, output: str) -> None:
    """Check FILE: schema, units, host names, consistency. Lists every problem at once.

    Exits 0 when the inventory is valid and 2 when it is not.

    FILE defaults to $TANGRAM_INVENTORY, or to the embedded local default.
    """
    as_json = output == "json"
    try:
        inv, source = _load(file)
    except InventoryError as exc:
        if not as_json:
            raise
        problems = getattr(exc, "problems", None)
        errors = (
            [{"path": p.path, "problem": p.message} for p in problems]
            if problems
            else [{"path": "", "problem": exc.message}]
        )
        click.echo(
            json.dumps({"ok": False, "source": file or os.environ.get(ENV), "errors": errors}, indent=2)
        )
        sys.exit(exc.exit_code)
    if as_json:
        nodes = [n.name for n in inv.nodes]
        click.echo(
            json.dumps({"ok": True, "source": source, "cluster": inv.cluster, "nodes": nodes, "errors": []})
        )
    else:
        click.echo(_summary(inv))


@command.command("show")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@output_option(
    "table", "json", json_alias=True, help="A table of nodes, or the whole resolved inventory as JSON."
)
def show(file: str | None, output: str) -> None:
    """Print FILE after defaults, group vars, host overrides and units are applied.

    FILE defaults to $TANGRAM_INVENTORY, or to the embedded local default.
    """
    inv, _ = _load(file)
    if output == "json":
        click.echo(to_json(inv))
        return
    _table(inv)


def _table(inv: Any) -> None:
    c = inv.controller
    ports = f"{c.ports.agents}/{c.ports.submit}/{c.ports.status}"
    head = f"cluster {inv.cluster}  controller {c.bind} (advertise {c.advertise}, ports {ports})"
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in (
        "NODE",
        "GROUP",
        "ROLE",
        "ADDRESS",
        "USER",
        "CPUS",
        "IDLE",
        "MEM",
        "EXECUTOR",
        "GPUS",
        "SERVICES",
    ):
        table.add_column(col)
    for n in inv.nodes:
        address = "local" if n.connection == "local" else n.address
        gpus = str(n.gpus) if not isinstance(n.gpus, tuple) else f"{len(n.gpus)} uuids"
        if n.emulated_gpus:
            gpus += f" x {n.gpu_mem_mib // 1024}GiB (emulated)" if n.gpu_mem_mib else " (emulated)"
        table.add_row(
            n.name,
            n.group,
            n.role,
            address,
            n.user if n.connection != "local" else "-",
            format_cpuset(n.cpus) or "all",
            format_cpuset(n.idle_cpus) or "-",
            f"{n.mem_mib // 1024}GiB" if n.mem_mib else "probe",
            n.executor,
            gpus if n.gpus else "-",
            ",".join(s.name for s in n.services) or "-",
        )
    width = None if sys.stdout.isatty() else 200  # no TTY: do not squeeze columns into 80
    console = Console(no_color=bool(os.environ.get("NO_COLOR")), width=width)
    console.print(head, highlight=False)
    console.print(table)
    extra = [
        f"api {a.name}"
        + (f" {a.mode} {a.limit}" if a.limit else "")
        + (f" keys {','.join(k.name for k in a.keys)}" if a.keys else "")
        for a in inv.apis
    ] + [
        f"profile {p.name}" for p in inv.profiles
    ]
    if extra:
        console.print("  ".join(extra), highlight=False)
