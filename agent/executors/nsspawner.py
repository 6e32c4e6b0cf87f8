"""The spawner: a small long-lived process that starts actions, so the agent never forks.

Run by the agent (``agent.executors.spawner``) as ``python -I -S nsspawner.py CONFIG`` with a
``SOCK_SEQPACKET`` socket as its stdin, one per Docker sandbox (``CONFIG["mode"]``: ``container``); standard
library only, because it is the *host's* Python (any image works, Python in the image or not). The serving
loop and protocol are ``spawnloop.py``'s (shared with ``proc_spawner.py``). At start, while still root in
the host's mount namespace, it

1. takes a pidfd of the container's init and checks, through ``/proc/PID/cgroup``, that the pid is
   still that container's (``CONFIG["cid"]``); opens the init's root and working directory, and the
   ``cgroup.procs`` of the container's cpuset cgroup (``CONFIG["home"]``);
2. joins the container's cgroups (``CONFIG["join"]``: every hierarchy but cpuset, and ``home``), so the
   actions it starts are in them from the start (and its own work runs on the sandbox's cores);
3. enters the container's mount, UTS, IPC and network namespaces with one ``setns(pidfd)``; that call
   also makes the container's pid namespace the one for its children (the spawner itself stays
   outside it, so sandbox code can neither see nor signal it); chroots into the init's root, moves to
   its working directory, and switches off imports (nothing is read from the container's files as code);
4. gives up every privilege, for good: ``no_new_privs``, an empty capability bounding set, no
   capabilities at all, no supplementary groups, and the sandbox's uid/gid if it has one
   (``CONFIG["user"]``);
5. puts itself under the container's seccomp filters (Docker's default profile), copied from the
   container's init in step 1 (``PTRACE_SECCOMP_GET_FILTER``: the init is stopped for well under a
   millisecond), so the actions it starts are as filtered as a ``docker exec`` would be. Where they
   cannot be copied (a kernel without ``CONFIG_CHECKPOINT_RESTORE``, ptrace forbidden) it says so on
   stderr, which is the agent's, and goes on without.

Each request brings the ``cgroup.procs`` of the action's cpuset sub-cgroup: the spawner moves itself
into it for the ``posix_spawn`` and back to ``home`` after, so the command is in the sub-cgroup (exactly
the granted cores) from its first instruction, with the spawner's credentials (no capabilities,
``no_new_privs``).

Then it says ``{"ready": pid}`` and serves requests (``spawnloop``'s protocol: ``spawn`` with fds
``[stdin, stdout, stderr]`` and the action cgroup's ``cgroup.procs``; ``kill``, after which the agent kills
the rest of the tree through the cgroup) until the agent closes the socket or the container's init exits;
leaving, it kills the process groups of the actions still running.

The cgroup moves work without privileges because cgroup v1 and v2 check the credentials the
``cgroup.procs`` file was *opened* with (root: the agent, or the spawner before step 4). On v1 the per-action
files (the action's and ``home``) are ``tasks`` files instead: writing ``0`` there moves only the calling
thread, which is the whole spawner (it never starts a thread), without the kernel's global threadgroup
lock, whose write side waits for an RCU grace period after a quiet spell (~10 ms per move).

Security: only the agent holds the other end of the socket (inherited, no path on any file system), and the
spawner has nothing sandbox code does not have. Docker's seccomp filter applies to it and its actions (step
5); Docker's AppArmor profile does not (nor either of them on the ``nsenter`` fallback).
"""

import contextlib  # everything is imported up front: nothing may be imported after the chroot
import ctypes
import errno
import importlib.machinery
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I: this directory is not on sys.path
try:
    import spawnloop  # the serving loop and helpers, shared with proc_spawner.py
finally:
    del sys.path[0]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = (
    0x00020000,
    0x04000000,
    0x08000000,
    0x40000000,
    0x20000000,
)
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_SECCOMP_GET_FILTER = 17, 0x4206, 0x4207, 0x420C
WALL = 0x40000000
MAX_FILTERS = 64

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def setup(cfg):
    """Container mode, steps 1-4 of the module doc: (the container init's pidfd, its cpuset cgroup.procs)."""
    pid = int(cfg["pid"])
    pidfd = os.pidfd_open(pid)
    with open(f"/proc/{pid}/cgroup") as f:
        if cfg["cid"] not in f.read():
            raise RuntimeError(f"pid {pid} is not the init of container {cfg['cid'][:12]}")
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    cwd = os.open(f"/proc/{pid}/cwd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    home = os.open(cfg["home"], os.O_WRONLY | os.O_CLOEXEC)
    cap_last = spawnloop.last_cap()
    try:
        filters = copy_seccomp(pid)
    except OSError as exc:
        filters = []
        warn(
            f"cannot copy the seccomp filters of container {cfg['cid'][:12]} ({exc}): its actions run "
            "without them"
        )
    for path in cfg["join"]:
        with open(path, "w") as f:
            f.write("0")
    os.write(home, b"0")
    spawnloop.check(
        libc.setns(pidfd, CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID), "setns"
    )
    os.fchdir(root)
    os.chroot(".")
    os.fchdir(cwd)
    os.close(root)
    os.close(cwd)
    no_more_imports()
    spawnloop.drop_privileges(cfg.get("user"), cap_last)
    for prog in filters:  # oldest first, as they were installed
        install_seccomp(prog)
    return pidfd, home


def warn(text):
    with contextlib.suppress(OSError):
        os.write(2, f"tangram-spawner: {text}\n".encode())


def has_seccomp(pid):
    with open(f"/proc/{pid}/status") as f:
        return any(line.split() == ["Seccomp:", "2"] for line in f)


def copy_seccomp(pid):
    """The seccomp filters of ``pid`` (a container's init: Docker's profile), oldest first; [] without any.
    ``pid`` is stopped (``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT``) while they are read, then let go."""
    if not has_seccomp(pid):
        return []
    if libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace: {os.strerror(err)}")
    try:
        libc.ptrace(PTRACE_INTERRUPT, pid, None, None)
        os.waitpid(pid, WALL)
        progs = []
        for index in range(MAX_FILTERS):  # index 0: the newest
            n = libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, index, None)
            if n <= 0:
                err = ctypes.get_errno()
                if n < 0 and err != errno.ENOENT:
                    raise OSError(err, f"PTRACE_SECCOMP_GET_FILTER: {os.strerror(err)}")
                break
            buf = ctypes.create_string_buffer(n * 8)
            got = libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, index, ctypes.addressof(buf))
            if got != n:
                raise OSError(errno.EIO, "PTRACE_SECCOMP_GET_FILTER changed its answer")
            progs.append(buf.raw)
    finally:
        libc.ptrace(PTRACE_DETACH, pid, None, None)
    if not progs:
        raise OSError(errno.ENOENT, "no seccomp filter found, though the process has some")
    return progs[::-1]


def install_seccomp(prog):
    """Add one classic-BPF seccomp filter (``no_new_privs`` is set: no privilege needed)."""
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    spawnloop.check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def no_more_imports():
    """From here on the file system is the container's: keep Python from ever loading code from it."""
    sys.meta_path[:] = [f for f in sys.meta_path if f is not importlib.machinery.PathFinder]
    sys.path[:] = []
    sys.path_hooks[:] = []
    sys.path_importer_cache.clear()


class Server(spawnloop.Server):
    def __init__(self, sock, init_fd, home_fd):
        super().__init__(sock, [home_fd], (4,), stop_fd=init_fd)

    def prepare(self, req, fds):
        moved = len(fds) > 3
        if moved:
            os.write(fds[3], b"0")  # into the action's sub-cgroup: the child starts there
        return moved


def make_server(sock, cfg):
    if cfg.get("mode") != "container":
        raise ValueError(f"unknown mode {cfg.get('mode')!r}: nsspawner.py runs container mode only")
    return Server(sock, *setup(cfg))


if __name__ == "__main__":
    spawnloop.run(make_server)
