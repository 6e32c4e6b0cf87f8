"""`tangram agent`: run a node agent in the foreground (the same process as `python -m agent`)."""

from __future__ import annotations

import sys

import click

from agent import link
from agent.config import AgentConfig, parse_mib
from tangram_cli.params import Duration, deprecated


@click.command("agent")
@click.option("--controller", metavar="tcp://HOST:PORT",
              help="The controller's agents address (required unless the --config file has it).")
@click.option("--name", help="Node name; the agent's ZeroMQ identity. Default: the host name.")
@click.option("--cluster", help="Cluster name; labels the sandbox containers. Default: default.")
@click.option("--cluster-id", help="The cluster's unique id (`tangram up` makes it): only containers "
              "labelled with it are this agent's. Default: none.")
@click.option("--cpus", metavar="LIST",
              help="Cores to hand out, e.g. 0-7. Default: online cores minus the idle set.")
@click.option("--idle-cpus", metavar="LIST",
              help="Cores idle sandboxes park on. Default: the first online core.")
@click.option("--executor", type=click.Choice(["auto", "docker", "process"]),
              help="auto (default) = docker if dockerd answers, else process.")
@click.option("--docker-mode", type=click.Choice(["auto", "fastpath", "docker"]),
              help="Exec path of the docker executor (fastpath needs root and nsenter).")
@click.option("--mem", metavar="SIZE",
              help="Memory offered for sandboxes, e.g. 16GiB. Default: RAM minus a reserve.")
@click.option("--emulated-gpus", type=click.IntRange(0, 64), metavar="N",
              help="Emulate N GPUs (no NVIDIA needed).")
@click.option("--gpu-mem", metavar="SIZE", help="Memory of each emulated GPU, e.g. 16GiB (default 16GiB).")
@click.option("--gpu-memory", metavar="SIZE", hidden=True, help="Old name of --gpu-mem.")
@click.option("--restore-gbps", type=float, metavar="GB/S", help="Emulated restore bandwidth (default 25).")
@click.option("--image",
              help="Default sandbox image (default tangram/hostroot:1, built locally with docker import).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              help="JSON file of agent settings; the flags above override it (docs/agent.md).")
@click.option("--workdir", type=click.Path(file_okay=False), help="Pidfile, log, process sandboxes. "
              "Default: ~/.tangram/agent/NAME.")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Log here instead of stderr.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--orphan-timeout", type=Duration(0, 86400),
              help="Cut off from the controller this long: kill running actions (default 60s).")
@click.option("--trusted-code-only", is_flag=True, default=None,
              help="Process executor on a host that cannot contain sandboxes (not root, no cgroups): run "
                   "actions uncontained instead of refusing to start. Only for trusted code.")
def command(controller: str | None, name: str | None, cluster: str | None, cluster_id: str | None,
            cpus: str | None, idle_cpus: str | None, executor: str | None, docker_mode: str | None,
            mem: str | None,
            emulated_gpus: int | None, gpu_mem: str | None, gpu_memory: str | None,
            restore_gbps: float | None, image: str | None,
            config_file: str | None, workdir: str | None, log_file: str | None, log_level: str | None,
            orphan_timeout: float | None, trusted_code_only: bool | None) -> None:
    """Run a node agent in the foreground: register with the controller, heartbeat, run its commands.

    The agent reports this machine's cores, NUMA layout, memory, cgroup version, Docker and GPUs,
    then creates sandboxes and runs actions on exactly the cores the controller grants.

    \b
    Examples:
      tangram agent --controller tcp://127.0.0.1:7700
      tangram agent --controller tcp://127.0.0.1:7700 --name cpu-01 --cpus 1-7 --idle-cpus 0
      tangram agent --controller tcp://127.0.0.1:7700 --executor process --emulated-gpus 2 --gpu-mem 16GiB
      tangram agent --config agent.json

    SIGTERM or Ctrl-C stops it gracefully (sandboxes keep running); the controller's Shutdown
    (`tangram down`) stops it too. The pid is in WORKDIR/agent.pid while it runs.

    Exit codes: 0 stopped, 1 failure, 2 bad configuration, 3 rejected by the controller.
    """
    if controller is None and config_file is None:
        raise click.UsageError("give --controller tcp://HOST:PORT (or a --config file that has it)")
    if gpu_memory is not None:
        deprecated("--gpu-memory", "--gpu-mem")
        gpu_mem = gpu_mem or gpu_memory
    cfg = AgentConfig.load(
        config_file, controller=controller, name=name, cluster=cluster, cluster_id=cluster_id, cpus=cpus,
        idle_cpus=idle_cpus,
        executor=executor, docker_mode=docker_mode, mem_mib=parse_mib(mem, "--mem") if mem else None,
        emulated_gpus=emulated_gpus,
        gpu_mem_mib=parse_mib(gpu_mem, "--gpu-mem") if gpu_mem else None,
        restore_bandwidth_gbps=restore_gbps, image=image, workdir=workdir, log_file=log_file,
        log_level=log_level.upper() if log_level else None, orphan_timeout_s=orphan_timeout,
        trusted_code_only=trusted_code_only,
    )
    sys.exit(link.main(cfg))
