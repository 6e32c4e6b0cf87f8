"""`tangram up INVENTORY` / `down` over SSH: the orchestration around plan.py and ssh.py.

    plan -> start the controller here -> per host (<= --parallel at once): connect, probe,
    upload, install, start -> wait until every agent registered -> per-host table, exit 0/3/1

The controller runs detached on the operator's machine and binds ``controller.bind``; agents dial
``controller.advertise`` (on the test machine both are 127.0.0.1). Each host's agent runs from
``<workdir>/<cluster>/`` (``agent.json``, ``agent.pid``, ``agent.log``, ``agent.lock``) and is
started at most once (``flock -n agent.lock``); re-running `up` leaves a running agent alone
unless ``--force``.

Security: `up` always uses CURVE here. It creates the cluster's keys (tangram_cli/keys.py), starts
the controller with ``--certs``, and ships each node only its own secret certificate
(``agent.key_secret``) and the controller's public key (``controller.key``), mode 0600, next to
``agent.json``, whose ``curve`` section points at them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from tangram.errors import BootstrapError, TangramError
from tangram_cli import state as st
from tangram_cli.bootstrap import bundle as bdl
from tangram_cli.bootstrap import failures, local, plan, procs, restart

MIN_PYTHON = (3, 10)


def cluster_name(path: str) -> str:
    from tangram_cli.inventory import load_inventory

    return load_inventory(path).cluster


def known_hosts_path() -> str:
    return str(st.home() / "known_hosts")


# ---------------------------------------------------------------- progress


@dataclass
class HostResult:
    node: str
    destination: str
    step: str = "pending"
    ok: bool | None = None
    reason: str = ""
    detail: str = ""
    started: str = ""  # "started", "running" (already), "restarted"
    facts: dict[str, Any] = field(default_factory=dict)


class Reporter:
    """A rich Live table (one row per host) on a TTY; one line per event otherwise."""

    def __init__(self, results: dict[str, HostResult], quiet: bool = False) -> None:
        from rich.console import Console

        self.results = results
        self.console = Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.live: Any = None

    def __enter__(self) -> Reporter:  # noqa: PYI034
        if self.console.is_terminal and not self.quiet:
            from rich.live import Live

            self.live = Live(self._table(), console=self.console, refresh_per_second=8, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def _table(self) -> Any:
        from rich.table import Table

        t = Table(box=None, header_style="bold", pad_edge=False)
        for h in ("NODE", "DESTINATION", "STEP", ""):
            t.add_column(h, no_wrap=True)
        for r in self.results.values():
            mark = "..." if r.ok is None else ("ok" if r.ok else "FAILED")
            t.add_row(r.node, r.destination, r.step, mark if r.ok is not None else r.detail or mark)
        return t

    def update(self, node: str, step: str, detail: str = "") -> None:
        r = self.results[node]
        r.step, r.detail = step, detail
        if self.live is not None:
            self.live.update(self._table())
        elif not self.quiet:
            self.console.print(f"{node}: {step}{' ' + detail if detail else ''}")


def result_table(results: dict[str, HostResult]) -> Any:
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    for h in ("NODE", "DESTINATION", "RESULT", "STEP", "REASON"):
        t.add_column(h, no_wrap=False)
    for r in results.values():
        res = "ok" if r.ok else "FAILED"
        if r.ok and r.started:
            res = f"ok ({r.started})"
        t.add_row(r.node, r.destination, res, r.step, r.reason or "-")
    return t


# ---------------------------------------------------------------- one host


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TangramError):
        msg = exc.message
        return msg
    return f"{type(exc).__name__}: {exc}"


async def _bootstrap_host(
    node: Any,
    inv: Any,
    bundle: bdl.Bundle,
    controller_url: str,
    allow_remote: bool,
    force: bool,
    rep: Reporter,
    state: st.ClusterState,
) -> str:
    from tangram_cli.bootstrap import ssh

    cluster = inv.cluster
    bdir = plan.bundle_dir(node.workdir, cluster, bundle.digest)
    venv = plan.venv_dir(node.workdir, cluster, bundle.digest)
    run_dir = plan.cluster_dir(node.workdir, cluster)
    rep.update(node.name, "connect")
    conn = await ssh.connect(node, known_hosts_path())
    async with conn:
        rep.update(node.name, "probe")
        facts = await ssh.probe(conn, node.python, timeout=60)
        _check_facts(node, facts)
        rep.update(node.name, "upload", bundle.short)
        await ssh.run(conn, plan.mkdir_command(bdir), check=True)
        sent = await ssh.upload(conn, bundle.files, bdir)
        rep.update(node.name, "install", "bundle sent" if sent else "bundle already there")
        await ssh.run(
            conn,
            plan.install_command(node.python, bdir, venv, system_site_packages=True),
            timeout=300,
            check=True,
        )
        vpy = f"{plan.sh_path(venv)}/bin/python"
        r = await ssh.run(
            conn,
            f"{vpy} -c {shlex.quote(bdl.SETUP_SCRIPT)} {plan.sh_path(bdir)} {plan.sh_path(venv)}",
            timeout=120,
            check=True,
        )
        missing = r.stdout.split()
        if missing:
            rep.update(node.name, "install", f"pip install {' '.join(missing)}")
            pkgs = " ".join(shlex.quote({"zmq": "pyzmq"}.get(m, m)) for m in missing)
            r2 = await ssh.run(conn, f"{vpy} -m pip install --quiet {pkgs}", timeout=300)
            if not r2.ok:
                raise BootstrapError(
                    f"node python lacks {', '.join(missing)} and pip could not install them", host=node.name
                )
        rep.update(node.name, "start")
        files = _agent_files(node, facts, run_dir, controller_url, allow_remote, state)
        await ssh.run(conn, plan.mkdir_command(run_dir), check=True)
        await ssh.upload(conn, files, run_dir)
        running = await _agent_running(conn, run_dir)
        how = "started"
        if running and force:
            await ssh.run(conn, plan.stop_command(run_dir))
            await _wait_stopped(conn, run_dir)
            how = "restarted"
        elif running:
            return "running"
        r = await ssh.run(conn, plan.start_command(run_dir, venv), timeout=30)
        if not r.ok:
            if await _agent_running(conn, run_dir):
                return "running"
            tail = await ssh.run(conn, f"tail -n 5 {plan.sh_path(run_dir)}/agent.log")
            raise BootstrapError(
                f"agent did not start (exit {r.exit_status}): {(r.stderr or tail.stdout).strip()[-300:]}",
                host=node.name,
            )
        return how


def _agent_files(
    node: Any,
    facts: dict[str, Any],
    run_dir: str,
    controller_url: str,
    allow_remote: bool,
    state: st.ClusterState,
) -> dict[str, bytes]:
    """What goes into the node's run directory: ``agent.json`` and, with CURVE, the node's own keypair
    and the controller's public key (mode 0600)."""
    emulated = 0
    if node.emulated_gpus or isinstance(node.gpus, int):
        emulated = node.gpu_count or 0
    home = (facts.get("disk") or {}).get("path") or "~"
    abs_run = run_dir.replace("~", home, 1) if run_dir.startswith("~") else run_dir
    files: dict[str, bytes] = {}
    curve = None
    if state.certs:
        from pathlib import Path

        from tangram_cli import keys

        files = keys.agent_files(Path(state.certs), node.name)
        curve = {"controller_public": f"{abs_run}/controller.key", "secret": f"{abs_run}/agent.key_secret"}
    cfg = local.agent_config(
        node,
        cluster=state.name,
        controller=controller_url,
        workdir=abs_run,
        executor=node.executor if node.executor in ("auto", "docker", "process") else "auto",
        emulated_gpus=emulated,
        gpu_mem_mib=node.gpu_mem_mib,
        allow_remote=allow_remote,
        curve=curve,
        cluster_id=state.cluster_id,
    )
    files["agent.json"] = (json.dumps(cfg, indent=2) + "\n").encode()
    return files


def _check_facts(node: Any, facts: dict[str, Any]) -> None:
    py = str(facts.get("python") or "0")
    try:
        ver = tuple(int(x) for x in py.split(".")[:2])
    except ValueError:
        ver = (0, 0)
    if ver < MIN_PYTHON:
        raise BootstrapError(
            f"python {py} on the node is older than {'.'.join(map(str, MIN_PYTHON))}",
            host=node.name,
            hint="set `python:` in the inventory to a newer interpreter",
        )
    allowed = set(facts.get("allowed_cpus") or [])
    if node.cpus and allowed:
        outside = sorted(set(node.cpus) - allowed)
        if outside:
            raise BootstrapError(
                f"cpus {outside} are not online on the node (online: {sorted(allowed)})", host=node.name
            )
    mem = facts.get("mem_total_mib")
    if node.mem_mib and isinstance(mem, int) and node.mem_mib > mem:
        raise BootstrapError(f"mem {node.mem_mib}MiB is more than the node has ({mem}MiB)", host=node.name)
    if node.executor == "docker":
        d = facts.get("docker") or {}
        if not d.get("access"):
            raise BootstrapError(
                "no docker socket access",
                host=node.name,
                hint="add the ssh user to the docker group, or use executor: process",
            )


async def _agent_running(conn: Any, run_dir: str) -> bool:
    from tangram_cli.bootstrap import ssh

    pidfile = f"{plan.sh_path(run_dir)}/agent.pid"
    r = await ssh.run(
        conn,
        f'pid=$(cat {pidfile} 2>/dev/null) && case "$pid" in ""|*[!0-9]*) exit 1;; esac '
        f'&& kill -0 "$pid" 2>/dev/null && grep -q agent /proc/"$pid"/cmdline',
    )
    return r.ok


async def _wait_stopped(conn: Any, run_dir: str, timeout_s: float = 10.0) -> bool:
    from tangram_cli.bootstrap import ssh

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not await _agent_running(conn, run_dir):
            return True
        await asyncio.sleep(0.2)
    await ssh.run(conn, plan.stop_command(run_dir, signal="KILL"))
    await asyncio.sleep(0.2)
    return not await _agent_running(conn, run_dir)


# ---------------------------------------------------------------- up


def _select(inv: Any, limit: str | None) -> list[Any]:
    nodes = list(inv.nodes)
    if not limit:
        return nodes
    from tangram_cli.hostlist import expand

    want = set(expand(limit))
    chosen = [n for n in nodes if n.name in want or n.host in want]
    if not chosen:
        raise click.UsageError(f"--limit {limit} matches no node of the inventory")
    return chosen


def up_command(
    path: str,
    *,
    dry_run: bool,
    limit: str | None,
    parallel: int,
    timeout_s: float,
    allow_partial: bool,
    force: bool,
    output: str,
    verbose: int,
) -> int:
    from rich.console import Console

    from tangram_cli.inventory import load_inventory
    from tangram_cli.inventory.model import is_loopback

    inv = load_inventory(path)  # InventoryError: exit 2 with every problem
    nodes = _select(inv, limit)
    local_nodes = [n for n in nodes if n.connection != "ssh"]
    if local_nodes:
        raise BootstrapError(
            f"nodes {[n.name for n in local_nodes]} use connection: local (only the local default does)",
            hint="use `tangram up` with no inventory for this machine, or give the hosts ssh settings",
        )
    bundle = bdl.build()
    if dry_run:
        _dry_run(inv, nodes, bundle, verbose)
        return 0
    quiet = output == "json"
    err = Console(stderr=True, highlight=False)
    with st.locked(inv.cluster, timeout_s=60):
        state = st.load(inv.cluster)
        kept = state is not None and state.controller_is_ours()  # ran before this `up`: never stopped
        # CURVE keys (idempotent): controller, client, status, one per node of the inventory.
        from tangram_cli import keys

        certs = str(keys.ensure_cluster_keys(inv.cluster, [n.name for n in inv.nodes]))
        state, _restarted = restart.inventory_controller(
            inv,
            state,
            config=local.controller_config(inv),
            certs=certs,
            inventory=str(path),
            bundle=bundle.digest,
            say=(lambda _m: None) if quiet else err.print,
        )
        known = {h.name: h for h in state.hosts}
        previous = set(known)
        for n in nodes:
            known[n.name] = st.HostState(
                name=n.name,
                host=n.host,
                connection="ssh",
                port=n.port,
                user=n.user,
                workdir=plan.cluster_dir(n.workdir, inv.cluster),
                identity_file=n.identity_file,
                host_key_policy=n.host_key_policy,
                connect_timeout_ms=n.connect_timeout_ms,
                python=n.python,
            )
        state.hosts = list(known.values())
        state.bundle = bundle.digest
        st.write(state)

        results = {n.name: HostResult(n.name, f"{n.user}@{n.address}") for n in nodes}
        # A controller started before CURVE existed has no certs: its agents stay on plain TCP.
        allow_remote = not state.certs and not is_loopback(state.advertise)
        with Reporter(results, quiet=quiet) as rep:
            outcome = asyncio.run(
                _bootstrap_all(
                    nodes, inv, bundle, state.agents_address, allow_remote, force, parallel, rep, state
                )
            )
            pending = []
            for n in nodes:
                r = results[n.name]
                got_ = outcome[n.name]
                if isinstance(got_, BaseException):
                    r.ok, r.reason = False, _reason(got_)
                else:
                    r.started = got_
                    pending.append(n.name)
            # Remember only hosts that run (or ran) an agent, so `down` does not chase the others.
            failed_now = {n.name for n in nodes if n.name not in pending}
            state.hosts = [h for h in state.hosts if h.name not in failed_now or h.name in previous]
            st.write(state)
            if pending:

                def upd(seen: dict[str, str]) -> None:
                    for name in pending:
                        if results[name].ok is None:
                            rep.update(name, "wait", seen.get(name, ""))

                def controller_dead() -> str | None:
                    return None if state.controller_alive() else "the controller exited"

                seen = procs.wait_registered(
                    state.status_address,
                    pending,
                    timeout_s=timeout_s,
                    on_update=upd,
                    alive=controller_dead,
                    certs=state.certs or None,
                )
                for name in pending:
                    r = results[name]
                    r.step = "wait"
                    if procs.is_up(seen[name]):
                        r.ok, r.step = True, "registered"
                    else:
                        why = seen[name]
                        r.ok = False
                        r.reason = (
                            f"agent did not register within {timeout_s:g}s (see agent.log in "
                            f"{known[name].workdir})"
                            if why == "waiting"
                            else why
                        )
        failures.record(state, results, {n.name: n.role for n in nodes})
        stopped = None
        if not any(r.ok for r in results.values()):
            stopped = failures.stop_if_idle(state, kept=kept, say=(lambda _m: None) if quiet else err.print)
        st.write(state)
    return failures.report(
        results, state, path=str(path), json_out=quiet, allow_partial=allow_partial, stopped=stopped
    )


def _dry_run(inv: Any, nodes: list[Any], bundle: bdl.Bundle, verbose: int) -> None:
    """`up --dry-run`: the plan, then the checks only this machine can make (preflight.py)."""
    from tangram_cli import keys
    from tangram_cli.inventory import preflight

    ctl = inv.controller
    click.echo(
        f"cluster {inv.cluster}: controller on this machine, bind {ctl.bind}, advertise {ctl.advertise}, "
        f"ports agents {ctl.ports.agents or 'free'} submit {ctl.ports.submit or 'free'} "
        f"status {ctl.ports.status or 'free'}"
    )
    click.echo(
        f"CURVE keys: {keys.certs_dir(inv.cluster)} (created if missing; each node gets only its own key)"
    )
    click.echo(plan.render(plan.plan(nodes, inv.cluster, bundle.digest), verbose=verbose > 0), nl=False)
    preflight.check(inv, nodes)  # InventoryError (exit 2) naming each key


async def _bootstrap_all(
    nodes: list[Any],
    inv: Any,
    bundle: bdl.Bundle,
    url: str,
    allow_remote: bool,
    force: bool,
    parallel: int,
    rep: Reporter,
    state: st.ClusterState,
) -> dict[str, Any]:
    from tangram_cli.bootstrap import ssh

    async def one(node: Any) -> str:
        return await _bootstrap_host(node, inv, bundle, url, allow_remote, force, rep, state)

    return await ssh.run_on_hosts(nodes, one, parallel=parallel)


# ---------------------------------------------------------------- down


def stop_agents(state: st.ClusterState, *, purge: bool, echo: Callable[[str], None]) -> dict[str, str]:
    """Stop every SSH agent of ``state`` still running (by pidfile); returns {host: reason} failures."""
    hosts = [h for h in state.hosts if h.connection == "ssh"]
    return asyncio.run(_stop_all(hosts, state.cluster_id, purge, echo))


@dataclass(frozen=True)
class _NodeView:
    name: str
    host: str
    port: int
    user: str
    identity_file: str | None
    host_key_policy: str
    connect_timeout_ms: int


async def _stop_all(
    hosts: list[st.HostState], cluster_id: str, purge: bool, echo: Callable[[str], None]
) -> dict[str, str]:
    """Stop each host's agent, then remove the containers of this cluster id (none without an id: a
    legacy state's containers carry only the cluster's name, which another cluster may share)."""
    from tangram_cli.bootstrap import ssh

    async def one(h: st.HostState) -> str:
        node = _NodeView(
            h.name,
            h.host,
            h.port,
            h.user,
            h.identity_file,
            h.host_key_policy,
            min(h.connect_timeout_ms, 10_000),
        )
        conn = await ssh.connect(node, known_hosts_path(), attempts=2)
        async with conn:
            did = ""
            if await _agent_running(conn, h.workdir):
                await ssh.run(conn, plan.stop_command(h.workdir))
                did = "stopped by pidfile" if await _wait_stopped(conn, h.workdir) else "could not stop"
            if cluster_id:
                with contextlib.suppress(TangramError):
                    await ssh.run(conn, plan.remove_containers_command(cluster_id), timeout=60)
            if purge:
                await ssh.run(conn, f"rm -rf -- {plan.sh_path(h.workdir)}", timeout=60)
            return did

    results = await ssh.run_on_hosts(hosts, one)
    failures = {}
    for name, r in results.items():
        if isinstance(r, BaseException):
            failures[name] = _reason(r)
        elif r == "could not stop":
            failures[name] = "agent did not stop after SIGTERM and SIGKILL"
        elif r:
            echo(f"{name}: agent {r}")
    return failures
