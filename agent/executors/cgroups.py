"""Action cgroups of the process executor: every action in a cgroup of its own, found again after a crash.

Layout, under the mount point of one hierarchy (``pick_hierarchy``)::

    tangram/<cluster>/<node>/agent-<pid>-<start>-<n>/    one per executor of one agent process ("incarnation")
        spawner/                                      the agent's spawner (plain mode) lives here
        slot-<k>/                                     one per running action (a pool: see below)

``<pid>`` and ``<start>`` (the start time in ``/proc/PID/stat``, clock ticks since boot) name the agent
process, so a later agent of the same node can tell an incarnation whose agent is gone (killed, crashed:
``reap_predecessors`` kills everything in it and removes it) from one that still runs (left alone: two
agents that share a node name must not kill each other's work).

Which hierarchy: cgroup v1 ``freezer`` (freeze, SIGKILL, thaw: nothing forks while it is killed), else v1
``pids``, else the cgroup2 mount (the whole machine on v2, ``/sys/fs/cgroup/unified`` on hybrid systems;
``cgroup.kill`` kills a cgroup at once). Only process membership is used: no controller is enabled and
no limit is set, so the v2 "no internal processes" rule never applies. The process executor pins with
``sched_setaffinity``, not cpusets, so the cpuset hierarchy is not needed.

A child is in its action's cgroup before it execs (the spawner moves itself in for the ``posix_spawn``,
or the fallback's shell writes its own pid first), so nothing it starts (``setsid``, ``nohup``, double
forks) can be outside it. The action cgroups are *slots*, kept for the next action when they end empty
(reading ``cgroup.procs``: ~15 us of CPU, where ``mkdir`` + ``rmdir`` of a cgroup block the caller for
60-100 us); a slot with processes left is killed (``kill_tree``) and removed, in a worker thread.

Everything here is synchronous and touches only cgroupfs and ``/proc``. The builders (``pick_hierarchy``,
``node_dir``, ``incarnation_name``, ``parse_incarnation``) are pure.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

from .fastpath import CgroupMount, _read, _write, parse_mountinfo

ROOT = "tangram"
SPAWNER = "spawner"
SLOT_PREFIX = "slot-"
POOL_MAX = 64  # free slots kept per incarnation; more are removed
KILL_DEADLINE_S = 5.0
FREEZE_WAIT_S = 1.0
_INCARNATION_RE = re.compile(r"^agent-([0-9]+)-([0-9]+)-([0-9]+)$")
_seq = itertools.count()
log = logging.getLogger("agent.executors.cgroups")


class CgroupError(OSError):
    """A cgroup that could not be emptied or removed in time."""


@dataclass(frozen=True)
class Hierarchy:
    path: str  # mount point: where ``tangram/`` goes
    v2: bool
    controller: str = ""  # v1: "freezer" or "pids"; "" on cgroup2

    @property
    def label(self) -> str:
        return f"v2 ({self.path})" if self.v2 else f"v1 {self.controller} ({self.path})"


@dataclass
class Reaped:
    """What ``reap_predecessors`` found: incarnations of dead agents, their cgroups that still held processes
    (running actions, or a spawner), the processes killed in them."""

    incarnations: int = 0
    cgroups: int = 0
    processes: int = 0
    skipped: int = 0  # incarnations whose agent still runs


# ---------------------------------------------------------------- pure


def pick_hierarchy(mounts: list[CgroupMount]) -> Hierarchy | None:
    """v1 freezer, else v1 pids, else a cgroup2 mount (``/sys/fs/cgroup`` first); None without any."""
    for ctrl in ("freezer", "pids"):
        for m in mounts:
            if ctrl in m.controllers:
                return Hierarchy(m.path, v2=False, controller=ctrl)
    v2 = [m for m in mounts if not m.controllers]
    v2.sort(key=lambda m: m.path != "/sys/fs/cgroup")
    return Hierarchy(v2[0].path, v2=True) if v2 else None


def node_dir(h: Hierarchy, cluster: str, node: str) -> str:
    """Where the incarnations of one node live (names are checked by the agent's configuration)."""
    for part in (cluster, node):
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"bad cgroup name part {part!r}")
    return os.path.join(h.path, ROOT, cluster, node)


def incarnation_name(pid: int, start: int, n: int) -> str:
    return f"agent-{pid}-{start}-{n}"


def new_incarnation_name() -> str:
    """A fresh incarnation name for this agent process (distinct for every executor it opens)."""
    pid = os.getpid()
    return incarnation_name(pid, proc_start(pid) or 0, next(_seq))


def parse_incarnation(name: str) -> tuple[int, int] | None:
    """``agent-PID-START-N`` -> (PID, START); None for any other name."""
    m = _INCARNATION_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---------------------------------------------------------------- /proc and cgroupfs


def proc_start(pid: int) -> int | None:
    """The start time of ``pid`` (field 22 of ``/proc/PID/stat``); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def discover() -> Hierarchy | None:
    with open("/proc/self/mountinfo") as f:
        return pick_hierarchy(parse_mountinfo(f.read()))


def procs_file(cg_dir: str) -> str:
    return os.path.join(cg_dir, "cgroup.procs")


def join_file(h: Hierarchy, cg_dir: str) -> str:
    """The file a single-threaded process writes ``0`` to, to move itself into ``cg_dir``. On v1 that is
    ``tasks`` (move the calling thread): unlike a write to ``cgroup.procs`` it does not take the kernel's
    global threadgroup lock for writing, which waits for an RCU grace period when no cgroup migration
    happened for a while (measured here: 10-14 ms per move after 50 ms of quiet, against 25-40 us). v2
    has no such way (a thread alone cannot change domain cgroups): ``cgroup.procs``."""
    return os.path.join(cg_dir, "cgroup.procs" if h.v2 else "tasks")


def pids(cg_dir: str) -> list[int]:
    """The processes in one cgroup (not its children); [] when it is gone. 0: outside our pid namespace."""
    try:
        return [p for p in map(int, _read(procs_file(cg_dir)).split()) if p > 0]
    except FileNotFoundError:
        return []


def subtree(cg_dir: str) -> list[str]:
    """``cg_dir`` and every cgroup below it, children before parents."""
    out = [root for root, _, _ in os.walk(cg_dir, topdown=False)]
    return out or ([cg_dir] if os.path.isdir(cg_dir) else [])


def _kill(pid_list: list[int]) -> None:
    for pid in pid_list:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _kill_at_once(h: Hierarchy, cg_dir: str, listed: list[int]) -> None:
    """Kill the whole cgroup so that nothing can fork meanwhile: ``cgroup.kill`` (v2), or freeze, SIGKILL,
    thaw (v1 freezer). Elsewhere, or when it does not work, the caller's kill loop does the job."""
    if h.v2:
        with contextlib.suppress(OSError):
            _write(os.path.join(cg_dir, "cgroup.kill"), "1")
            return
    if h.controller != "freezer":
        _kill(listed)
        return
    state = os.path.join(cg_dir, "freezer.state")
    try:
        _write(state, "FROZEN")
    except OSError:
        _kill(listed)
        return
    try:
        end = time.monotonic() + FREEZE_WAIT_S
        while _read(state) != "FROZEN" and time.monotonic() < end:
            time.sleep(0.001)
        _kill(pids(cg_dir))  # frozen: the list is complete; they die when thawed
    except FileNotFoundError:  # removed meanwhile (another remover was faster): nothing is left in it
        pass
    finally:
        with contextlib.suppress(OSError):
            _write(state, "THAWED")


def kill_tree(
    h: Hierarchy, cg_dir: str, deadline_s: float = KILL_DEADLINE_S, spare: tuple[int, ...] = ()
) -> int:
    """SIGKILL every process in ``cg_dir`` and below (but ``spare``) until none is left; returns how many
    distinct processes were found. Raises CgroupError when they are not all gone within ``deadline_s``."""
    end = time.monotonic() + deadline_s
    dirs = subtree(cg_dir)
    seen: set[int] = set()
    first = True
    while True:
        found = False
        for d in dirs:
            listed = [p for p in pids(d) if p not in spare]
            if not listed:
                continue
            found = True
            seen.update(listed)
            if first and not set(spare) & set(pids(d)):
                _kill_at_once(h, d, listed)
            else:
                _kill(listed)
        if not found:
            return len(seen)
        if time.monotonic() > end:
            raise CgroupError(errno.EBUSY, f"{cg_dir}: processes left after {deadline_s:.1f} s of SIGKILL")
        first = False
        time.sleep(0.002)


def remove_tree(
    h: Hierarchy, cg_dir: str, deadline_s: float = KILL_DEADLINE_S, spare: tuple[int, ...] = ()
) -> int:
    """Kill what is in ``cg_dir`` (and below) and remove it all; returns the processes found. Raises
    CgroupError when it cannot be removed in time."""
    end = time.monotonic() + deadline_s
    killed = kill_tree(h, cg_dir, deadline_s, spare)
    for d in subtree(cg_dir):
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as exc:  # EBUSY: a process came in (or is still on its way out)
                if time.monotonic() > end:
                    raise CgroupError(exc.errno, f"cannot remove {d}: {exc.strerror}") from exc
                killed += kill_tree(h, d, max(0.0, end - time.monotonic()), spare)
                time.sleep(0.002)
    return killed


# ---------------------------------------------------------------- one agent's action cgroups



def probe_join(files: list[str], where: str) -> None:
    """A short-lived shell moves itself into each of ``files`` (cgroup.procs or tasks files; the caller
    stays put); CgroupError(EACCES) naming ``where`` when it cannot."""
    res = subprocess.run(
        ["/bin/sh", "-c", 'for f; do echo 0 > "$f" || exit 1; done', "probe", *files],
        capture_output=True,
        timeout=10,
        check=False,
    )
    if res.returncode != 0:
        msg = res.stderr.decode(errors="replace").strip() or f"exit {res.returncode}"
        raise CgroupError(errno.EACCES, f"cannot move a process into {where}: {msg}")

class ActionCgroups:
    """The action cgroups of one executor (an incarnation, see the module doc)."""

    def __init__(self, h: Hierarchy, cluster: str, node: str) -> None:
        self.h = h
        self.node = node_dir(h, cluster, node)
        self.name = new_incarnation_name()
        self.dir = os.path.join(self.node, self.name)
        self.spawner = os.path.join(self.dir, SPAWNER)
        self._free: list[str] = []
        self._next = 0
        if not os.path.isdir(h.path):
            raise CgroupError(errno.ENOENT, f"{h.path} is not mounted")
        for attempt in range(3):  # another agent's close may remove an empty parent meanwhile
            try:
                os.makedirs(self.spawner, exist_ok=True)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise

    @classmethod
    def open(cls, cluster: str, node: str, h: Hierarchy | None = None) -> ActionCgroups | None:
        """Action cgroups in ``h`` (default: ``discover``), or None (logged) where they cannot be made."""
        try:
            h = h or discover()
            if h is None:
                log.warning(
                    "no cgroup hierarchy is mounted: actions are not put in cgroups, and a restarted "
                    "agent cannot find what an earlier one left running"
                )
                return None
            cg = cls(h, cluster, node)
            cg.probe()
        except OSError as exc:
            where = h.label if h is not None else "cgroupfs"
            log.warning(
                "cannot use action cgroups in %s (%s): actions are not put in cgroups, and a "
                "restarted agent cannot find what an earlier one left running",
                where,
                exc,
            )
            return None
        log.info("action cgroups: %s, under %s", h.label, cg.dir)
        return cg

    def probe(self) -> None:
        """Can a process move into a cgroup here? A short-lived shell tries (the agent itself stays put)."""
        d = self.take()
        try:
            if not os.path.exists(procs_file(d)):
                raise CgroupError(errno.ENOTSUP, f"{self.h.path} is not a cgroup file system")
            probe_join([join_file(self.h, d)], d)
        finally:
            remove_tree(self.h, d)

    def take(self) -> str:
        """An empty cgroup for one action: a free slot, or a new one."""
        if self._free:
            return self._free.pop()
        while True:
            d = os.path.join(self.dir, f"{SLOT_PREFIX}{self._next}")
            self._next += 1
            try:
                os.mkdir(d)
                return d
            except FileExistsError:  # (not made by this incarnation: leave it to close)
                continue

    def give_back(self, cg_dir: str) -> bool:
        """The cheap end of an action: when nothing is left in its cgroup, keep it for the next one (beyond
        ``POOL_MAX`` free ones, remove it). False: processes are left; call ``remove`` (blocking) then."""
        if pids(cg_dir):
            return False
        if len(self._free) < POOL_MAX:
            self._free.append(cg_dir)
            return True
        try:
            os.rmdir(cg_dir)
        except FileNotFoundError:
            pass
        except OSError:  # something came in meanwhile
            return False
        return True

    def remove(self, cg_dir: str, spare: tuple[int, ...] = ()) -> int:
        """Kill everything in ``cg_dir`` (but ``spare``) and remove it; returns the processes found."""
        return remove_tree(self.h, cg_dir, KILL_DEADLINE_S, spare)

    def close(self) -> None:
        """Kill whatever is left of this incarnation and remove its cgroups (the spawner must be gone)."""
        self._free.clear()
        try:
            left = remove_tree(self.h, self.dir)
        except OSError as exc:
            log.warning("cannot remove %s: %s", self.dir, exc)
            return
        if left:
            log.info("killed %d processes left in %s", left, self.dir)
        for parent in (self.node, os.path.dirname(self.node)):  # tidy: empty node and cluster cgroups
            try:
                os.rmdir(parent)
            except OSError:  # not empty (another incarnation, node or cluster), or gone
                break

    def reap_predecessors(self) -> Reaped:
        """Kill and remove what earlier agents of this node left (see the module doc)."""
        return reap_node(self.h, self.node, own=self.name)


def reap_node(h: Hierarchy, node: str, own: str = "") -> Reaped:
    """Every incarnation under ``node`` (a ``node_dir``) but ``own`` whose agent is gone: kill its processes,
    remove its cgroups. Incarnations of live agents are counted in ``skipped`` and left alone."""
    out = Reaped()
    try:
        entries = sorted(e.name for e in os.scandir(node) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return out
    for name in entries:
        if name == own:
            continue
        who = parse_incarnation(name)
        if who is not None and who[0] != os.getpid() and proc_start(who[0]) == who[1]:
            out.skipped += 1
            log.warning("cgroups of another live agent of this node (pid %d) in %s: left alone", who[0], node)
            continue
        if who is not None and who[0] == os.getpid() and proc_start(who[0]) == who[1]:
            continue  # another executor of this very process
        path = os.path.join(node, name)
        out.incarnations += 1
        out.cgroups += sum(1 for d in subtree(path) if pids(d))
        try:
            out.processes += remove_tree(h, path)
        except OSError as exc:
            log.error("cannot clean %s up: %s", path, exc)
    for parent in (node, os.path.dirname(node)):  # tidy: a node (then cluster) with nothing left
        try:
            os.rmdir(parent)
        except OSError:
            break
    return out
