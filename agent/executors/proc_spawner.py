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
* ``"slot"`` in a spawn request and ``{"op": "forget", "slot": KEY}``: the join files of a slot, passed once
  and kept (``spawnloop``'s doc).

Then it says ``{"ready": pid}`` and serves until the agent closes the socket; leaving, it kills the process
groups of the actions still running.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I: this directory is not on sys.path
try:
    import spawnloop  # the serving loop and helpers, shared with nsspawner.py
finally:
    del sys.path[0]

PR_SET_DUMPABLE = 4


def drop_privileges(uid, gid):
    """Sandbox mode: become ``uid:gid`` with no way back and nothing extra (see the module doc)."""
    spawnloop.drop_privileges((uid, gid), spawnloop.last_cap())
    spawnloop.check(spawnloop.libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
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
    spawnloop.join(home)
    if cfg.get("mode") == "sandbox":
        os.chdir(cfg["cwd"])
        uid, gid = cfg["user"]
        drop_privileges(int(uid), int(gid))
    return home


class Server(spawnloop.Server):
    unrunnable = (FileNotFoundError, PermissionError, BlockingIOError)

    def __init__(self, sock, home, sandbox):
        nfds = (3 + len(home),) if sandbox else (3, 3 + len(home)) if home else (3,)
        super().__init__(sock, home, nfds)
        self.sandbox = sandbox

    def prepare(self, req, fds):
        if not self.sandbox:
            os.chdir(req["cwd"])
        return bool(fds[3:])

    def enter(self, req, fds):
        spawnloop.join(fds[3:])  # into the action's cgroups: the child starts there
        if not self.sandbox:  # (a sandbox's slot is a cpuset of exactly these cores)
            os.sched_setaffinity(0, req["cores"])

    def why(self, exc):
        if isinstance(exc, BlockingIOError):
            return f"cannot fork ({exc.strerror}): the sandbox's process limit is reached"
        return exc.strerror


def make_server(sock, cfg):
    return Server(sock, setup(cfg), cfg.get("mode") == "sandbox")


if __name__ == "__main__":
    spawnloop.run(make_server)
