"""The spawner: a small long-lived process that starts actions, so the agent never forks.

Run by the agent (``agent.executors.spawner``) as ``python -I -S nsspawner.py CONFIG`` with a
``SOCK_SEQPACKET`` socket as its stdin; standard library only, because it is the *host's* Python (any image
works, Python in the image or not). Two modes (``CONFIG["mode"]``):

* ``plain`` (the process executor, one per agent): each request names the action's working directory and
  cores; the spawner (single-threaded, so both are its own to change) moves there and pins itself to the
  cores, then ``posix_spawn``s the command, which inherits both (pinned from its first instruction). With
  action cgroups (``CONFIG["home"]``: the ``cgroup.procs`` of the spawner's own cgroup, joined at start),
  a request may bring the ``cgroup.procs`` of the action's cgroup: the spawner moves itself in for the
  ``posix_spawn`` and back home after, as in container mode, so the action cannot start outside it.
* ``container`` (the Docker fast path, one per sandbox). At start, while still root in the host's mount
  namespace, it

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

Then it says ``{"ready": pid}`` and serves until the agent closes the socket (or, ``container``, the
container's init exits); leaving, it kills the process groups of the actions still running. Requests (JSON,
one per datagram):

* ``{"op": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": DIR, "cores": [...]}`` (``cwd`` and
  ``cores``: plain mode) with fds ``[stdin, stdout, stderr]`` (+ the action cgroup's ``cgroup.procs``:
  container mode always, plain mode with a ``home``): ``posix_spawn`` (vfork: no page-table copy) in a new
  session, with those stdio, default signal dispositions and an empty mask. Replies ``{"id": N, "exit":
  code}`` (-N: killed by signal N) once it exited, *after* SIGKILLing what is left of its process group, or
  ``{"id": N, "error": "..."}`` when it could not start.
* ``{"op": "kill", "id": N}``: SIGKILL the action's process group (with a cgroup, the agent kills the rest
  of the tree through it when the action ends). No reply. The spawner is the parent: the pid cannot have
  been reused.

The cgroup moves work without privileges because cgroup v1 and v2 check the credentials the
``cgroup.procs`` file was *opened* with (root: the agent, or the spawner before step 4). On v1 the per-action
files (the action's and ``home``) are ``tasks`` files instead: writing ``0`` there moves only the calling
thread, which is the whole spawner (it never starts a thread), without the kernel's global threadgroup
lock, whose write side waits for an RCU grace period after a quiet spell (~10 ms per move).

Security: only the agent holds the other end of the socket (inherited, no path on any file system), and the
spawner has nothing sandbox code does not have. Docker's seccomp filter applies to it and its actions (step
5); Docker's AppArmor profile does not (nor either of them on the ``nsenter`` fallback).
"""
import array
import contextlib  # everything is imported up front: nothing may be imported after the chroot
import ctypes
import errno
import importlib.machinery
import json
import os
import select
import signal
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = (
    0x00020000, 0x04000000, 0x08000000, 0x40000000, 0x20000000)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_SECCOMP_GET_FILTER = 17, 0x4206, 0x4207, 0x420C
WALL = 0x40000000
MAX_FILTERS = 64
CAP_VERSION_3 = 0x20080522
MAX_MSG = 4 << 20
SOCK_FD = 0

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


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
    with open("/proc/sys/kernel/cap_last_cap") as f:
        cap_last = int(f.read())
    try:
        filters = copy_seccomp(pid)
    except OSError as exc:
        filters = []
        warn(f"cannot copy the seccomp filters of container {cfg['cid'][:12]} ({exc}): its actions run "
             "without them")
    for path in cfg["join"]:
        with open(path, "w") as f:
            f.write("0")
    os.write(home, b"0")
    check(libc.setns(pidfd, CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID), "setns")
    os.fchdir(root)
    os.chroot(".")
    os.fchdir(cwd)
    os.close(root)
    os.close(cwd)
    no_more_imports()
    drop_privileges(cfg.get("user"), cap_last)
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
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def no_more_imports():
    """From here on the file system is the container's: keep Python from ever loading code from it."""
    sys.meta_path[:] = [f for f in sys.meta_path if f is not importlib.machinery.PathFinder]
    sys.path[:] = []
    sys.path_hooks[:] = []
    sys.path_importer_cache.clear()


def drop_privileges(user, cap_last):
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(cap_last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    os.setgroups([])
    if user is not None:
        os.setgid(int(user[1]))
        os.setuid(int(user[0]))  # clears every capability
    header, data = CapHeader(CAP_VERSION_3, 0), (CapData * 2)()  # all zero: nothing effective,
    check(libc.capset(ctypes.byref(header), data), "capset")  # permitted or inheritable, root or not


def plain_setup(cfg):
    """Plain mode: join the spawner's own cgroup (``CONFIG["home"]``) when there is one; its fd or None."""
    if not cfg.get("home"):
        return None
    home = os.open(cfg["home"], os.O_WRONLY | os.O_CLOEXEC)
    os.write(home, b"0")
    return home


class Server:
    def __init__(self, sock, init_fd=None, home_fd=None, plain=False):
        self.sock, self.init_fd, self.home_fd, self.plain = sock, init_fd, home_fd, plain
        self.poll = select.epoll()
        self.poll.register(sock.fileno(), select.EPOLLIN)
        if init_fd is not None:
            self.poll.register(init_fd, select.EPOLLIN)
        self.nfds = (3,) if home_fd is None else (3, 4) if plain else (4,)
        self.children = {}  # pidfd -> (request id, pid)
        self.by_id = {}  # request id -> pid, until reaped
        self.sigdef = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)  # Python ignores (or handles) these

    def send(self, msg):
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError:
            raise SystemExit(0) from None  # the agent is gone

    def serve(self):
        try:
            while True:
                for fd, _ in self.poll.poll():
                    if fd == self.init_fd:
                        raise SystemExit(0)  # the container stopped
                    if fd == self.sock.fileno():
                        self.receive()
                    else:
                        self.reap(fd)
        finally:
            for pid in self.by_id.values():  # nobody is left to report to: the actions end with us
                kill_group(pid)

    def receive(self):
        try:  # received descriptors are close-on-exec: an action gets only its own stdio
            data, fds = recv_fds(self.sock)
        except BlockingIOError:
            return
        if not data:
            raise SystemExit(0)
        try:
            req = json.loads(data)
            if req.get("op") == "spawn":
                self.spawn(req, fds)
            elif req.get("op") == "kill" and req.get("id") in self.by_id:
                kill_group(self.by_id[req["id"]])
        finally:
            for fd in fds:
                os.close(fd)

    def spawn(self, req, fds):
        if len(fds) not in self.nfds:
            self.send({"id": req.get("id"), "error": f"expected {self.nfds} descriptors, got {len(fds)}"})
            return
        try:
            pid = self.start(req, fds)
        except OSError as exc:
            self.send({"id": req["id"], "error": f"{req['argv'][0]}: {exc.strerror or exc}"})
            return
        if pid is None:
            return
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (req["id"], pid)
        self.by_id[req["id"]] = pid
        self.poll.register(pidfd, select.EPOLLIN)

    def start(self, req, fds):
        """Start the action; its pid, or None when its program cannot run (reported as a shell would)."""
        stdio = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds[:3])]
        if self.plain:  # where and on which cores, for the child to inherit
            os.chdir(req["cwd"])
            os.sched_setaffinity(0, req["cores"])
        moved = len(fds) > 3
        if moved:
            os.write(fds[3], b"0")  # into the action's (sub-)cgroup: the child starts there
        try:
            return os.posix_spawn(req["argv"][0], req["argv"], req["env"], setsid=True, file_actions=stdio,
                                  setsigdef=self.sigdef, setsigmask=())
        except (FileNotFoundError, PermissionError) as exc:  # no shell in the image: exit 127 / 126
            with contextlib.suppress(OSError):
                os.write(fds[2], f"tangram-spawner: {req['argv'][0]}: {exc.strerror}\n".encode())
            self.send({"id": req["id"], "exit": 127 if isinstance(exc, FileNotFoundError) else 126})
            return None
        finally:
            if moved:
                self.go_home()

    def go_home(self):
        """Back to the spawner's own cgroup after a spawn (stuck in the action's, it would die with it)."""
        try:
            os.write(self.home_fd, b"0")
        except OSError:
            raise SystemExit(1) from None  # the agent starts a new spawner

    def reap(self, pidfd):
        rid, pid = self.children.pop(pidfd)
        self.poll.unregister(pidfd)
        os.close(pidfd)
        kill_group(pid)  # what the action left behind goes with it (the zombie still holds the group)
        del self.by_id[rid]
        _, status = os.waitpid(pid, 0)
        self.send({"id": rid, "exit": os.waitstatus_to_exitcode(status)})


def recv_fds(sock, maxfds=8):
    """``socket.recv_fds`` without its flaw (3.11 drops the flags: descriptors would be inheritable)."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_LEN(maxfds * fds.itemsize),
                                       socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def kill_group(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def main():
    cfg = json.loads(sys.argv[1])
    sock = socket.socket(fileno=SOCK_FD)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent's terminal ^C is for the agent
    try:
        if cfg.get("mode") == "container":
            server = Server(sock, *setup(cfg))
        else:
            server = Server(sock, None, plain_setup(cfg), plain=True)
    except Exception as exc:  # noqa: BLE001 - tell the agent why, then leave
        sock.send(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}).encode())
        return 1
    server.send({"ready": os.getpid()})
    with contextlib.suppress(SystemExit):
        server.serve()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
