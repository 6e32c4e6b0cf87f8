"""`tangram env [-c NAME] [--shell bash|fish]`: the exports a rollout job needs."""

from __future__ import annotations

import click

from tangram_cli import state as st


@click.command("env")
@click.option("-c", "--cluster", metavar="NAME", help="Cluster name (default: the running one, else local).")
@click.option("--shell", type=click.Choice(["bash", "fish"]), default="bash", show_default=True)
def command(cluster: str | None, shell: str) -> None:
    """Print `export TANGRAM_ADDR=...` (and `TANGRAM_CERTS=...` when the cluster uses CURVE) for a
    running cluster (eval it in your shell)."""
    import shlex

    state = st.find(cluster)
    pairs = [("TANGRAM_ADDR", state.address), ("TANGRAM_CLUSTER", state.name)]
    if state.certs:
        pairs.append(("TANGRAM_CERTS", state.certs))
    for key, value in pairs:
        if shell == "fish":
            click.echo(f"set -gx {key} {shlex.quote(value)};")
        else:
            click.echo(f"export {key}={shlex.quote(value)}")
