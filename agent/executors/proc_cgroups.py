"""Sandbox cgroups of the contained process executor: a sandbox's limits, and a slot per action.

Four roles, each played by one cgroup hierarchy (``Roles``, chosen by ``pick_roles`` from the mounts):

* ``kill``: where every process of an action is found and killed at once when the action ends (v1
  ``freezer``: freeze, SIGKILL, thaw; cgroup2: ``cgroup.kill``; else v1 ``pids``: a kill loop). The same
  choice as ``cgroups.pick_hierarchy``.
* ``cpuset``: the action's cores (``cpuset.cpus`` of its slot). Sandbox code may call ``sched_setaffinity``
  on its own processes (no privilege needed), but never beyond its cpuset.
* ``memory``: the sandbox's memory, all its actions together (v1 ``memory.limit_in_bytes`` and, with swap
  accounting, ``memory.memsw.limit_in_bytes``; v2 ``memory.max`` and ``memory.swap.max`` 0). Past it the
  kernel's OOM killer kills in the sandbox.
* ``pids``: the sandbox's number of tasks (``pids.max``), so a fork bomb stays inside.

Layout, in every hierarchy the roles use (``Roles.hierarchies``, the kill hierarchy first)::

    <mount>/tangram/<cluster>/<node>/agent-<pid>-<start>-<n>/   one per executor ("incarnation", see cgroups)
        spawner/                  the spawners' memory home (v1), their home (v2)
        sb-<sandbox>/             the sandbox's limits; on v1 its spawner's freezer, cpuset and pids home
            slot-<k>/             one per running action (kill and cpuset hierarchies), reused by later ones

An action is in its slot (kill and cpuset hierarchies) and in its sandbox's cgroup (memory, pids). Each
sandbox has a spawner, which per action moves into those (``request_joins``) and back to its home
(``spawner_cgroups``): on cgroup v1 three ``tasks`` files (freezer and cpuset slot, memory; it counts
against the sandbox's pids for good); on cgroup v2 the four roles are one hierarchy (the cpuset, memory and
pids controllers enabled in ``cgroup.subtree_control`` from the mount down to the incarnation, and cpuset in
each sandbox for its slots) and one ``cgroup.procs``. Its memory home is never the sandbox's: a sandbox full
of small processes must not have its OOM killer pick the spawner. On v2 processes only ever sit in leaves
(``spawner``, slots), so the rule "no processes in a cgroup that enables controllers" always holds.

Everything here is synchronous; the file system calls go through ``CgroupFs`` so that the writes can be
checked against a directory tree that mimics cgroupfs (tests/security/test_process_sandbox.py). Killing and
removing use ``cgroups`` (real cgroupfs and /proc only). ``pick_roles`` is pure.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from .base import format_cpuset
from .cgroups import (
    KILL_DEADLINE_S,
    SLOT_PREFIX,
    SPAWNER,
    CgroupError,
    Hierarchy,
    Reaped,
    join_file,
    new_incarnation_name,
    node_dir,
    pick_hierarchy,
    pids,
    probe_join,
    procs_file,
    reap_node,
    remove_tree,
)
from .fastpath import CgroupMount, _read, _write, parse_mountinfo

SANDBOX_PREFIX = "sb-"
LIMITS = ("cpuset", "memory", "pids")
SLOTS_PER_SANDBOX = 8  # free slots kept per sandbox; more are removed
# A sandbox whose free slots all have other cpus gets a new slot while it has fewer free ones than this,
# instead of re-setting one's cpuset.cpus: actions that come back to the same cores (one sandbox's actions
# alternating between two cores, say) then find their slot ready, and a cpuset write leaves the action path.
SLOT_SHAPES = 4
log = logging.getLogger("agent.executors.proc_cgroups")


@dataclass(frozen=True)
class Roles:
    kill: Hierarchy
    cpuset: Hierarchy
    memory: Hierarchy
    pids: Hierarchy

    def hierarchies(self) -> list[Hierarchy]:
        """The distinct hierarchies, the kill hierarchy first."""
        out: list[Hierarchy] = []
        for h in (self.kill, self.cpuset, self.memory, self.pids):
            if h not in out:
                out.append(h)
        return out

    def slot_level(self, h: Hierarchy) -> bool:
        """Whether an action joins its own slot in ``h`` (kill, cpuset) or its sandbox's cgroup."""
        return h in (self.kill, self.cpuset)

    def v2_controllers(self, h: Hierarchy) -> list[str]:
        """The controllers a cgroup2 hierarchy must enable for the roles it plays."""
        return [c for c in LIMITS if getattr(self, c) == h] if h.v2 else []

    @property
    def label(self) -> str:
        return ", ".join(f"{role}: {getattr(self, role).label}" for role in ("kill", *LIMITS))


# ---------------------------------------------------------------- pure


def pick_roles(
    mounts: list[CgroupMount], v2_controllers: dict[str, Iterable[str]], kill: Hierarchy | None = None
) -> tuple[Roles | None, list[str]]:
    """The hierarchy of each role: ``kill`` as given or ``cgroups.pick_hierarchy``; each limit from its v1
    mount, else from a cgroup2 mount whose root offers that controller (``v2_controllers``: mount path ->
    the words of its ``cgroup.controllers``). Returns (Roles, []) or (None, what is missing)."""
    missing = []
    kill = kill or pick_hierarchy(mounts)
    if kill is None:
        missing.append(
            "no cgroup hierarchy to find and kill every process of an action "
            "(a v1 freezer or pids mount, or cgroup2)"
        )
    found: dict[str, Hierarchy] = {}
    for ctrl in LIMITS:
        v1 = [m for m in mounts if ctrl in m.controllers]
        h = Hierarchy(v1[0].path, v2=False, controller=ctrl) if v1 else None
        if h is None:
            v2 = [m for m in mounts if not m.controllers and ctrl in set(v2_controllers.get(m.path, ()))]
            v2.sort(key=lambda m: m.path != "/sys/fs/cgroup")
            h = Hierarchy(v2[0].path, v2=True) if v2 else None
        if h is None:
            missing.append(f"no {ctrl} cgroup controller (neither a v1 {ctrl} mount nor {ctrl} in cgroup2)")
        else:
            found[ctrl] = h
    if missing or kill is None:
        return None, missing
    return Roles(kill, found["cpuset"], found["memory"], found["pids"]), []


def parse_oom_kills(text: str) -> int:
    """The ``oom_kill N`` line of ``memory.events`` (v2) or ``memory.oom_control`` (v1); 0 without one."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


# ---------------------------------------------------------------- cgroupfs


class CgroupFs:
    """The few file system calls of the setup (a test replaces them with a mimic of cgroupfs)."""

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def write(self, path: str, text: str) -> None:
        _write(path, text)

    def read(self, path: str) -> str:
        return _read(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


def enable_controllers(fs: CgroupFs, path: str, ctrls: list[str]) -> None:
    """cgroup2: enable ``ctrls`` for the children of ``path`` in one write (those already enabled are left
    alone, and nothing is written when all are)."""
    if not ctrls:
        return
    control = os.path.join(path, "cgroup.subtree_control")
    have = set(fs.read(control).split())
    need = [c for c in ctrls if c not in have]
    if need:
        fs.write(control, " ".join(f"+{c}" for c in need))


def discover_roles(kill: Hierarchy | None = None) -> tuple[Roles | None, list[str]]:
    """``pick_roles`` for this host (``/proc/self/mountinfo`` and each cgroup2 root's controllers)."""
    with open("/proc/self/mountinfo") as f:
        mounts = parse_mountinfo(f.read())
    offered: dict[str, list[str]] = {}
    for m in mounts:
        if not m.controllers:
            try:
                offered[m.path] = _read(os.path.join(m.path, "cgroup.controllers")).split()
            except OSError:
                offered[m.path] = []
    return pick_roles(mounts, offered, kill)


@dataclass
class Slot:
    """One action's cgroups: ``dirs`` in the slot-level hierarchies (the kill hierarchy's first), ``joins``
    their files to join (in that order), ``cpus`` its cpuset."""

    dirs: list[str]
    joins: list[str]
    cpus: str = ""


@dataclass
class SandboxGroup:
    name: str
    dirs: dict[Hierarchy, str]
    mem_mib: int = 0
    pids_max: int = 0
    free: list[Slot] = field(default_factory=list)
    next: int = 0
    oom_seen: int = 0
    gone: bool = False


class SandboxCgroups:
    """The sandbox cgroups of one executor (an incarnation: see the module doc)."""

    def __init__(self, roles: Roles, cluster: str, node: str, fs: CgroupFs | None = None) -> None:
        self.roles = roles
        self.fs = fs or CgroupFs()
        self.hs = roles.hierarchies()
        self.name = new_incarnation_name()
        self.nodes = {h: node_dir(h, cluster, node) for h in self.hs}
        self.dirs = {h: os.path.join(self.nodes[h], self.name) for h in self.hs}
        self.sandboxes: dict[str, SandboxGroup] = {}
        for h in self.hs:
            if not os.path.isdir(h.path):
                raise CgroupError(errno.ENOENT, f"{h.path} is not mounted")
            self._make_chain(h)
            if h.v2 or h == roles.memory:
                self._mkdir(h, os.path.join(self.dirs[h], SPAWNER))

    # ------------------------------------------------------------ setup

    def _mkdir(self, h: Hierarchy, path: str) -> None:
        """A cgroup (an existing one is fine); on v1 cpuset it gets its parent's cpus and mems when empty."""
        with contextlib.suppress(FileExistsError):
            self.fs.mkdir(path)
        if h == self.roles.cpuset and not h.v2:
            parent = os.path.dirname(path)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not self.fs.read(os.path.join(path, name)):
                    self.fs.write(os.path.join(path, name), self.fs.read(os.path.join(parent, name)))

    def _enable(self, path: str, ctrls: list[str]) -> None:
        enable_controllers(self.fs, path, ctrls)

    def _make_chain(self, h: Hierarchy) -> None:
        """The incarnation's cgroup in ``h``, every level from the mount down ready for its children."""
        ctrls = self.roles.v2_controllers(h)
        path = h.path
        self._enable(path, ctrls)
        for part in os.path.relpath(self.dirs[h], h.path).split(os.sep):
            path = os.path.join(path, part)
            self._mkdir(h, path)
            self._enable(path, ctrls)

    def sandbox(self, name: str, mem_mib: int, pids_max: int) -> SandboxGroup:
        """The cgroups of sandbox ``name`` (made on first use) with these limits."""
        sb = self.sandboxes.get(name)
        if sb is None:
            dirs = {h: os.path.join(self.dirs[h], f"{SANDBOX_PREFIX}{name}") for h in self.hs}
            for h in self.hs:
                self._mkdir(h, dirs[h])
                if h.v2 and h == self.roles.cpuset:
                    self._enable(dirs[h], ["cpuset"])  # for its slots
            sb = SandboxGroup(name, dirs)
            self.sandboxes[name] = sb
        if (sb.mem_mib, sb.pids_max) != (mem_mib, pids_max):
            self._set_limits(sb, mem_mib, pids_max)
        return sb

    def _set_limits(self, sb: SandboxGroup, mem_mib: int, pids_max: int) -> None:
        mem, value = self.roles.memory, str(mem_mib << 20)
        d = sb.dirs[mem]
        if mem.v2:
            self.fs.write(os.path.join(d, "memory.max"), value)
            swap = os.path.join(d, "memory.swap.max")
            if self.fs.exists(swap):
                self.fs.write(swap, "0")
        else:
            files = [os.path.join(d, "memory.limit_in_bytes")]
            memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
            if self.fs.exists(memsw):  # swap accounting on: memory + swap gets the same limit
                files.append(memsw)
            try:
                for path in files:
                    self.fs.write(path, value)
            except OSError as exc:  # a raised limit: memsw (which must stay >= the limit) first
                if exc.errno != errno.EINVAL:
                    raise
                for path in reversed(files):
                    self.fs.write(path, value)
        self.fs.write(os.path.join(sb.dirs[self.roles.pids], "pids.max"), str(pids_max))
        sb.mem_mib, sb.pids_max = mem_mib, pids_max

    # ------------------------------------------------------------ slots

    def take(self, sb: SandboxGroup, cores: Iterable[int]) -> Slot:
        """An empty slot of ``sb`` on exactly ``cores``: a free one with those cores if there is one, else
        a new one while ``sb`` has fewer than ``SLOT_SHAPES`` free, else a free one re-set to ``cores``."""
        cpus = format_cpuset(cores)
        for i in range(len(sb.free) - 1, -1, -1):
            if sb.free[i].cpus == cpus:
                return sb.free.pop(i)
        if len(sb.free) < SLOT_SHAPES:
            slot = self._new_slot(sb)
        else:
            slot = sb.free.pop()
        try:
            self.fs.write(os.path.join(slot.dirs[self._cpuset_index()], "cpuset.cpus"), cpus)
        except OSError:
            self.give_back(sb, slot)
            raise
        slot.cpus = cpus
        return slot

    def _cpuset_index(self) -> int:
        return [h for h in self.hs if self.roles.slot_level(h)].index(self.roles.cpuset)

    def _new_slot(self, sb: SandboxGroup) -> Slot:
        levels = [h for h in self.hs if self.roles.slot_level(h)]
        while True:
            name = f"{SLOT_PREFIX}{sb.next}"
            sb.next += 1
            dirs = [os.path.join(sb.dirs[h], name) for h in levels]
            if any(self.fs.exists(d) for d in dirs):
                continue
            for h, d in zip(levels, dirs, strict=True):
                self._mkdir(h, d)
            return Slot(dirs, [join_file(h, d) for h, d in zip(levels, dirs, strict=True)])

    def sandbox_joins(self, sb: SandboxGroup) -> list[str]:
        """The files to join the sandbox's own cgroups (memory and pids where they are not slot-level)."""
        return [join_file(h, sb.dirs[h]) for h in self.hs if not self.roles.slot_level(h)]

    def all_joins(self, sb: SandboxGroup, slot: Slot) -> list[str]:
        """Everything an action of ``sb`` in ``slot`` joins, for a process that is not yet in any of it."""
        return [*slot.joins, *self.sandbox_joins(sb)]

    def _moved(self, h: Hierarchy) -> bool:
        """Whether a spawner moves for each spawn in ``h``: the slot's hierarchies, and memory."""
        return self.roles.slot_level(h) or h == self.roles.memory

    def request_joins(self, sb: SandboxGroup, slot: Slot) -> list[str]:
        """What the sandbox's spawner joins for a spawn into ``slot`` (``spawner_cgroups`` order)."""
        return [
            *slot.joins,
            *(join_file(h, sb.dirs[h]) for h in self.hs if not self.roles.slot_level(h) and self._moved(h)),
        ]

    def spawner_cgroups(self, sb: SandboxGroup) -> tuple[list[str], list[str]]:
        """(home, join) of the sandbox's spawner: ``home`` where it comes back to after each spawn, in the
        order of ``request_joins``; ``join`` the sandbox's cgroups it just stays in (v1 pids)."""
        levels = [h for h in self.hs if self.roles.slot_level(h)] + [
            h for h in self.hs if not self.roles.slot_level(h) and self._moved(h)
        ]
        home = []
        for h in levels:
            d = os.path.join(self.dirs[h], SPAWNER) if h.v2 or h == self.roles.memory else sb.dirs[h]
            home.append(join_file(h, d))
        join = [join_file(h, sb.dirs[h]) for h in self.hs if not self._moved(h)]
        return home, join

    def give_back(self, sb: SandboxGroup, slot: Slot) -> bool:
        """The cheap end of an action: nothing left in its slot, keep it for the sandbox's next action
        (beyond ``SLOTS_PER_SANDBOX`` free ones, remove it). False: processes are left, call ``remove``."""
        if pids(slot.dirs[0]):
            return False
        if not sb.gone and len(sb.free) < SLOTS_PER_SANDBOX:
            sb.free.append(slot)
            return True
        for d in slot.dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:  # something came in meanwhile
                return False
        return True

    def remove(self, slot: Slot, spare: tuple[int, ...] = ()) -> int:
        """Kill everything in ``slot`` (but ``spare``) and remove it; returns the processes found."""
        levels = [h for h in self.hs if self.roles.slot_level(h)]
        found = 0
        for i, (h, d) in enumerate(zip(levels, slot.dirs, strict=True)):
            n = remove_tree(h, d, KILL_DEADLINE_S, spare)
            found = n if i == 0 else found
        return found

    def remove_sandbox(self, sb: SandboxGroup, spare: tuple[int, ...] = ()) -> int:
        """Kill every process of the sandbox and remove its cgroups; returns the processes found."""
        sb.gone = True
        sb.free.clear()
        if self.sandboxes.get(sb.name) is sb:
            del self.sandboxes[sb.name]
        found = 0
        for i, h in enumerate(self.hs):
            n = remove_tree(h, sb.dirs[h], KILL_DEADLINE_S, spare)
            found = n if i == 0 else found
        return found

    def oom_kills(self, sb: SandboxGroup) -> int:
        """How many processes the OOM killer has killed in the sandbox so far."""
        h = self.roles.memory
        name = "memory.events" if h.v2 else "memory.oom_control"
        try:
            return parse_oom_kills(self.fs.read(os.path.join(sb.dirs[h], name)))
        except OSError:
            return 0

    # ------------------------------------------------------------ the incarnation

    def probe(self, cores: Iterable[int]) -> None:
        """Can a process join a sandbox's cgroups with limits set? A short-lived shell tries."""
        sb = self.sandbox(".probe", 64, 16)
        try:
            slot = self.take(sb, cores)
            for d in (*slot.dirs, *sb.dirs.values()):
                if not self.fs.exists(procs_file(d)):
                    raise CgroupError(errno.ENOTSUP, f"{d} has no cgroup.procs: not a cgroup file system")
            probe_join(list(self.all_joins(sb, slot)), slot.dirs[0])
        finally:
            self.remove_sandbox(sb)

    def reap_predecessors(self) -> Reaped:
        """Kill and remove what earlier agents of this node left, in every hierarchy (see cgroups.reap_node);
        the counts are the kill hierarchy's."""
        out = Reaped()
        for i, h in enumerate(self.hs):
            found = reap_node(h, self.nodes[h], own=self.name)
            if i == 0:
                out = found
        return out

    def close(self) -> None:
        """Kill whatever is left of this incarnation and remove its cgroups (the spawners must be gone)."""
        self.sandboxes.clear()
        for h in self.hs:
            try:
                left = remove_tree(h, self.dirs[h])
            except OSError as exc:
                log.warning("cannot remove %s: %s", self.dirs[h], exc)
                continue
            if left:
                log.info("killed %d processes left in %s", left, self.dirs[h])
            for parent in (self.nodes[h], os.path.dirname(self.nodes[h])):  # tidy: empty node, cluster
                try:
                    os.rmdir(parent)
                except OSError:
                    break
