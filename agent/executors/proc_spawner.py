"""The process executor's spawner: a small long-lived process that starts actions, so the agent never forks.

Run by the agent (``agent.executors.spawner``) as ``python -I -S proc_spawner.py CONFIG`` with one end of a
``SOCK_SEQPACKET`` socket pair as its stdin; standard library only. Two modes (``CONFIG["mode"]``):

* ``sandbox`` (contained sandboxes: one spawner per sandbox). At start, still root, it joins the sandbox's
  cgroups it stays in (``CONFIG["join"]``: pids on v1) and its home cgroups (``CONFIG["home"]``: one
  ``tasks``/``cgroup.procs`` file per hierarchy it moves in for each spawn, where it comes back after),
  moves into the sandbox directory (``CONFIG["cwd"]``), and then gives up every privilege for
  good: ``no_new_privs``, an empty capability bounding set, no ambient or inheritable capabilities, no
  supplementary groups, the sandbox's uid and gid (``CONFIG["user"]``) as real, effective and saved ids
  (which clears every capability), not dumpable (sandbox code cannot ptrace it or read its ``/proc``
  files), umask 077. From then on it has nothing the sandbox's code does not have: that code may kill it
  (only its own sandbox's actions suffer; the agent starts a new one), but cannot use it.
* ``plain`` (``trusted_code_only``: one per agent, actions run as the agent's user, as before). Each request
  names the working directory (``cwd``); ``CONFIG["home"]`` (optional, one file) is the spawner's action
  cgroup home.

Per request the spawner moves itself into the action's cgroups (the ``tasks`` file on cgroup v1, which moves
only the calling thread and skips the kernel's global threadgroup lock; ``cgroup.procs`` on v2), pins itself
to the granted cores (plain mode; a sandbox's slot is a cpuset of them), ``posix_spawn``s the command (vfork:
no page-table copy) in a new session, and moves back home: the command is in its cgroups and on its cores
from its first instruction, with the spawner's credentials. The moves work without privileges because cgroup
v1 and v2 check the credentials a cgroup file was *opened* with (the agent's: root).

Requests (JSON, one per datagram):

* ``{"op": "spawn", "id": N, "argv": [...], "env": {...}, "cores": [...], "cwd": DIR}`` (``cwd``: plain mode)
  with fds ``[stdin, stdout, stderr]`` plus one join file per home. Replies ``{"id": N, "exit": code}`` (-N:
  killed by signal N) once it exited, after SIGKILLing what is left of its process group, or ``{"id": N,
  "error": "..."}`` when it could not start. A program that does not exist or cannot run exits 127 / 126
  with a shell-like message on its stderr; so does a spawn refused by the sandbox's process limit (126).
* ``{"op": "kill", "id": N}``: SIGKILL the action's process group. No reply.

Then it says ``{"ready": pid}`` and serves until the agent closes the socket; leaving, it kills the process
groups of the actions still running.
"""

import array
import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import sys

PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CAP_VERSION_3 = 0x20080522
MAX_MSG = 4 << 20
SOCK_FD = 0


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def check(libc, rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def join(fds):
    for fd in fds:
        os.write(fd, b"0")


def drop_privileges(uid, gid):
    """Sandbox mode: become ``uid:gid`` with no way back and nothing extra (see the module doc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        cap_last = int(f.read())
    check(libc, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(cap_last + 1):
        check(libc, libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # all three non-zero: the kernel clears every capability
    header, data = CapHeader(CAP_VERSION_3, 0), (CapData * 2)()  # and the inheritable set, to be sure
    check(libc, libc.capset(ctypes.byref(header), data), "capset")
    check(libc, libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    os.umask(0o077)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid or os.getgroups() not in ([], [gid]):
        raise RuntimeError("the sandbox user did not stick")


def setup(cfg):
    """Both modes: join the home cgroups; sandbox mode: move in and drop privileges. The home fds."""
    for path in cfg.get("join") or []:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    home = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in cfg.get("home") or []]
    join(home)
    if cfg.get("mode") == "sandbox":
        os.chdir(cfg["cwd"])
        uid, gid = cfg["user"]
        drop_privileges(int(uid), int(gid))
    return home


class Server:
    def __init__(self, sock, home, sandbox):
        self.sock, self.home, self.sandbox = sock, home, sandbox
        self.poll = select.epoll()
        self.poll.register(sock.fileno(), select.EPOLLIN)
        self.nfds = (3 + len(home),) if sandbox else (3, 3 + len(home)) if home else (3,)
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
        """Start the action; its pid, or None when it could not run (reported as a shell would)."""
        stdio = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds[:3])]
        if not self.sandbox:
            os.chdir(req["cwd"])
        joins = fds[3:]
        try:
            join(joins)  # into the action's cgroups: the child starts there
            if not self.sandbox:  # (a sandbox's slot is a cpuset of exactly these cores)
                os.sched_setaffinity(0, req["cores"])
            return os.posix_spawn(
                req["argv"][0],
                req["argv"],
                req["env"],
                setsid=True,
                file_actions=stdio,
                setsigdef=self.sigdef,
                setsigmask=(),
            )
        except (FileNotFoundError, PermissionError, BlockingIOError) as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            why = exc.strerror
            if isinstance(exc, BlockingIOError):
                why = f"cannot fork ({why}): the sandbox's process limit is reached"
            with contextlib.suppress(OSError):
                os.write(fds[2], f"tangram-spawner: {req['argv'][0]}: {why}\n".encode())
            self.send({"id": req["id"], "exit": code})
            return None
        finally:
            if joins:
                self.go_home()

    def go_home(self):
        """Back to the spawner's own cgroups after a spawn (stuck in the action's, it would die with it)."""
        try:
            join(self.home)
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
    data, ancdata, _, _ = sock.recvmsg(
        MAX_MSG, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    )
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
        server = Server(sock, setup(cfg), cfg.get("mode") == "sandbox")
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
