"""`tangram down` on SSH nodes: stop agents by pidfile, remove the cluster's containers, and with
``--purge`` remove everything `up` left on a node. Also the record of which nodes hold the
cluster's files, so a purge never depends on the state that a plain `down` deletes.

The footprint, ``clusters/<name>/nodes.json``: every SSH host `up` logged in to (it is added
before anything is written there), with what it takes to log in again and the node's run
directory. It outlives ``state.json`` (a plain `down` removes only that), so a later
`tangram down -c NAME --purge` still reaches the nodes; `down INVENTORY --purge` also reaches
every node of the inventory. Local state is deleted only once every node holding the cluster's
files (``agent.key_secret``, ``controller.key``, venvs, logs) was purged: a node that cannot be
reached keeps the cluster directory, and ``nodes.json`` then lists just the nodes still to purge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram_cli import state as st
from tangram_cli.bootstrap import plan, ssh
from tangram_cli.bootstrap.hoststeps import describe
from tangram_cli.errors import BootstrapError

FOOTPRINT = "nodes.json"
DOWN_CONNECT_TIMEOUT_MS = 10_000


# ---------------------------------------------------------------- the footprint


def footprint_path(cluster: str) -> Path:
    return st.cluster_dir(cluster) / FOOTPRINT


def load_footprint(cluster: str) -> list[st.HostState] | None:
    """The recorded SSH hosts of ``cluster``, or None when there is no record (a cluster made before
    footprints, or none at all)."""
    try:
        raw = json.loads(footprint_path(cluster).read_text())
    except (OSError, ValueError):
        return None
    return [st.HostState.from_dict(h) for h in raw.get("hosts", []) if isinstance(h, dict)]


def write_footprint(cluster: str, hosts: list[st.HostState]) -> None:
    """Write ``nodes.json`` atomically (the caller holds the cluster's lock)."""
    st.ensure_dirs(cluster)
    path = footprint_path(cluster)
    tmp = path.with_name(f".{FOOTPRINT}.{os.getpid()}.tmp")
    doc = {"version": 1, "hosts": [dataclasses.asdict(h) for h in hosts]}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_footprint(cluster: str) -> None:
    if load_footprint(cluster) is None:
        write_footprint(cluster, [])


def add_to_footprint(cluster: str, host: st.HostState) -> None:
    """Record ``host`` (replacing an older record of the same node name)."""
    hosts = [h for h in load_footprint(cluster) or [] if h.name != host.name]
    write_footprint(cluster, [*hosts, host])


def host_state(node: Any, cluster: str) -> st.HostState:
    """How to reach an inventory node again, and its run directory."""
    return st.HostState(
        name=node.name,
        host=node.host,
        connection="ssh",
        port=node.port,
        user=node.user,
        workdir=plan.cluster_dir(node.workdir, cluster),
        identity_file=node.identity_file,
        host_key_policy=node.host_key_policy,
        connect_timeout_ms=node.connect_timeout_ms,
        python=node.python,
    )


def merge(*groups: list[st.HostState]) -> list[st.HostState]:
    """The SSH hosts of several lists, once each by node name (the first record wins)."""
    seen: dict[str, st.HostState] = {}
    for group in groups:
        for h in group:
            if h.connection == "ssh":
                seen.setdefault(h.name, h)
    return list(seen.values())


def unrecorded_nodes(cluster: str, known: list[st.HostState]) -> list[str]:
    """Nodes that have a CURVE key in the cluster's certs (so `up` may have shipped it to them) but
    no record of where they are: a purge would strand their copies. [] when a footprint exists."""
    if load_footprint(cluster) is not None:
        return []
    agents = st.cluster_dir(cluster) / "certs" / "agents"
    named = {p.stem.removeprefix("agent-") for p in agents.glob("agent-*.key")} if agents.is_dir() else set()
    local = {st.DEFAULT_CLUSTER} if cluster == st.DEFAULT_CLUSTER else set()
    return sorted(named - {h.name.replace("/", "_") for h in known} - local)


# ---------------------------------------------------------------- stop and purge


@dataclass(frozen=True)
class HostDown:
    """What `down` did on one SSH host: ``did`` in words, or ``error`` (and its ``hint``)."""

    name: str
    did: str = ""
    error: str = ""
    hint: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def stop_hosts(hosts: list[st.HostState], cluster_id: str, *, purge: bool) -> dict[str, HostDown]:
    """Stop each host's agent (by pidfile), remove its containers of this cluster id, and with
    ``purge`` remove its run directory: one login and one command per host (plan.teardown_command).
    Without an id (no state, or a legacy one), containers are removed only when purging, by the id
    in the node's own agent.json."""
    return asyncio.run(_stop_all(hosts, cluster_id, purge))


async def _stop_all(hosts: list[st.HostState], cluster_id: str, purge: bool) -> dict[str, HostDown]:
    async def one(h: st.HostState) -> str:
        return await _down_one(h, cluster_id, purge)

    results = await ssh.run_on_hosts(hosts, one, parallel=ssh.MAX_PARALLEL)
    out = {}
    for name, r in results.items():
        if isinstance(r, BaseException):
            reason, hint = describe(r)
            out[name] = HostDown(name, error=reason, hint=hint)
        else:
            out[name] = HostDown(name, did=r)
    return out


async def _down_one(h: st.HostState, cluster_id: str, purge: bool) -> str:
    node = dataclasses.replace(h, connect_timeout_ms=min(h.connect_timeout_ms, DOWN_CONNECT_TIMEOUT_MS))
    conn = await ssh.connect(node, ssh.known_hosts_path(), attempts=2)
    async with conn:
        r = await ssh.run(conn, plan.teardown_command(h.workdir, cluster_id, purge=purge), timeout=120)
    said = r.stdout.split()
    if "agent=stuck" in said:
        raise BootstrapError("agent did not stop after SIGTERM and SIGKILL", host=h.name)
    if purge and "gone" not in said:
        why = r.stderr.strip()[-200:] or f"exit {r.exit_status}"
        raise BootstrapError(f"could not remove {h.workdir}: {why}", host=h.name)
    did = ["agent stopped by pidfile"] if "agent=stopped" in said else []
    return "; ".join(did + ([f"removed {h.workdir}"] if purge else []))
