"""`tangram env [-c NAME] [--shell bash|fish] [-o text|json]`: the exports a rollout job needs."""

from __future__ import annotations

import json
import shlex

import click

from tangram_cli import state as st
from tangram_cli.params import output_option


@click.command("env")
@click.option("-c", "--cluster", metavar="NAME", help="Cluster name (default: the running one, else local).")
@click.option("--shell", type=click.Choice(["bash", "fish"]), default="bash", show_default=True)
@output_option("text", "json", help="text: shell exports to eval; json: the variables as one object.")
def command(cluster: str | None, shell: str, output: str) -> None:
    """Print `export TANGRAM_ADDR=...` (and `TANGRAM_CERTS=...` when the cluster uses CURVE) for a
    running cluster (eval it in your shell)."""
    state = st.find(cluster)
    pairs = [("TANGRAM_ADDR", state.address), ("TANGRAM_CLUSTER", state.name)]
    if state.certs:
        pairs.append(("TANGRAM_CERTS", state.certs))
    if output == "json":
        click.echo(json.dumps(dict(pairs), sort_keys=True))
        return
    for key, value in pairs:
        if shell == "fish":
            click.echo(f"set -gx {key} {shlex.quote(value)};")
        else:
            click.echo(f"export {key}={shlex.quote(value)}")
