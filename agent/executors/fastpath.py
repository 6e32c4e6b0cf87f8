"""Fast path into a running container: cgroup files and an nsenter argv, no dockerd round trip.

The builders (``parse_*``, ``cgroup_dirs``, ``nsenter_argv``) are pure. The few functions that touch
cgroupfs (``write_cpuset``, ``make_action_cgroup``, ``kill_cgroup``, ``remove_cgroup``) are small and
synchronous (each is well under a millisecond); callers run them inline.

An action on the fast path lives in its own sub-cgroup of the container's cpuset cgroup (v1) or unified
cgroup (v2): a slot ``tangram-slot-N`` of the container's ``SlotPool``, reused by later actions. On v1 the
slot carries exactly the granted cores, and on both it is how the whole process tree is found and killed,
including ``setsid`` daemons.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field

SUB_PREFIX = "tangram-slot-"

# The wrapper joins every cgroup named before "--" and then execs the rest of its argv.
JOIN_SCRIPT = 'p=$$; while [ "$1" != -- ]; do echo "$p" > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class CgroupMount:
    root: str  # the mount's root inside the hierarchy (mountinfo field 4)
    path: str  # mount point
    controllers: frozenset[str]  # super options (controllers, name=...); empty for cgroup2


def parse_mountinfo(text: str) -> list[CgroupMount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
            continue
        if rfields[0] == "cgroup2":
            ctrls: frozenset[str] = frozenset()
        else:
            ctrls = frozenset(o for o in rfields[2].split(",") if o not in ("rw", "ro"))
        mounts.append(CgroupMount(fields[3], fields[4], ctrls))
    return mounts


def parse_proc_cgroup(text: str) -> dict[frozenset[str], str]:
    """/proc/<pid>/cgroup -> {controllers: path}; the v2 line ("0::/x") has an empty key."""
    out: dict[frozenset[str], str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[frozenset(c for c in parts[1].split(",") if c)] = parts[2]
    return out


def cgroup_dirs(proc_cgroup: dict[frozenset[str], str], mounts: list[CgroupMount]) -> dict[frozenset[str], str]:
    """Absolute cgroupfs directories of a process, keyed by hierarchy controllers."""
    out: dict[frozenset[str], str] = {}
    for ctrls, path in proc_cgroup.items():
        for m in mounts:
            if _same_hierarchy(ctrls, m.controllers) and (path == m.root or path.startswith(m.root.rstrip("/") + "/")):
                rel = path[len(m.root.rstrip("/")):].lstrip("/")
                out[ctrls] = os.path.join(m.path, rel) if rel else m.path
                break
    return out


def _same_hierarchy(ctrls: frozenset[str], opts: frozenset[str]) -> bool:
    return ctrls <= opts if ctrls else not opts


@dataclass(frozen=True)
class ContainerCgroups:
    cpuset: str  # directory holding cpuset.cpus (v1 cpuset hierarchy, or the v2 cgroup)
    others: tuple[str, ...]  # other hierarchies the action must join (memory, pids, ..., unified)
    v2: bool


def container_cgroups(dirs: dict[frozenset[str], str]) -> ContainerCgroups | None:
    cpuset = next((d for c, d in dirs.items() if "cpuset" in c), None)
    if cpuset is not None:
        others = tuple(sorted(d for c, d in dirs.items() if "cpuset" not in c))
        return ContainerCgroups(cpuset, others, v2=False)
    if frozenset() in dirs:
        return ContainerCgroups(dirs[frozenset()], (), v2=True)
    return None


def discover(pid: int) -> ContainerCgroups | None:
    with open(f"/proc/{pid}/cgroup") as f:
        proc = parse_proc_cgroup(f.read())
    with open("/proc/self/mountinfo") as f:
        mounts = parse_mountinfo(f.read())
    return container_cgroups(cgroup_dirs(proc, mounts))


SETPRIV_FULL = ("setpriv", "--nnp", "--bounding-set=-all", "--inh-caps=-all")  # util-linux
SETPRIV_NNP = ("setpriv", "--nnp")  # busybox's applet knows no bounding set


def nsenter_argv(
    pid: int,
    join: list[str],
    cmd: str,
    uid_gid: tuple[int, int] | None = None,
    setpriv: tuple[str, ...] = (),
    shell: str = "/bin/sh",
) -> list[str]:
    """Argv that joins ``join`` (cgroup.procs files), enters the namespaces of ``pid`` and runs ``cmd``
    with ``sh -c``. Root and working directory are the target's own (``-r -w``), never host paths:
    ``--wd=DIR`` would open DIR on the host before entering. ``setpriv`` (the container's own binary)
    goes in front of the shell to set no_new_privs and, where it can, clear the bounding set."""
    argv = ["/bin/sh", "-c", JOIN_SCRIPT, "tangram-join", *join, "--"]
    argv += ["nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "-r", "-w"]
    if uid_gid is not None:
        argv += ["-S", str(uid_gid[0]), "-G", str(uid_gid[1])]
    return [*argv, "--", *setpriv, shell, "-c", cmd]


# ---------------------------------------------------------------- cgroupfs effects


def _write(path: str, text: str) -> None:
    # Raw descriptors: a text-mode open() costs four more system calls (fstat, ioctl, two lseeks).
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode().strip()


class CgroupFile:
    """One cgroup control file kept open for writing (a ``cpuset.cpus``, written twice per action): a
    write costs one system call instead of open, write and close with a walk of the path. A failed
    write reopens the file and tries once more (its cgroup may have been removed and made again:
    ENODEV), then raises. ``close`` when the cgroup goes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def write(self, text: str) -> None:
        data = text.encode()
        for last in (False, True):
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(self.fd, data)
                return
            except OSError:
                self.close()
                if last:
                    raise

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def read_cpuset(cg_dir: str) -> str:
    return _read(os.path.join(cg_dir, "cpuset.cpus"))


@dataclass
class SlotPool:
    """The action sub-cgroups of one container, kept between actions: re-setting a slot's ``cpuset.cpus``
    costs a sixth of creating (``mkdir``, ``cpuset.mems``, ``cpuset.cpus``) and removing one. A slot is
    in use by one action at a time; a free one has no tasks and (v1) an empty cpuset, so it never stands
    in the way of narrowing the container's own cpuset."""

    cg: ContainerCgroups
    free: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    files: dict[str, CgroupFile] = field(default_factory=dict)  # cgroup dir -> its cpuset.cpus, kept open
    closed: bool = False  # remove_all ran: writes no longer keep files open

    def set_cpus(self, cpus: str) -> None:
        """The container's ``cpuset.cpus`` := ``cpus``; OSError when the kernel refuses it. (The write's
        success is the answer: v1 reads back what it took, v2 what was asked for, not what is in effect.)"""
        self._set(self.cg.cpuset, cpus)

    def take(self, cpus: str) -> str:
        """A slot with exactly ``cpus`` (v1). Returns its directory."""
        sub = self.free.pop() if self.free else self._new()
        try:
            if not self.cg.v2:
                self._set(sub, cpus)
        except OSError:
            self.give_back(sub)
            raise
        return sub

    def _set(self, cg_dir: str, cpus: str) -> None:
        """``cg_dir``'s ``cpuset.cpus`` := ``cpus`` through a file kept open; once the pool is closed, a
        write that comes late (an action ending after its sandbox's destroy began) keeps nothing open."""
        if self.closed:
            _write(os.path.join(cg_dir, "cpuset.cpus"), cpus)
            return
        f = self.files.get(cg_dir)
        if f is None:
            f = self.files[cg_dir] = CgroupFile(os.path.join(cg_dir, "cpuset.cpus"))
        f.write(cpus)

    def _new(self) -> str:
        n = 0
        while f"{SUB_PREFIX}{n}" in self.names:
            n += 1
        sub = os.path.join(self.cg.cpuset, f"{SUB_PREFIX}{n}")
        try:
            os.mkdir(sub)
        except FileExistsError:  # left by an earlier agent: empty it and take it over
            kill_cgroup(sub, 1.0)
        if not self.cg.v2:
            _write(os.path.join(sub, "cpuset.mems"), _read(os.path.join(self.cg.cpuset, "cpuset.mems")))
        self.names.add(f"{SUB_PREFIX}{n}")
        return sub

    def give_back(self, sub: str) -> bool:
        """Return an emptied slot to the pool (v1: empty its cpuset); False when it could not be (still
        busy): then it is dropped from the pool and the caller removes it with ``remove_cgroup``."""
        try:
            if not self.cg.v2:
                self._set(sub, "\n")  # empty (a 0-byte write would not reach it)
        except OSError:
            self.names.discard(os.path.basename(sub))
            self._close(sub)
            return False
        self.free.append(sub)
        return True

    def _close(self, sub: str) -> None:
        f = self.files.pop(sub, None)
        if f is not None:
            f.close()

    def remove_all(self) -> None:
        """Remove the free slots (before the container goes; runc would remove them too) and close the
        files kept open; the pool keeps no file open after this."""
        self.closed = True
        for sub in self.free:
            self._close(sub)
            with contextlib.suppress(OSError):
                os.rmdir(sub)
            self.names.discard(os.path.basename(sub))
        self.free.clear()
        for f in self.files.values():
            f.close()
        self.files.clear()


def procs_file(cg_dir: str) -> str:
    return os.path.join(cg_dir, "cgroup.procs")


def join_file(cg_dir: str, v2: bool) -> str:
    """Where the (single-threaded) spawner writes ``0`` to move itself: v1 ``tasks``, which skips the
    kernel's global threadgroup lock (see ``cgroups.join_file``), v2 ``cgroup.procs``."""
    return os.path.join(cg_dir, "cgroup.procs" if v2 else "tasks")


def cgroup_pids(cg_dir: str) -> list[int]:
    try:
        return [int(x) for x in _read(procs_file(cg_dir)).split()]
    except FileNotFoundError:
        return []


def kill_cgroup_once(cg_dir: str, spare: tuple[int, ...] = ()) -> bool:
    """One pass: SIGKILL what is in the cgroup (but ``spare``); True when it was already empty."""
    pids = [p for p in cgroup_pids(cg_dir) if p not in spare]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not pids


def kill_cgroup(cg_dir: str, deadline_s: float = 5.0, spare: tuple[int, ...] = ()) -> bool:
    """SIGKILL every process in the cgroup (but ``spare``) until it is empty; True when it emptied in time."""
    end = time.monotonic() + deadline_s
    while True:
        pids = [p for p in cgroup_pids(cg_dir) if p not in spare]
        if not pids:
            return True
        if time.monotonic() > end:
            return False
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


def remove_cgroup(cg_dir: str) -> None:
    for _ in range(200):
        try:
            os.rmdir(cg_dir)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last task is still exiting
            kill_cgroup(cg_dir, 0.05)
            time.sleep(0.005)
