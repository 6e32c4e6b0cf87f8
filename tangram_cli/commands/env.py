"""`tangram env [-c NAME] [--shell bash|fish]`: the exports a rollout job needs."""

from __future__ import annotations

import click

from tangram_cli import state as st


@click.command("env")
@click.option("-c", "--cluster", metavar="NAME", help="Cluster name (default: the running one, else local).")
@click.option("--shell", type=click.Choice(["bash", "fish"]), default="bash", show_default=True)
def command(cluster: str | None, shell: str) -> None:
    """Print `export TANGRAM_ADDR=...` for a running cluster (eval it in your shell)."""
    state = st.find(cluster)
    if shell == "fish":
        click.echo(f"set -gx TANGRAM_ADDR {state.address};")
        click.echo(f"set -gx TANGRAM_CLUSTER {state.name};")
    else:
        click.echo(f"export TANGRAM_ADDR={state.address}")
        click.echo(f"export TANGRAM_CLUSTER={state.name}")
