"""`tangram logs [controller|NODE] [-c NAME] [-f] [-n N] [-o text|json]`: a cluster's logs."""

from __future__ import annotations

import click

from tangram_cli import logview
from tangram_cli.params import output_option


@click.command("logs")
@click.argument("which", metavar="[controller|NODE]", required=False, default="controller")
@click.option("-c", "--cluster", metavar="NAME", help="Cluster name (default: the running one, else local).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing lines as they are written (Ctrl-C stops).")
@click.option(
    "-n",
    "--lines",
    type=click.IntRange(0, 10_000_000),
    default=100,
    show_default=True,
    help="Lines to print first.",
)
@output_option(
    "text",
    "json",
    help="text: the lines (JSON log lines shown as text); json: one JSON object a line.",
)
def command(which: str, cluster: str | None, follow: bool, lines: int, output: str) -> None:
    """Print the controller's log, or a node agent's, of a cluster (docs/operations.md, section 6).

    Local logs are read from ~/.tangram/clusters/NAME/logs/ (they stay after `tangram down`,
    until `down --purge`); the log of an agent started over SSH is read on its node with `tail`
    over SSH, with the inventory's key. An unknown NODE is an error that lists the known ones.

    \b
    Examples:
      tangram logs                  # the controller's last 100 lines
      tangram logs local -f         # follow the local agent
      tangram logs node-a -n 20 -c rl-exp-42
      tangram logs -o json | jq 'select(.level == "ERROR")'
    """
    name = logview.cluster_name(cluster)
    src = logview.pick(name, which)
    convert = logview.converter(output)
    logview.show(src, lines, follow, lambda line: click.echo(convert(line)))
