"""``python -m agent --config agent.json`` or ``python -m agent --controller tcp://HOST:PORT [flags]``.

Stdlib argparse (the agent bundle carries no click). Flags override the file's values; see
docs/agent.md for every key. Exit codes: 0 clean stop, 1 failure, 2 bad configuration, 3 rejected.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from agent.config import EXECUTORS, AgentConfig, parse_mib
from tangram.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m agent", description="Run a Tangram node agent in the foreground.",
        epilog="Stop it with SIGTERM or Ctrl-C (sandboxes keep running), "
               "or from the controller (`tangram down`).")
    ap.add_argument("--config", metavar="FILE", help="JSON file of agent settings (flags override it)")
    ap.add_argument("--controller", metavar="tcp://HOST:PORT", help="the controller's agents address")
    ap.add_argument("--name", help="node name (default: the host name)")
    ap.add_argument("--cluster", help="cluster name, labels the sandboxes (default: default)")
    ap.add_argument("--cluster-id", help="the cluster's unique id (from `tangram up`): only containers "
                                         "labelled with it are this agent's (default: none)")
    ap.add_argument("--executor", choices=EXECUTORS, help="auto = docker if dockerd answers, else process")
    ap.add_argument("--docker-mode", choices=("auto", "fastpath", "docker"), help="docker executor exec path")
    ap.add_argument("--cpus", metavar="LIST", help="cores to hand out, e.g. 0-7 (default: online minus idle)")
    ap.add_argument("--idle-cpus", metavar="LIST",
                    help="cores idle sandboxes park on (default: the first online)")
    ap.add_argument("--mem", metavar="SIZE", help="memory offered for sandboxes, e.g. 16GiB")
    ap.add_argument("--workdir", metavar="DIR",
                    help="pidfile, log and process sandboxes (default ~/.tangram/agent/NAME)")
    ap.add_argument("--image", help="default sandbox image (default tangram/hostroot:1)")
    ap.add_argument("--emulated-gpus", type=int, metavar="N", help="emulate N GPUs")
    ap.add_argument("--gpu-memory", metavar="SIZE", help="memory of each emulated GPU, e.g. 16GiB")
    ap.add_argument("--restore-gbps", type=float, metavar="GB/S", help="emulated restore bandwidth")
    ap.add_argument("--heartbeat", type=float, metavar="S", help="heartbeat interval before the Welcome")
    ap.add_argument("--orphan-timeout", type=float, metavar="S",
                    help="cut off this long: kill running actions")
    ap.add_argument("--log-file", metavar="FILE", help="log here instead of stderr")
    ap.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    ap.add_argument("--log-format", choices=("text", "json"),
                    help="text (default) or json lines; default: $TANGRAM_LOG_FORMAT, else text")
    ap.add_argument("--allow-remote", action="store_true", default=None,
                    help="allow a non-loopback controller over plain TCP (no encryption yet)")
    ap.add_argument("--trusted-code-only", action="store_true", default=None,
                    help="process executor: run actions without containment (as this user, no limits) "
                         "where the host cannot contain them, instead of refusing to start")
    ap.add_argument("--sandbox-mem", metavar="SIZE",
                    help="memory limit of a sandbox created without `mem` (default: --mem)")
    return ap


def overrides(ns: argparse.Namespace) -> dict[str, Any]:
    return {
        "controller": ns.controller, "name": ns.name, "cluster": ns.cluster,
        "cluster_id": ns.cluster_id, "executor": ns.executor,
        "docker_mode": ns.docker_mode, "cpus": ns.cpus, "idle_cpus": ns.idle_cpus,
        "mem_mib": parse_mib(ns.mem, "--mem") if ns.mem is not None else None, "workdir": ns.workdir,
        "image": ns.image, "emulated_gpus": ns.emulated_gpus,
        "gpu_mem_mib": parse_mib(ns.gpu_memory, "--gpu-memory") if ns.gpu_memory is not None else None,
        "restore_bandwidth_gbps": ns.restore_gbps, "heartbeat_s": ns.heartbeat,
        "orphan_timeout_s": ns.orphan_timeout, "log_file": ns.log_file, "log_level": ns.log_level,
        "log_format": ns.log_format,
        "allow_remote": ns.allow_remote, "trusted_code_only": ns.trusted_code_only,
        "sandbox_mem_mib": parse_mib(ns.sandbox_mem, "--sandbox-mem") if ns.sandbox_mem is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        cfg = AgentConfig.load(ns.config, **overrides(ns))
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"To fix: {exc.hint}", file=sys.stderr)
        return 2
    # start-up cost: --help and bad flags are answered without loading pyzmq and the executors
    from agent.link import main as run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
