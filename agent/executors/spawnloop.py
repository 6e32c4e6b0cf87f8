"""What the two spawner scripts share (``nsspawner.py``: the Docker fast path's; ``proc_spawner.py``: the
process executor's): the serving loop, the protocol's helpers and the privilege drop.

Standard library only, and not imported as part of the ``agent`` package: each script, run as ``python -I -S
SCRIPT CONFIG`` (so its own directory is not on ``sys.path``), puts its directory first on ``sys.path``,
imports this module and takes that entry out again, before it does anything else.

Protocol (JSON, one request per datagram on the ``SOCK_SEQPACKET`` socket that is the spawner's stdin):

* ``{"op": "spawn", "id": N, "argv": [...], "env": {...}, ...}`` with fds ``[stdin, stdout, stderr]`` and
  the script's own (the cgroup files to join for the spawn): ``posix_spawn`` (vfork: no page-table copy)
  in a new session, with those stdio, default signal dispositions and an empty mask. Replies ``{"id": N,
  "exit": code}`` (-N: killed by signal N) once it exited, *after* SIGKILLing what is left of its process
  group, or ``{"id": N, "error": "..."}`` when it could not start. A program that does not exist or cannot
  run exits 127 / 126 with a shell-like message on its stderr.
* ``{"op": "kill", "id": N}``: SIGKILL the action's process group. No reply. The spawner is the parent:
  the pid cannot have been reused.
* A spawn request may name a ``"slot"`` (a key: the agent's path of the action's cgroup). With more than the
  three stdio descriptors, the rest (its cgroup files) are kept under that key; with only the three, those
  kept are used. So the agent opens and passes a slot's files once, not per action.
  ``{"op": "forget", "slot": KEY}`` closes the ones kept under ``KEY`` (the agent keeps a few per spawner).

The spawner says ``{"ready": pid}`` once set up (``{"failed": why}`` when it cannot be) and serves until
the agent closes the socket; leaving, it kills the process groups of the actions still running.
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

PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
CAP_VERSION_3 = 0x20080522
MAX_MSG = 4 << 20
SOCK_FD = 0
SIGDEF = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)  # Python ignores (or handles) these

libc = ctypes.CDLL(None, use_errno=True)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def last_cap():
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


def drop_privileges(user, cap_last):
    """For good: ``no_new_privs``, an empty capability bounding set, no ambient capabilities, no
    supplementary groups, ``user`` (uid, gid) as real, effective and saved ids if not None, and no
    capabilities at all (effective, permitted, inheritable), root or not."""
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(cap_last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    os.setgroups([])
    if user is not None:
        uid, gid = int(user[0]), int(user[1])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # non-zero: the kernel clears every capability
    header, data = CapHeader(CAP_VERSION_3, 0), (CapData * 2)()  # all zero, the inheritable set too
    check(libc.capset(ctypes.byref(header), data), "capset")


def join(fds):
    """Move the spawner into the cgroups of these ``cgroup.procs`` (or v1 ``tasks``) files."""
    for fd in fds:
        os.write(fd, b"0")


_BUF = bytearray(MAX_MSG)  # one receive buffer: only the pages a request touches become resident
_VIEW = memoryview(_BUF)


def recv_fds(sock, maxfds=8):
    """``socket.recv_fds`` without its flaw (3.11 drops the flags: descriptors would be inheritable), into
    one buffer allocated once (``recvmsg(MAX_MSG)`` maps, shrinks and unmaps 4 MiB per request)."""
    fds = array.array("i")
    n, ancdata, _, _ = sock.recvmsg_into(
        [_BUF], socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    )
    data = bytes(_VIEW[:n])
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def kill_group(pid):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Server:
    """The serving loop. ``home``: the fds of the spawner's own cgroup files, written back after every
    spawn that moved it; ``nfds``: the numbers of descriptors a spawn request may bring; ``stop_fd``: an
    fd (a pidfd) whose readability ends the spawner. A script subclasses it with ``prepare`` and
    ``enter`` (where the action starts), and ``why`` where it reports more failures as a shell would."""

    unrunnable = (FileNotFoundError, PermissionError)  # exit 127 / 126, as a shell would

    def __init__(self, sock, home, nfds, stop_fd=None):
        self.sock, self.home, self.nfds, self.stop_fd = sock, home, nfds, stop_fd
        self.poll = select.epoll()
        self.poll.register(sock.fileno(), select.EPOLLIN)
        if stop_fd is not None:
            self.poll.register(stop_fd, select.EPOLLIN)
        self.children = {}  # pidfd -> (request id, pid)
        self.slots = {}  # slot key -> the join fds kept for it (see the module doc)
        self.by_id = {}  # request id -> pid, until reaped
        self.sigdef = SIGDEF

    def send(self, msg):
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError:
            raise SystemExit(0) from None  # the agent is gone

    def serve(self):
        try:
            while True:
                for fd, _ in self.poll.poll():
                    if fd == self.stop_fd:
                        raise SystemExit(0)  # e.g. the container stopped
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
        except ConnectionError:  # the agent died (kill -9): like EOF, quietly
            raise SystemExit(0) from None
        if not data:
            raise SystemExit(0)
        kept = ()
        try:
            req = json.loads(data)
            op = req.get("op")
            if op == "spawn":
                slot = req.get("slot")
                kept = self.keep(slot, fds)
                self.spawn(req, fds[:3] + self.slots.get(slot, []) if isinstance(slot, str) else fds)
            elif op == "kill" and req.get("id") in self.by_id:
                kill_group(self.by_id[req["id"]])
            elif op == "forget" and isinstance(req.get("slot"), str):
                for fd in self.slots.pop(req["slot"], ()):
                    os.close(fd)
        finally:
            for fd in fds:
                if fd not in kept:
                    os.close(fd)

    def keep(self, slot, fds):
        """Keep the join fds a request brings for ``slot`` (replacing those kept before); the fds kept."""
        if not isinstance(slot, str) or len(fds) <= 3:
            return ()
        for fd in self.slots.pop(slot, ()):
            os.close(fd)
        self.slots[slot] = fds[3:]
        return fds[3:]

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

    def prepare(self, req, fds):
        """Before the spawn (its OSError: the request's ``error``); whether it leaves home (``go_home``)."""
        return False

    def enter(self, req, fds):
        """Right before the spawn (its ``unrunnable`` errors count as the program's, as a shell's would)."""

    def why(self, exc):
        """What the action's stderr says when ``exc`` (one of ``unrunnable``) kept it from running."""
        return exc.strerror

    def start(self, req, fds):
        """Start the action; its pid, or None when it could not run (reported as a shell would)."""
        stdio = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds[:3])]
        moved = self.prepare(req, fds)
        try:
            self.enter(req, fds)
            return os.posix_spawn(
                req["argv"][0],
                req["argv"],
                req["env"],
                setsid=True,
                file_actions=stdio,
                setsigdef=self.sigdef,
                setsigmask=(),
            )
        except self.unrunnable as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            with contextlib.suppress(OSError):
                os.write(fds[2], f"tangram-spawner: {req['argv'][0]}: {self.why(exc)}\n".encode())
            self.send({"id": req["id"], "exit": code})
            return None
        finally:
            if moved:
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


def main(make_server):
    """``make_server(sock, cfg)``: set up (its exception is told to the agent as ``failed``), a Server."""
    cfg = json.loads(sys.argv[1])
    sock = socket.socket(fileno=SOCK_FD)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent's terminal ^C is for the agent
    try:
        server = make_server(sock, cfg)
    except Exception as exc:  # noqa: BLE001 - tell the agent why, then leave
        sock.send(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}).encode())
        return 1
    server.send({"ready": os.getpid()})
    with contextlib.suppress(SystemExit):
        server.serve()
    return 0


def run(make_server):
    """The script's ``__main__``: ``main``, its return code the exit status; EPIPE (no agent) is quiet."""
    try:
        sys.exit(main(make_server))
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
