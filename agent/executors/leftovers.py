"""What a dead agent left running in its sandbox containers, found and killed by the next one (``recover``).

A sandbox's *state* survives an agent restart: the container, its files, its init. Only the *running
actions* of the dead agent must go, before the new agent offers any core:

* fast path actions: everything in the container's action sub-cgroups (``tangram-slot-N``, see
  ``fastpath.SlotPool``), ``setsid`` daemons included; the slots are removed (the new agent makes its own);
* the dead agent's spawner, if it is still there (it leaves by itself when the agent's end of its socket
  closes, killing its actions' process groups): the process in the container's cgroup running
  ``nsspawner.py``;
* ``docker exec`` actions (the ``docker`` mode, and ``nsenter``-less fallbacks): every exec of the
  container that still runs, its process group killed from inside the container (as ``Kill`` does), then
  whatever they started in the background (``docker_sweep``: every process of the sandbox user).

Blocking (docker API calls, cgroupfs): run it in a worker thread.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from . import docker_sweep, fastpath
from .base import parse_owner

SPAWNER_SCRIPT = "nsspawner.py"
LABEL_USER = "tangram.user"  # the sandbox user (uid:gid) of a container; its own user is the keeper
log = logging.getLogger("agent.executors.docker")


@dataclass
class Leftovers:
    containers: int = 0
    slots: int = 0
    processes: int = 0  # killed in slots
    spawners: int = 0
    execs: int = 0
    swept: int = 0  # processes of the sandbox user left outside action cgroups (docker_sweep)

    def add(self, other: Leftovers) -> None:
        for key in ("containers", "slots", "processes", "spawners", "execs", "swept"):
            setattr(self, key, getattr(self, key) + getattr(other, key))


def kill_exec(api: Any, cid: str, user: str, exec_id: str) -> bool:
    """SIGKILL the process group of a running exec, from inside the container (runc makes each exec a
    session leader). False when it no longer runs."""
    info = api.exec_inspect(exec_id)
    host_pid = int(info.get("Pid") or 0)
    if not info.get("Running") or host_pid <= 0:
        return False
    ns_pid = ns_pid_of(host_pid)
    if ns_pid is None:
        return False
    kill_id = api.exec_create(cid, ["kill", "-9", "--", f"-{ns_pid}"], user=user)["Id"]
    api.exec_start(kill_id)
    return True


def ns_pid_of(host_pid: int) -> int | None:
    """The pid of ``host_pid`` in its own (innermost) pid namespace."""
    try:
        with open(f"/proc/{host_pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def _is_spawner(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(SPAWNER_SCRIPT.encode()) for a in argv[:4])


def reap_cgroups(cg: fastpath.ContainerCgroups, spawners: list[int] | None = None) -> Leftovers:
    """Kill and remove the container's action slots; kill a spawner left in its cgroup (its pid is added
    to ``spawners``)."""
    out = Leftovers()
    try:
        names = sorted(n for n in os.listdir(cg.cpuset) if n.startswith(fastpath.SUB_PREFIX))
    except OSError:
        names = []
    for name in names:
        slot = os.path.join(cg.cpuset, name)
        out.slots += 1
        out.processes += len(fastpath.cgroup_pids(slot))
        if not fastpath.kill_cgroup(slot, 5.0):
            log.error("processes left in %s after 5 s of SIGKILL", slot)
        fastpath.remove_cgroup(slot)
    for pid in fastpath.cgroup_pids(cg.cpuset):
        if _is_spawner(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            out.spawners += 1
            if spawners is not None:
                spawners.append(pid)
    return out


def reap_container(api: Any, cid: str, fast: bool) -> Leftovers:
    """Everything above, for one running container."""
    attrs = api.inspect_container(cid)
    out = Leftovers(containers=1)
    pid = int(attrs.get("State", {}).get("Pid") or 0)
    spawners: list[int] = []
    if fast and pid > 0:
        try:
            cg = fastpath.discover(pid)
        except OSError:
            cg = None
        if cg is not None:
            out.add(reap_cgroups(cg, spawners))
    config = attrs.get("Config") or {}
    labelled = (config.get("Labels") or {}).get(LABEL_USER)
    user = labelled or config.get("User") or ""
    for exec_id in attrs.get("ExecIDs") or []:
        try:
            out.execs += kill_exec(api, cid, user, exec_id)
        except Exception as exc:  # noqa: BLE001 - docker.errors.*: gone meanwhile, or dockerd trouble
            log.warning("cannot kill exec %s of %s: %s", exec_id[:12], cid[:12], exc)
    owner = parse_owner(labelled) if labelled else None
    if owner is not None and pid > 0:  # only where the init runs as the keeper (see docker_sweep)
        try:
            found = docker_sweep.sweep(api, cid, user, owner[0], docker_sweep.container_procs_dir(pid),
                                       tuple(spawners))
            out.swept += max(found, 0)
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("cannot sweep %s: %s", cid[:12], exc)
    return out
