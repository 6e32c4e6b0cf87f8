"""The agent process around ``link.Agent``: logging, the pidfile, the machine facts of ``Hello``, the
executor and GPU host it is built with, and the entry point (``main``, also ``agent.link.main``)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import tangram
from agent.executors.base import format_cpuset
from agent.executors.process import ProcessExecutor
from agent.probe import probe
from tangram import logfmt
from tangram.errors import ConfigError

from .config import AgentConfig

log = logging.getLogger("agent")
EXIT_CONFIG = 2


def setup_logging(cfg: AgentConfig) -> None:
    """The one log format (tangram/logfmt.py): ``log_format``, else $TANGRAM_LOG_FORMAT, else text."""
    logfmt.configure("agent", node=cfg.name, fmt=cfg.log_format or None, level=cfg.log_level,
                     path=cfg.log_file or None)
    own = logging.getLogger("agent")  # an earlier setup gave it a handler of its own
    own.handlers[:] = []
    own.setLevel(logging.NOTSET)
    own.propagate = True


def write_pidfile(path: str) -> None:
    """``agent.pid`` in the workdir; refuses when another live agent holds it."""
    try:
        with open(path, encoding="ascii") as f:
            other = int(f.read().strip() or 0)
    except (OSError, ValueError):
        other = 0
    if other and other != os.getpid() and _alive(other):
        raise ConfigError(f"another agent (pid {other}) runs with this workdir ({path})",
                          hint="stop it first, or give this agent its own --workdir")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def remove_pidfile(path: str) -> None:
    try:
        with open(path, encoding="ascii") as f:
            mine = int(f.read().strip() or 0) == os.getpid()
    except (OSError, ValueError):
        return
    if mine:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def build_facts(cfg: AgentConfig, machine: Any, cpus: list[int], idle: list[int], executor_kind: str,
                gpus: list[Any]) -> dict[str, Any]:
    """The Hello facts of the contract (docs/agent.md)."""
    numa = [[c for c in node if c in set(cpus)] for node in machine.numa]
    numa = [n for n in numa if n] or [list(cpus)]
    return {
        "cpus": list(cpus), "idle_cpus": list(idle), "numa": numa,
        "mem_mib": cfg.mem_mib if cfg.mem_mib is not None else machine.mem_offer_mib,
        "gpus": len(gpus), "gpu_mem_mib": min((g.memory_total_mib for g in gpus), default=0),
        "gpu_uuids": [g.uuid for g in gpus], "executor": executor_kind, "docker": bool(machine.docker),
        "cgroup": machine.cgroup, "hostname": machine.hostname[:256], "pid": os.getpid(),
        "version": tangram.__version__, "python": machine.python, "cluster": cfg.cluster,
        "services": [s["name"] for s in cfg.services],
    }


def build_executor(cfg: AgentConfig, docker_ok: bool, idle: list[int]) -> tuple[Any, str]:
    kind = cfg.executor
    if kind == "auto":
        kind = "docker" if docker_ok else "process"
    if kind == "docker":
        if not docker_ok:
            raise ConfigError("executor docker: no dockerd answers",
                              hint="start dockerd (or set DOCKER_HOST), or use --executor process")
        # docker-py is optional on a node: only the docker executor loads it (and these modules need it)
        import docker

        from agent.executors.docker import DockerExecutor
        from agent.executors.images import HOSTROOT_IMAGE, ensure_hostroot_image

        client = docker.from_env(timeout=60)
        if cfg.image == HOSTROOT_IMAGE:
            ensure_hostroot_image(client)
        return DockerExecutor(client, cfg.cluster, format_cpuset(idle), cfg.image, mode=cfg.docker_mode,
                              node=cfg.name, user=cfg.docker_user, mem_mib=cfg.default_sandbox_mem(),
                              disk_mib=cfg.sandbox_disk_mib, workdir=cfg.workdir,
                              cluster_id=cfg.cluster_id, pool_max=cfg.pool_max,
                              pool_concurrency=cfg.pool_concurrency), kind

    return ProcessExecutor(os.path.join(cfg.workdir, "sandboxes"), format_cpuset(idle), cluster=cfg.cluster,
                           node=cfg.name, trusted_code_only=cfg.trusted_code_only,
                           sandbox_mem_mib=cfg.default_sandbox_mem(), uid_base=cfg.sandbox_uid_base,
                           uid_count=cfg.sandbox_uid_count), kind


def build_gpu_host(cfg: AgentConfig, machine: Any) -> tuple[Any, list[Any]]:
    """(GpuHost or None, GpuInfo list): emulated devices when asked, else NVML's, else none."""
    try:  # the GPU modules load here only: if they fail to import, the node still serves CPU work
        from agent.gpu.base import GpuInfo, emulated_gpus
        from agent.gpu.emulated import EmulatedConfig
        from agent.gpu.host import GpuHost
    except ImportError as exc:
        log.warning("GPU host unavailable (%s): no GPU services", exc)
        return None, []
    runtimes: dict[str, Any] = {"emulated": EmulatedConfig(bandwidth_gbps=cfg.restore_bandwidth_gbps)}
    if cfg.emulated_gpus:
        gpus = emulated_gpus(cfg.emulated_gpus, cfg.gpu_mem_mib, node=cfg.name)
        return GpuHost(gpus, runtimes), gpus
    if not machine.gpus:
        return None, []
    from agent.gpu.nvml import device_memory  # the GPU modules, as above
    from agent.gpu.runtimes import default_runtimes

    gpus = [GpuInfo(index=g["index"], uuid=g["uuid"], name=g["name"], memory_total_mib=g["memory_total_mib"],
                    memory_used_mib=g.get("memory_used_mib", 0), cpus=tuple(g.get("cpus", ())),
                    pci_bus_id=g.get("pci_bus_id", "")) for g in machine.gpus]
    # real devices: every runtime (emulated, vllm, sglang; torch when installed), and 1 GiB per GPU
    # kept back for the CUDA context and allocator slack, as agent.gpu.runtimes.build_host does
    runtimes = default_runtimes(EmulatedConfig(bandwidth_gbps=cfg.restore_bandwidth_gbps))
    return GpuHost(gpus, runtimes, reserve_mib=1024, device_memory=device_memory), gpus


async def run_agent(cfg: AgentConfig) -> int:
    """Probe, build the executor and GPU host, write the pidfile, run until stopped."""
    machine = await asyncio.to_thread(probe, cfg.executor != "process", cfg.emulated_gpus == 0)
    cpus, idle = cfg.resolve_cpus(machine.online)
    executor, kind = await asyncio.to_thread(build_executor, cfg, machine.docker, idle)
    gpu_host, gpus = build_gpu_host(cfg, machine)
    facts = build_facts(cfg, machine, cpus, idle, kind, gpus)
    log.info("agent %s: executor %s, cpus %s, idle %s, %d MiB, %d GPUs, controller %s", cfg.name, kind, cpus,
             idle, facts["mem_mib"], len(gpus), cfg.controller)
    from .link import Agent  # an import cycle: link imports this module

    agent = Agent(cfg, executor, facts=facts, gpu_host=gpu_host, cpus=cpus)
    pidfile = cfg.pidfile()
    write_pidfile(pidfile)
    try:
        await recover(executor)
        code = await agent.run()
    finally:
        await agent.close()
        remove_pidfile(pidfile)
    return code


async def recover(executor: Any) -> None:
    """Before the first Hello, so before any core is offered: kill the actions an earlier incarnation of this
    node left running (its sandboxes stay, for the controller to adopt or destroy). Failures are logged: a
    node that cannot clean up still serves (what it could not kill is in the log)."""
    fn = getattr(executor, "recover", None)
    if fn is None:
        return
    try:
        await fn()
    except Exception:  # e.g. dockerd errors: the agent still starts
        log.exception("recovery of an earlier agent's actions failed")


def main(cfg: AgentConfig) -> int:
    """Process entry for ``python -m agent`` and ``tangram agent``: returns the exit code."""
    os.makedirs(cfg.workdir, exist_ok=True)
    setup_logging(cfg)
    try:
        return asyncio.run(run_agent(cfg))
    except ConfigError as exc:
        log.error("%s%s", exc.message, f" (to fix: {exc.hint})" if exc.hint else "")
        return EXIT_CONFIG
    except Exception as exc:
        from .link import AgentExit  # an import cycle: link imports this module

        if not isinstance(exc, AgentExit):
            raise
        log.error("%s", exc)
        return exc.code
