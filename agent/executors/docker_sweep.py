"""The end of an action on the ``docker`` exec path: kill whatever the action left in the container.

On the fast path every action lives in a sub-cgroup that is emptied when it ends (``fastrun``). A ``docker
exec`` cannot be started in a cgroup of its own, and what it starts in the background (``setsid``, ``nohup``,
a double fork) outlives it, re-parented to the container's init, on the cores the sandbox was granted. So
when the last running action of a sandbox that took this path ends (sandbox code runs one action at a time;
with several, the sweep waits for the last), before its cores go back to the idle set:

1. ``leftovers``: the processes of the container's cgroup that run as the sandbox user, apart from the
   spawner (cheap: one ``cgroup.procs`` read and a ``/proc/PID/status`` per process). None: done.
2. ``sweep``: ``kill -9 -1`` exec'd as the sandbox user: every process of that user in the container's pid
   namespace but the ``kill`` itself, in one system call (nothing forks out from under it). The container's
   init and its sleeper run as the keeper (``docker_limits.keeper_for``), which the sandbox user cannot
   signal; the spawner is outside the container's pid namespace. Repeated (bounded) while step 1 still
   finds some.

Where the agent cannot read the container's cgroup, step 1 is skipped and the kill always runs.
Only containers with the keeper (labelled ``tangram.user``) are swept: in an older one the init runs as
the sandbox user, and ``kill -1`` would stop the container.

Blocking (Docker API, ``/proc``): run in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from . import fastpath

KILL_ALL = ["kill", "-9", "--", "-1"]
ROUNDS = 3
log = logging.getLogger("agent.executors.docker")


def uid_of(pid: int) -> int | None:
    """The real uid of ``pid``; None when it is gone or dead (a zombie: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def leftovers(procs_dir: str, uid: int, spare: tuple[int, ...] = ()) -> list[int]:
    """Processes of ``uid`` in the cgroup ``procs_dir`` (not its children) but ``spare``."""
    return [p for p in fastpath.cgroup_pids(procs_dir) if p not in spare and uid_of(p) == uid]


def sweep(api: Any, cid: str, user: str, uid: int, procs_dir: str | None, spare: tuple[int, ...] = ()) -> int:
    """Kill what runs as ``user`` in the container (see the module doc); returns how many processes step 1
    found (-1: it could not look). Raises the Docker API's errors."""
    found = -1
    for _ in range(ROUNDS):
        if procs_dir is not None:
            left = leftovers(procs_dir, uid, spare)
            if found < 0:
                found = len(left)
            if not left:
                return found
        kill_id = api.exec_create(cid, KILL_ALL, user=user)["Id"]
        api.exec_start(kill_id)  # attached: returns once the kill has run
        if procs_dir is None:
            return found
    if procs_dir is not None and leftovers(procs_dir, uid, spare):
        log.warning("container %s: processes of %s still left after %d sweeps", cid[:12], user, ROUNDS)
    return found


def container_procs_dir(pid: int) -> str | None:
    """The container's own cgroup directory (v1: its cpuset cgroup; v2: its cgroup), from its init's pid;
    None where it cannot be read."""
    with contextlib.suppress(OSError):
        cg = fastpath.discover(pid)
        if cg is not None and fastpath.cgroup_pids(cg.cpuset):
            return cg.cpuset
    return None
