"""One host of `tangram up INVENTORY`: its steps, timed and reported as they happen. No printing:
each step emits ``StepEvent``s through ``Job.emit`` and the caller shows them (render/up.py).

    connect -> check --(the agent runs, no --force)--> done: "running" (agent.json and keys
                     |                                  rewritten only where they differ)
                     +--> probe -> upload (unless the node has the bundle) -> install (unless the
                          venv is ready) -> start (agent.json and keys; the agent, once, detached)

``check`` reads, over one SFTP session (``ssh.check_node``; no shell, whose rc files can cost a
second per command on some nodes), the login's home, whether the agent runs, the sha256 of
agent.json and the keys, the bundle's ``.complete`` hash, whether the venv is ready. So a no-op
re-run of `up` costs one SSH login and one SFTP session per host.

Each node's run directory ``<workdir>/<cluster>/`` holds ``agent.json``, ``agent.pid``,
``agent.log``, ``agent.lock`` and, with CURVE, the node's own secret certificate
(``agent.key_secret``) and the controller's public key (``controller.key``), mode 0600. The agent
is started at most once (``flock -n agent.lock``); a running agent is left alone unless ``force``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tangram.errors import TangramError
from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.bootstrap import bundle as bdl
from tangram_cli.bootstrap import plan, ssh
from tangram_cli.errors import BootstrapError
from tangram_cli.inventory import Node
from tangram_cli.inventory.configs import agent_config

MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class StepEvent:
    """``kind``: "start", "done", "retry", "failed" (a step), or "progress" (a detail while waiting)."""

    node: str
    step: str
    kind: str
    detail: str = ""
    seconds: float | None = None


@dataclass
class HostResult:
    """What `up` did on one host: whether it was bootstrapped (None while in progress) and whether
    its agent registered, which are separate facts (an agent that already ran registers even when
    this `up` could not log in)."""

    node: str
    destination: str
    step: str = "pending"
    bootstrapped: bool | None = None
    registered: bool = False
    started: str = ""  # "started", "running" (already), "restarted"
    reason: str = ""
    hint: str = ""
    attempts: int = 0  # SSH connection attempts made
    rolled_back: bool = False  # its agent was stopped again (failures.settle)
    timings: dict[str, float] = field(default_factory=dict)  # step -> seconds

    @property
    def ok(self) -> bool | None:
        return None if self.bootstrapped is None else bool(self.bootstrapped and self.registered)


@dataclass(frozen=True)
class Job:
    """What every host of one `up` shares."""

    cluster: str
    bundle: bdl.Bundle
    controller_url: str
    allow_remote: bool
    force: bool
    state: st.ClusterState
    known_hosts: str
    emit: Callable[[StepEvent], None]
    touched: Callable[[Any], None]  # called once logged in, before anything is written to the node


def describe(exc: BaseException) -> tuple[str, str]:
    """(reason, hint) of a host's failure, for its REASON and the closing hint."""
    if isinstance(exc, TangramError):
        return exc.message, exc.hint or ""
    return f"{type(exc).__name__}: {exc}", ""


# ---------------------------------------------------------------- one host


class _Host:
    def __init__(self, job: Job, node: Node, result: HostResult) -> None:
        self.job, self.node, self.result = job, node, result
        self.note = ""
        self.run_dir = plan.cluster_dir(node.workdir, job.cluster)
        self.bdir = plan.bundle_dir(node.workdir, job.cluster, job.bundle.digest)
        self.venv = plan.venv_dir(node.workdir, job.cluster, job.bundle.digest)

    @contextlib.asynccontextmanager
    async def step(self, name: str) -> AsyncIterator[None]:
        self.result.step, self.note = name, ""
        self.job.emit(StepEvent(self.node.name, name, "start"))
        t0 = time.monotonic()
        try:
            yield
        except Exception as exc:
            self.result.timings[name] = secs = time.monotonic() - t0
            self.job.emit(StepEvent(self.node.name, name, "failed", describe(exc)[0], secs))
            raise
        self.result.timings[name] = secs = time.monotonic() - t0
        self.job.emit(StepEvent(self.node.name, name, "done", self.note, secs))

    def retry(self, attempt: int, attempts: int, delay_s: float, exc: BootstrapError) -> None:
        self.result.attempts = attempt
        detail = f"attempt {attempt}/{attempts} failed: {exc.message}; retrying in {delay_s:.1f}s"
        self.job.emit(StepEvent(self.node.name, "connect", "retry", detail))

    async def check(self, conn: Any) -> plan.NodeCheck:
        async with self.step("check"):
            seen = await ssh.check_node(conn, self.run_dir, self.bdir, self.venv)
            self.note = "agent running" if seen.running else "no agent running"
        return seen

    async def keep_running(self, conn: Any, seen: plan.NodeCheck) -> str:
        """The agent runs and no --force: rewrite only the files that differ; the agent is kept."""
        files = self.agent_files(seen.home)
        changed = seen.differing(files)
        if changed:
            async with self.step("files"):
                await ssh.upload(conn, {n: files[n] for n in changed}, self.run_dir, marker=False)
                self.note = (
                    f"rewrote {', '.join(changed)}; the running agent keeps its own until `up --force`"
                )
        return "running"

    async def probe(self, conn: Any) -> dict[str, Any]:
        async with self.step("probe"):
            facts = await ssh.probe(conn, self.node.python, timeout=60)
            check_facts(self.node, facts)
            self.note = f"python {facts.get('python')}, {facts.get('cpu_count')} cpus"
        return facts

    async def upload(self, conn: Any, seen: plan.NodeCheck) -> None:
        async with self.step("upload"):
            if seen.bundle == self.job.bundle.digest:
                self.note = "bundle already there"
                return
            await ssh.upload(conn, self.job.bundle.files, self.bdir)
            self.note = f"bundle {self.job.bundle.short} sent"

    async def install(self, conn: Any, seen: plan.NodeCheck) -> None:
        async with self.step("install"):
            if seen.ready and seen.bundle == self.job.bundle.digest:
                self.note = "venv ready"
                return
            await ssh.run(
                conn,
                plan.install_command(self.node.python, self.bdir, self.venv, system_site_packages=True),
                timeout=300,
                check=True,
            )
            await self._setup_venv(conn)
            await ssh.run(conn, plan.ready_command(self.venv), check=True)

    async def _setup_venv(self, conn: Any) -> None:
        """Extract the bundle into the venv's path; pip-install the modules the node's python lacks."""
        vpy = f"{plan.sh_path(self.venv)}/bin/python"
        script = shlex.quote(bdl.SETUP_SCRIPT)
        cmd = f"{vpy} -c {script} {plan.sh_path(self.bdir)} {plan.sh_path(self.venv)}"
        missing = (await ssh.run(conn, cmd, timeout=120, check=True)).stdout.split()
        if not missing:
            return
        self.note = f"pip install {' '.join(missing)}"
        self.job.emit(StepEvent(self.node.name, "install", "progress", self.note))
        pkgs = [{"zmq": "pyzmq"}.get(m, m) for m in missing]
        if not (await ssh.run(conn, plan.pip_install_command(self.venv, pkgs), timeout=300)).ok:
            raise BootstrapError(
                f"node python lacks {', '.join(missing)} and pip could not install them", host=self.node.name
            )

    async def start(self, conn: Any, seen: plan.NodeCheck, facts: dict[str, Any]) -> str:
        async with self.step("start"):
            files = self.agent_files(seen.home or (facts.get("disk") or {}).get("path") or "~")
            changed = seen.differing(files)
            if changed:
                await ssh.upload(conn, {n: files[n] for n in changed}, self.run_dir, marker=False)
            how = "started"
            if seen.running:  # --force
                await ssh.run(conn, plan.stop_command(self.run_dir))
                await wait_stopped(conn, self.run_dir)
                how = "restarted"
            r = await ssh.run(conn, plan.start_command(self.run_dir, self.venv), timeout=30)
            if not r.ok:
                if not await agent_running(conn, self.run_dir):
                    tail = await ssh.run(conn, f"tail -n 5 {plan.sh_path(self.run_dir)}/agent.log")
                    raise BootstrapError(
                        f"agent did not start (exit {r.exit_status}): "
                        f"{(r.stderr or tail.stdout).strip()[-300:]}",
                        host=self.node.name,
                    )
                how = "running"
            self.note = how
        return how

    def agent_files(self, home: str) -> dict[str, bytes]:
        return agent_files(self.node, home, self.run_dir, self.job)


async def bootstrap_host(job: Job, node: Node, result: HostResult) -> str:
    """Bootstrap one host; returns how its agent runs ("started", "running", "restarted").
    Raises the typed error of the step that failed (``result.step`` names it)."""
    h = _Host(job, node, result)
    async with h.step("connect"):
        conn = await ssh.connect(node, job.known_hosts, on_retry=h.retry)
        result.attempts += 1
    async with conn:
        job.touched(node)
        seen = await h.check(conn)
        if seen.running and not job.force:
            return await h.keep_running(conn, seen)
        facts = await h.probe(conn)
        await h.upload(conn, seen)
        await h.install(conn, seen)
        return await h.start(conn, seen, facts)


# ---------------------------------------------------------------- what goes to a node


def agent_files(node: Node, home: str, run_dir: str, job: Job) -> dict[str, bytes]:
    """What goes into the node's run directory: ``agent.json`` and, with CURVE, the node's own keypair
    and the controller's public key (mode 0600). ``home``: the login's home, for ``~`` paths."""
    state = job.state
    emulated = (node.gpu_count or 0) if node.emulated_gpus or isinstance(node.gpus, int) else 0
    abs_run = run_dir.replace("~", home, 1) if run_dir.startswith("~") else run_dir
    files: dict[str, bytes] = {}
    curve = None
    if state.certs:
        files = keys.agent_files(Path(state.certs), node.name)
        curve = {"controller_public": f"{abs_run}/controller.key", "secret": f"{abs_run}/agent.key_secret"}
    cfg = agent_config(
        node,
        cluster=state.name,
        controller=job.controller_url,
        workdir=abs_run,
        executor=node.executor if node.executor in ("auto", "docker", "process") else "auto",
        emulated_gpus=emulated,
        gpu_mem_mib=node.gpu_mem_mib,
        allow_remote=job.allow_remote,
        curve=curve,
        cluster_id=state.cluster_id,
    )
    files["agent.json"] = cfg.to_json().encode()
    return files


def check_facts(node: Node, facts: dict[str, Any]) -> None:
    """Raise BootstrapError when the probed node cannot run what the inventory asks of it."""
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
    outside = sorted(set(node.cpus or ()) - allowed) if allowed else []
    if outside:
        raise BootstrapError(
            f"cpus {outside} are not online on the node (online: {sorted(allowed)})", host=node.name
        )
    mem = facts.get("mem_total_mib")
    if node.mem_mib and isinstance(mem, int) and node.mem_mib > mem:
        raise BootstrapError(f"mem {node.mem_mib}MiB is more than the node has ({mem}MiB)", host=node.name)
    if node.executor == "docker" and not (facts.get("docker") or {}).get("access"):
        raise BootstrapError(
            "no docker socket access",
            host=node.name,
            hint="add the ssh user to the docker group, or use executor: process",
        )


# ---------------------------------------------------------------- the agent process


async def agent_running(conn: Any, run_dir: str) -> bool:
    pidfile = f"{plan.sh_path(run_dir)}/agent.pid"
    r = await ssh.run(
        conn,
        f'pid=$(cat {pidfile} 2>/dev/null) && case "$pid" in ""|*[!0-9]*) exit 1;; esac '
        f'&& kill -0 "$pid" 2>/dev/null && grep -q agent /proc/"$pid"/cmdline',
    )
    return r.ok


async def wait_stopped(conn: Any, run_dir: str, timeout_s: float = 10.0) -> bool:
    """Wait for the agent to exit after a SIGTERM; SIGKILL it at ``timeout_s``. True once gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not await agent_running(conn, run_dir):
            return True
        await asyncio.sleep(0.2)
    await ssh.run(conn, plan.stop_command(run_dir, signal="KILL"))
    await asyncio.sleep(0.2)
    return not await agent_running(conn, run_dir)
