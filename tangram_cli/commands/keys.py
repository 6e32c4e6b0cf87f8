"""`tangram keys add|list|revoke`: per-client CURVE keys of a cluster (tangram_cli/keys.py).

Every cluster `tangram up` starts with keys (the local default too, unless `--insecure`) has a
default client key, which the local user's client library finds by itself. `keys add NAME` gives
one user or job a key of its own: its public key goes on the controller's allow-list
(``certs/clients/NAME.key``, taken at once by a running controller), its secret into a directory
to use as ``TANGRAM_CERTS`` (``certs/users/NAME/`` unless ``--out DIR``). `keys revoke NAME`
removes the public key: new connections with it are refused (connections that are up stay up).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import click

from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.params import output_option


def _cluster(name: str | None) -> str:
    """``-c NAME``; else $TANGRAM_CLUSTER; else the only running cluster; else ``local``. The
    cluster need not run: keys can be added before it starts."""
    name = name or os.environ.get("TANGRAM_CLUSTER") or None
    if name:
        return name
    live = st.running()
    return live[0].name if len(live) == 1 else st.DEFAULT_CLUSTER


_CLUSTER = click.option(
    "-c", "--cluster", metavar="NAME", help="Cluster name (default: the running one, else local)."
)


@click.group("keys")
def command() -> None:
    """Per-client CURVE keys: add one per user or job, list them, revoke one."""


@command.command("add")
@click.argument("name")
@_CLUSTER
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for the secret (made 0700; default: the cluster's certs/users/NAME/).",
)
@output_option("text", "json", help="text; json: the key's name, role, fingerprint and certs directory.")
def add(name: str, cluster: str | None, out: str | None, output: str) -> None:
    """Create client keypair NAME: public key on the allow-list, secret in a TANGRAM_CERTS directory."""
    cluster = _cluster(cluster)
    info, where = keys.add_client(cluster, name, Path(out) if out else None)
    if output == "json":
        click.echo(json.dumps({**info.to_dict(), "cluster": cluster, "certs": str(where)}, sort_keys=True))
        return
    click.echo(f"client key {info.name} added to cluster {cluster} (fingerprint {info.fingerprint})")
    click.echo(f"  allow-list: {info.path} (the controller takes it at once)")
    click.echo(f"  secret:     {where / (keys.CLIENT + '.key_secret')} (mode 0600; give it to no one else)")
    click.echo("use it (the directory also holds the controller's public key):")
    click.echo(f"  export TANGRAM_CERTS={shlex.quote(str(where))}")
    click.echo(f"  or in code: tangram.Client(addr, certs={str(where)!r})")
    click.echo(
        f"revoke it: tangram keys revoke {info.name}" + (f" -c {cluster}" if cluster != "local" else "")
    )


@command.command("list")
@_CLUSTER
@output_option("table", "json")
def list_(cluster: str | None, output: str) -> None:
    """The keys on the cluster's allow-lists: name, role, fingerprint."""
    cluster = _cluster(cluster)
    found = keys.list_keys(cluster)
    if output == "json":
        click.echo(json.dumps({"cluster": cluster, "keys": [k.to_dict() for k in found]}, indent=2))
        return
    rows = [("NAME", "ROLE", "FINGERPRINT", "SECRET")] + [
        (k.name, k.role, k.fingerprint, k.secret or "-") for k in found
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])


@command.command("revoke")
@click.argument("name")
@_CLUSTER
def revoke(name: str, cluster: str | None) -> None:
    """Remove client key NAME from the allow-list: new connections with it are refused."""
    cluster = _cluster(cluster)
    info = keys.revoke_client(cluster, name)
    click.echo(
        f"client key {info.name} revoked in cluster {cluster} (fingerprint {info.fingerprint}): new "
        "connections with it are refused; connections that are up stay up until they reconnect"
    )
    if name == keys.CLIENT:
        click.echo(
            "note: that was the cluster's default key (the local client library's); "
            "starting the cluster afresh (`tangram down`, then `tangram up`) puts it back"
        )
