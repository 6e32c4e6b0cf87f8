"""`tangram up INVENTORY` over SSH: the orchestration around hoststeps.py (one host), plan.py (the
remote commands) and ssh.py. A library: it returns typed results (``UpOutcome``) and reports
progress as ``StepEvent``s; the command prints (render/up.py).

    plan -> start the controller here -> per host (<= --parallel at once): connect, check, and
    only where needed probe, upload, install, start -> wait until every agent registered ->
    settle (stop again what a failed `up` started) -> UpOutcome (per host: bootstrapped,
    registered, REASON, timings) -> exit 0/3/1

The controller runs detached on the operator's machine and binds ``controller.bind``; agents dial
``controller.advertise`` (on the test machine both are 127.0.0.1). Bootstrapping a host and its
agent registering are separate facts: an agent that already ran registers even when this `up`
could not log in to its host (a changed host key), and is counted as registered.

Security: `up` always uses CURVE here. It creates the cluster's keys (tangram_cli/keys.py), starts
the controller with ``--certs``, and ships each node only its own secret certificate
(``agent.key_secret``) and the controller's public key (``controller.key``), mode 0600, next to
``agent.json``, whose ``curve`` section points at them. Every host logged in to is recorded in the
cluster's footprint (teardown.py) before anything is written there, so `down --purge` finds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tangram.errors import ConfigError
from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.bootstrap import bundle as bdl
from tangram_cli.bootstrap import failures, procs, restart, ssh, teardown
from tangram_cli.bootstrap.hoststeps import HostResult, Job, StepEvent, bootstrap_host, describe
from tangram_cli.errors import BootstrapError
from tangram_cli.hostlist import expand
from tangram_cli.inventory import Inventory, Node, load_inventory
from tangram_cli.inventory.configs import controller_config
from tangram_cli.inventory.model import is_loopback

__all__ = ["HostResult", "UpOptions", "UpOutcome", "cluster_name", "known_hosts_path", "up_inventory"]

known_hosts_path = ssh.known_hosts_path  # where `tangram logs` (logview.py) finds it

# With a controller restarted in place by this `up`, agents that still run need a moment to
# reconnect: hosts whose bootstrap failed are watched this long for their agent to register.
RECONNECT_GRACE_S = 10.0


def cluster_name(path: str) -> str:
    return load_inventory(path).cluster


@dataclass(frozen=True)
class UpOptions:
    limit: str | None = None
    parallel: int = 8
    timeout_s: float = 300.0
    allow_partial: bool = False
    force: bool = False


@dataclass
class UpOutcome:
    """What `up INVENTORY` did. ``others``: agents of the cluster on hosts outside this run (--limit)."""

    path: str
    options: UpOptions
    state: st.ClusterState
    results: dict[str, HostResult]
    kept: bool  # the controller ran before this `up`
    settled: failures.Settled
    others: int = 0

    @property
    def failed(self) -> list[HostResult]:
        return [r for r in self.results.values() if not r.ok]

    def count(self, what: str) -> int:
        """How many hosts were ``bootstrapped`` / ``registered``."""
        return sum(1 for r in self.results.values() if getattr(r, what))

    @property
    def exit_code(self) -> int:
        """0 every host up; 3 some failed with --allow-partial while the cluster runs; else 1."""
        if not self.failed:
            return 0
        running = self.state.controller_pid is not None and (self.count("registered") or self.others)
        return 3 if self.options.allow_partial and running else 1


# ---------------------------------------------------------------- up


def select(inv: Inventory, limit: str | None) -> list[Node]:
    """The inventory's nodes, or those ``--limit`` names; only SSH nodes."""
    nodes = list(inv.nodes)
    if limit:
        want = set(expand(limit))
        nodes = [n for n in nodes if n.name in want or n.host in want]
        if not nodes:
            raise ConfigError(
                f"--limit {limit} matches no node of the inventory",
                hint="`tangram inventory show INVENTORY` lists the nodes",
            )
    local_nodes = [n for n in nodes if n.connection != "ssh"]
    if local_nodes:
        raise BootstrapError(
            f"nodes {[n.name for n in local_nodes]} use connection: local (only the local default does)",
            hint="use `tangram up` with no inventory for this machine, or give the hosts ssh settings",
        )
    return nodes


def up_inventory(
    path: str, options: UpOptions, *, emit: Callable[[StepEvent], None], say: Callable[[str], None]
) -> UpOutcome:
    """Bring up the inventory's cluster (or the ``--limit`` part of it); never raises for a host's
    failure (that is in its HostResult), only for the inventory, the controller or the lock."""
    inv = load_inventory(path)  # InventoryError: exit 2 with every problem
    nodes = select(inv, options.limit)
    bundle = bdl.build()
    with st.locked(inv.cluster, timeout_s=60):
        state, kept, restarted = _controller(inv, path, bundle, say)
        previous = _record_hosts(state, inv.cluster, nodes, bundle.digest)
        results = {n.name: HostResult(n.name, f"{n.user}@{n.address}") for n in nodes}
        job = Job(
            cluster=inv.cluster,
            bundle=bundle,
            controller_url=state.agents_address,
            allow_remote=not state.certs and not _loopback(state.advertise),
            force=options.force,
            state=state,
            known_hosts=ssh.known_hosts_path(),
            emit=emit,
            touched=lambda node: teardown.add_to_footprint(
                inv.cluster, teardown.host_state(node, inv.cluster)
            ),
        )
        outcomes = asyncio.run(_bootstrap_all(job, nodes, results, options.parallel))
        _apply(results, outcomes)
        _forget_failed(state, results, previous)
        st.write(state)
        _wait_agents(state, results, options.timeout_s, emit, grace_s=RECONNECT_GRACE_S if restarted else 0.0)
        fresh = not kept and not restarted
        settled = failures.settle(
            state, results, kept=kept, fresh=fresh, allow_partial=options.allow_partial, say=say
        )
        failures.record(state, results, {n.name: n.role for n in nodes})
        st.write(state)
    others = sum(1 for h in state.hosts if h.name not in results)
    return UpOutcome(str(path), options, state, results, kept, settled, others)


def _loopback(address: str) -> bool:
    return bool(is_loopback(address))


def _controller(
    inv: Inventory, path: str, bundle: bdl.Bundle, say: Callable[[str], None]
) -> tuple[st.ClusterState, bool, bool]:
    """Keep, restart in place, or start the cluster's controller (with its CURVE keys): (state, kept
    (it ran before this `up`), restarted (in place, by this `up`))."""
    state = st.load(inv.cluster)
    kept = state is not None and state.controller_is_ours()
    certs = str(keys.ensure_cluster_keys(inv.cluster, [n.name for n in inv.nodes]))
    state, restarted = restart.inventory_controller(
        inv,
        state,
        config=controller_config(inv),
        certs=certs,
        inventory=str(path),
        bundle=bundle.digest,
        say=say,
    )
    teardown.ensure_footprint(inv.cluster)
    return state, kept, restarted is not None


def _record_hosts(state: st.ClusterState, cluster: str, nodes: list[Node], digest: str) -> set[str]:
    """Record this run's hosts in ``state``; returns the hosts recorded before it."""
    known = {h.name: h for h in state.hosts}
    previous = set(known)
    for n in nodes:
        known[n.name] = teardown.host_state(n, cluster)
    state.hosts = list(known.values())
    state.bundle = digest
    st.write(state)
    return previous


async def _bootstrap_all(
    job: Job, nodes: list[Node], results: dict[str, HostResult], parallel: int
) -> dict[str, Any]:
    async def one(node: Node) -> str:
        return await bootstrap_host(job, node, results[node.name])

    return await ssh.run_on_hosts(nodes, one, parallel=parallel)


def _apply(results: dict[str, HostResult], outcomes: dict[str, Any]) -> None:
    for name, got in outcomes.items():
        r = results[name]
        if isinstance(got, BaseException):
            r.bootstrapped = False
            r.reason, r.hint = describe(got)
            r.attempts = max(r.attempts, int(getattr(got, "attempts", 0) or 0))
        else:
            r.bootstrapped, r.started = True, got


def _forget_failed(state: st.ClusterState, results: dict[str, HostResult], previous: set[str]) -> None:
    """Keep in ``state.hosts`` only hosts that run (or ran) an agent, so `down` does not chase the
    others (the footprint still lists every host logged in to, for `down --purge`)."""
    failed = {n for n, r in results.items() if not r.bootstrapped}
    state.hosts = [h for h in state.hosts if h.name not in failed or h.name in previous]


def _wait_agents(
    state: st.ClusterState,
    results: dict[str, HostResult],
    timeout_s: float,
    emit: Callable[[StepEvent], None],
    *,
    grace_s: float,
) -> None:
    """Wait for the bootstrapped hosts' agents; then see whether the others' agents (already
    running, on hosts this `up` could not bootstrap) are registered anyway."""
    pending = [n for n, r in results.items() if r.bootstrapped]
    others = [n for n, r in results.items() if not r.bootstrapped]
    if pending:
        t0 = time.monotonic()
        seen, took = _watch(state, pending, timeout_s, emit, report=True)
        waited = time.monotonic() - t0
        for name in pending:
            r = results[name]
            if procs.is_up(seen[name]):
                r.registered, r.step, r.timings["wait"] = True, "registered", took.get(name, 0.0)
            else:
                r.step = "wait"
                r.reason = (
                    f"agent did not register within {timeout_s:g}s (see agent.log in {_run_dir(state, name)})"
                    if seen[name] == "waiting"
                    else seen[name]
                )
                if r.started == "running":
                    r.hint = (
                        "the agent was already running and was left alone: `tangram up --force` restarts it"
                    )
                emit(StepEvent(name, "wait", "failed", r.reason, waited))
    if others and state.controller_alive():
        seen, _took = _watch(state, others, grace_s, emit, report=False)
        for name in others:
            if procs.is_up(seen[name]):
                r = results[name]
                r.registered = True
                r.reason = f"{r.reason}; its agent was already running and is registered"
                emit(StepEvent(name, "wait", "done", "registered: its agent was already running", 0.0))


def _run_dir(state: st.ClusterState, name: str) -> str:
    return next((h.workdir for h in state.hosts if h.name == name), "its run directory")


def _watch(
    state: st.ClusterState,
    names: list[str],
    timeout_s: float,
    emit: Callable[[StepEvent], None],
    *,
    report: bool,
) -> tuple[dict[str, str], dict[str, float]]:
    """Poll the status socket for ``names``: (their states, seconds until each registered)."""
    t0 = time.monotonic()
    done: dict[str, float] = {}
    if report:
        for name in names:
            emit(StepEvent(name, "wait", "start"))

    def update(seen: dict[str, str]) -> None:
        for name in names:
            if not report or name in done:
                continue
            if procs.is_up(seen[name]):
                done[name] = time.monotonic() - t0
                emit(StepEvent(name, "wait", "done", "registered", done[name]))
            else:
                emit(StepEvent(name, "wait", "progress", seen[name]))

    def controller_dead() -> str | None:
        return None if state.controller_alive() else "the controller exited"

    seen = procs.wait_registered(
        state.status_address,
        names,
        timeout_s=timeout_s,
        on_update=update,
        alive=controller_dead,
        certs=state.certs or None,
    )
    return seen, done
