"""Agent side of the spawners (``proc_spawner.py`` for the process executor, ``nsspawner.py`` for the Docker
fast path; see their docstrings for what runs there).

``Spawner.start`` runs a spawner (plain: the process executor's, one per agent; sandbox: one per contained
process sandbox; container: one per Docker sandbox), with the host's Python (``-I -S``) and one end of a
``SOCK_SEQPACKET`` socket pair as its stdin, and waits for it to say ready. ``spawn`` sends one request with
the action's stdio (and the files of the action's cgroups to join) as ``SCM_RIGHTS`` and returns a ``Job``
whose ``exit`` future ends with the exit code (-N for signal N). Everything runs on the event loop: one
reader on the socket, a pidfd on the spawner itself (our child: reaped here), no threads, no per-request
task.

When the spawner dies (or the container stops), every job still waiting fails with ``SpawnerLost`` and
the executor falls back (to ``nsenter``, or to spawning from the agent itself) until a new spawner starts.

A spawner that runs as a sandbox's user can be stopped or killed by that sandbox's code. The process
executor's sandbox spawners are ``untrusted`` (the container mode's could be too): a send such a spawner
does not take at once (its socket buffer is full) makes it lost and SIGKILLed instead of waiting for it on
the event loop, and the executor ``abandon``s one that does not report an exit after a kill.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .base import ExecutorError
from .spawn import ExitWatch, devnull, spawn_pinned, wait_done

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsspawner.py")
PROC_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proc_spawner.py")
MAX_MSG = 4 << 20  # the spawner's receive size; larger requests take the nsenter path
START_TIMEOUT_S = 10.0
SEND_TRIES = 50  # 100 ms apart: a spawner that takes no request for 5 s counts as lost
SLOTS_KEPT = 16  # the slots whose join files a spawner keeps (``spawn(slot=...)``); more: the oldest go
log = logging.getLogger("agent.executors.spawner")


class SpawnerLost(ExecutorError):
    pass


def plain_config(home: str | None = None) -> dict[str, Any]:
    """``home``: the ``cgroup.procs`` of the spawner's own cgroup (with action cgroups), joined at start."""
    return {"mode": "plain", "home": [home]} if home else {"mode": "plain"}


def sandbox_config(home: list[str], join: list[str], cwd: str, user: tuple[int, int]) -> dict[str, Any]:
    """One contained process sandbox's spawner: ``home``: the join files of the cgroups it comes back to
    after each spawn (in the order of every request's join files); ``join``: those it just joins at start;
    ``cwd``: the sandbox directory; ``user``: the sandbox's uid and gid (it drops to them after joining)."""
    return {"mode": "sandbox", "home": list(home), "join": list(join), "cwd": cwd, "user": list(user)}


def container_config(container_pid: int, cid: str, *, home: str, join: list[str],
                     user: tuple[int, int] | None) -> dict[str, Any]:
    """``home``: the ``cgroup.procs`` of the container's cpuset cgroup; ``join``: those of its other
    cgroups; ``user``: the sandbox's uid and gid (None: root, without capabilities)."""
    return {"mode": "container", "pid": container_pid, "cid": cid, "home": home, "join": join, "user": user}


@dataclass
class Job:
    id: int
    exit: asyncio.Future[int]


@dataclass
class Spawner:
    pid: int
    sock: socket.socket
    loop: asyncio.AbstractEventLoop
    watch: ExitWatch | None = None
    ready: asyncio.Future[int] | None = None
    jobs: dict[int, Job] = field(default_factory=dict)
    alive: bool = True
    untrusted: bool = False  # runs as a sandbox's user: never wait for it (see the module doc)
    _next: int = 0
    # the slots (keys) whose join files the spawner keeps, oldest first: what it was sent, in order
    _kept: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)

    @classmethod
    async def start(cls, cfg: dict[str, Any], timeout_s: float = START_TIMEOUT_S) -> Spawner:
        """Start a spawner with ``cfg`` (``plain_config``, ``sandbox_config``: ``proc_spawner``;
        ``container_config``: ``nsspawner``). Raises ExecutorError when it cannot get ready."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MSG)
        mode = cfg.get("mode")
        script = PROC_SCRIPT if mode in ("plain", "sandbox") else SCRIPT
        err = devnull() if mode == "sandbox" else 2  # a sandbox's spawner gets nothing of the agent's
        try:
            pid = spawn_pinned([sys.executable, "-I", "-S", script, json.dumps(cfg)], env={}, cwd="/",
                               cores=None, fds=(theirs.fileno(), devnull(), err))
        finally:
            theirs.close()
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        sp = cls(pid, ours, loop, ready=loop.create_future(), untrusted=mode == "sandbox")
        sp.watch = ExitWatch(pid, on_exit=sp._exited)
        loop.add_reader(ours.fileno(), sp._on_readable)
        try:
            if not await wait_done(sp.ready, timeout_s):
                raise ExecutorError(f"the spawner did not get ready within {timeout_s:.0f} s")
            sp.ready.result()
        except BaseException:
            await sp.close()
            raise
        return sp

    def spawn(self, argv: list[str], env: dict[str, str], fds: tuple[int, ...], slot: str | None = None,
              **where: Any) -> Job:
        """Send one spawn request (``where``: ``cwd`` and ``cores`` in plain mode; ``fds``: stdin, stdout,
        stderr, and the join files of the action's cgroups where it has them); raises SpawnerLost, or
        ExecutorError when it is too large to send. With ``slot`` (a key of those cgroups), join files sent
        are kept by the spawner under it, and a request with only the stdio uses those kept (``knows``)."""
        if not self.alive:
            raise SpawnerLost("the spawner is gone")
        self._next += 1
        job = Job(self._next, self.loop.create_future())
        job.exit.add_done_callback(lambda f: f.cancelled() or f.exception())
        msg = {"op": "spawn", "id": job.id, "argv": argv, "env": env, **where}
        if slot is not None:
            msg["slot"] = slot
        data = json.dumps(msg).encode()
        if len(data) > MAX_MSG:
            raise ExecutorError(f"spawn request of {len(data)} bytes is over {MAX_MSG}")
        self._send(data, fds)
        self.jobs[job.id] = job
        if slot is not None and len(fds) > 3:
            self._keep(slot)
        return job

    def spawn_joining(self, argv: list[str], env: dict[str, str], stdio: tuple[int, ...],
                      joins: Callable[[], list[str]], slot: str | None = None, **where: Any) -> Job:
        """``spawn`` into the cgroups whose join files ``joins()`` names: opened here (the agent's
        credentials), passed, closed again; not even named when the spawner keeps them for ``slot``."""
        if slot is not None and self.knows(slot):
            return self.spawn(argv, env, stdio, slot=slot, **where)
        opened: list[int] = []
        try:
            for path in joins():
                opened.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            return self.spawn(argv, env, (*stdio, *opened), slot=slot, **where)
        finally:
            for fd in opened:
                os.close(fd)

    def knows(self, slot: str) -> bool:
        """Whether the spawner keeps the join files of ``slot`` (then a spawn there sends only the stdio)."""
        if slot not in self._kept:
            return False
        self._kept.move_to_end(slot)
        return True

    def forget(self, slot: str) -> None:
        """The slot is gone (its cgroup removed): the spawner closes what it keeps for it."""
        if self._kept.pop(slot, False) is None:
            self._tell_forget(slot)

    def _keep(self, slot: str) -> None:
        self._kept[slot] = None
        self._kept.move_to_end(slot)
        while len(self._kept) > SLOTS_KEPT:
            self._tell_forget(self._kept.popitem(last=False)[0])

    def _tell_forget(self, slot: str) -> None:
        if self.alive:
            with contextlib.suppress(ExecutorError):  # lost: nothing is kept any more
                self._send(json.dumps({"op": "forget", "slot": slot}).encode(), ())

    def kill(self, job: Job) -> None:
        """SIGKILL the job's main process (the spawner is its parent: no pid reuse race)."""
        if self.alive and not job.exit.done():
            with contextlib.suppress(ExecutorError):  # lost: its actions' process groups die with it
                self._send(json.dumps({"op": "kill", "id": job.id}).encode(), ())

    def abandon(self, why: str) -> None:
        """Give up on this spawner: SIGKILL it (our child: the pid is still ours) and fail its jobs."""
        if self.watch is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self._lost(why)

    def _send(self, data: bytes, fds: tuple[int, ...]) -> None:
        for _ in range(SEND_TRIES):
            try:
                socket.send_fds(self.sock, [data], list(fds)) if fds else self.sock.send(data)
                return
            except BlockingIOError:  # its buffer is full: it is far behind, or blocked telling us exits
                self._on_readable()  # so take those first, then give it a moment
                if not self.alive:
                    break
                if self.untrusted:  # stopped by sandbox code, maybe: the event loop must not wait for it
                    self.abandon("it does not take requests")
                    break
                select.select([], [self.sock], [], 0.1)
            except OSError as exc:
                self._lost(f"send failed: {exc}")
                break
        if self.alive:
            self._lost("it does not take requests")
        raise SpawnerLost("the spawner is gone")

    def _on_readable(self) -> None:
        for _ in range(256):
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(str(exc))
                return
            if not data:
                self._lost("it closed its socket")
                return
            self._on_message(json.loads(data))

    def _on_message(self, msg: dict[str, Any]) -> None:
        if self.ready is not None and not self.ready.done():
            if "ready" in msg:
                self.ready.set_result(int(msg["ready"]))
            elif "failed" in msg:
                self.ready.set_exception(ExecutorError(f"the spawner could not start: {msg['failed']}"))
            return
        job = self.jobs.pop(msg.get("id", -1), None)
        if job is None or job.exit.done():  # done: the run waiting for it was cancelled
            return
        if "exit" in msg:
            job.exit.set_result(int(msg["exit"]))
        else:
            why = msg.get("error")
            job.exit.set_exception(ExecutorError(f"the spawner could not start the action: {why}"))

    def _exited(self) -> None:
        self._lost("it exited")
        if self.watch is not None:
            with contextlib.suppress(ChildProcessError):
                self.watch.reap()
            self.watch = None

    def _lost(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(ExecutorError(f"the spawner could not start: {why}"))
            self.ready.exception()  # retrieved: a start that was cancelled or timed out no longer reads it
        for job in self.jobs.values():
            if not job.exit.done():  # (cancelled ones are done)
                job.exit.set_exception(SpawnerLost(f"the spawner is gone: {why}"))
        self.jobs.clear()
        log.debug("spawner %d lost: %s", self.pid, why)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close the socket (the spawner leaves on EOF), wait for it to exit, reap it."""
        self._lost("closed by the agent")
        watch = self.watch
        if watch is None:  # already reaped
            return
        if not await watch.wait(timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            await watch.wait(None)  # _exited reaps it
