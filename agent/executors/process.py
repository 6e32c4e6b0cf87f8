"""Process executor: no Docker. A sandbox is the directory ``<root>/<sandbox>``; an action is ``sh -c cmd`` in
its own session, pinned to its cores from its first instruction, its output read by the event loop.

The command is started by the agent's spawner (``spawner``/``nsspawner``, plain mode: one small process that
moves to the sandbox directory, pins itself to the cores and ``posix_spawn``s, so the agent's own thread
never migrates or waits for a vfork), and reported back when it exits. Without a spawner (it could not start,
or died), the agent spawns itself (``spawn.spawn_pinned``: the spawning thread's affinity is inherited, no
``taskset`` exec) and watches the child through a pidfd.

Each action lives in a cgroup of its own (``cgroups``: v1 freezer or pids, or v2), which it is in before it
execs: the spawner moves itself in for the spawn, and the fallback's shell moves itself in first. When the
action ends (exit, kill, timeout), everything in the cgroup is killed (``setsid`` daemons too); an emptied
cgroup is kept for the next action. ``recover`` kills what an earlier agent of this node left running. Where
cgroups cannot be used (not root, not mounted) the executor says so once and kills the action's process group
only, as before.

Isolation is best effort: memory is limited with ``prlimit --as`` where available and asked for, and there is
no network or filesystem isolation.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from dataclasses import dataclass

from .base import (
    DEFAULT_GET_CAP,
    ExecutorError,
    RunRequest,
    RunResult,
    SandboxNotFound,
    SandboxSpec,
    check_name,
    check_request,
    exit_status,
    expand_dop,
    parse_cpuset,
    read_nofollow,
    split_relpath,
    write_nofollow,
)
from .cgroups import ActionCgroups, Hierarchy, Reaped, join_file
from .spawn import ChildIO, ExitWatch, kill_group, spawn_pinned
from .spawner import Job, Spawner, plain_config

KILL_GRACE_S = 5.0
SPAWNER_TRIES = 3  # failed spawner starts before the agent keeps spawning actions itself
log = logging.getLogger("agent.executors.process")


def process_argv(cmd: str, mem_mib: int | None, prlimit: str | None) -> list[str]:
    """Pure: the argv of ``sh -c cmd`` (behind ``prlimit --as`` when a memory cap is asked for)."""
    argv: list[str] = []
    if prlimit and mem_mib:
        argv += [prlimit, f"--as={mem_mib << 20}", "--"]
    return [*argv, "/bin/sh", "-c", cmd]


JOIN_SELF = 'echo 0 > "$0" || exit 125; exec "$@"'


def joining_argv(join: str, argv: list[str]) -> list[str]:
    """Pure: ``argv`` behind a shell that first moves itself into a cgroup (``join``: its ``join_file``) and
    then execs it (for the agent's own spawns; the spawner moves itself instead)."""
    return ["/bin/sh", "-c", JOIN_SELF, join, *argv]


@dataclass
class _Action:
    pid: int = 0  # spawned by the agent itself
    job: Job | None = None  # or by the spawner
    spawner: Spawner | None = None
    killed: bool = False
    timed_out: bool = False
    reaped: bool = False  # after this the pid may be reused: never signal it again
    cg: str | None = None  # the action's cgroup, until removed

    def kill(self) -> None:
        self.killed = True
        self.stop()

    def time_out(self) -> None:
        self.timed_out = True
        self.stop()

    def stop(self) -> None:
        if self.job is not None and self.spawner is not None:
            self.spawner.kill(self.job)
        elif self.pid and not self.reaped:
            kill_group(self.pid)


class ProcessExecutor:
    def __init__(self, root_dir: str, idle_cpus: str, mem_limit: bool = False, spawner: bool = True, *,
                 cluster: str = "default", node: str = "local", cgroups: bool | Hierarchy = True) -> None:
        """``cluster``, ``node``: where the action cgroups live (see ``cgroups``); ``cgroups``: False for
        none, True for the hierarchy ``cgroups.discover`` picks, or a given one."""
        self.root = os.path.abspath(root_dir)
        os.makedirs(self.root, mode=0o755, exist_ok=True)
        self.idle = parse_cpuset(idle_cpus)
        self.allowed = set(os.sched_getaffinity(0))
        self._prlimit = shutil.which("prlimit")
        self._mem_limit = mem_limit
        self._mem: dict[str, int] = {}
        self._actions: dict[str, _Action] = {}
        self.use_spawner = spawner and hasattr(os, "pidfd_open")
        self._spawner: Spawner | None = None
        self._spawner_lock: asyncio.Lock | None = None
        self._spawner_failures = 0
        self.cgroups: ActionCgroups | None = None
        if cgroups:
            given = cgroups if isinstance(cgroups, Hierarchy) else None
            self.cgroups = ActionCgroups.open(cluster, node, given)

    async def _live_spawner(self) -> Spawner | None:
        """The agent's spawner, started on first use; None: spawn from the agent."""
        if not self.use_spawner or self._spawner_failures >= SPAWNER_TRIES:
            return None
        if self._spawner is not None and self._spawner.alive:
            return self._spawner
        self._spawner_lock = self._spawner_lock or asyncio.Lock()
        async with self._spawner_lock:
            if self._spawner is None or not self._spawner.alive:
                try:
                    home = join_file(self.cgroups.h, self.cgroups.spawner) if self.cgroups else None
                    self._spawner = await Spawner.start(plain_config(home))
                except (ExecutorError, OSError) as exc:
                    self._spawner_failures += 1
                    log.warning("no spawner (%s): the agent spawns actions itself", exc)
                    return None
        return self._spawner

    def _dir(self, sandbox: str) -> str:
        return os.path.join(self.root, check_name("sandbox", sandbox))

    async def create_sandbox(self, spec: SandboxSpec) -> None:
        os.makedirs(self._dir(spec.sandbox), mode=0o755, exist_ok=True)
        self._mem[spec.sandbox] = spec.mem_mib

    async def destroy_sandbox(self, sandbox: str) -> None:
        path = self._dir(sandbox)
        self._mem.pop(sandbox, None)
        await asyncio.to_thread(shutil.rmtree, path, ignore_errors=True)

    async def list_sandboxes(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))

    async def run(self, req: RunRequest) -> RunResult:
        check_request(req, self.allowed)
        if req.action in self._actions:
            raise ExecutorError(f"action {req.action!r} is already running")
        cwd = self._dir(req.sandbox)
        if not os.path.isdir(cwd):
            raise SandboxNotFound(f"no sandbox {req.sandbox!r}")
        t0 = time.monotonic()
        cmd, env = expand_dop(req.cmd, req.dop, {**_base_env(), **req.env})
        mem = self._mem.get(req.sandbox) if self._mem_limit else None
        argv = process_argv(cmd, mem, self._prlimit)
        spawner = await self._live_spawner()
        act = self._actions[req.action] = _Action()
        try:
            if self.cgroups is not None:
                act.cg = self.cgroups.take()
            if spawner is not None:
                return await self._run_spawned(req, act, spawner, argv, env, cwd, t0)
            return await self._run_here(req, act, argv, env, cwd, t0)
        finally:
            try:
                await self._end_cgroup(act)  # (done already, unless the run failed or was cancelled)
            finally:
                del self._actions[req.action]

    async def _end_cgroup(self, act: _Action) -> None:
        """Kill what the action left in its cgroup (setsid daemons too): an empty one goes back to the pool at
        once; one with processes left is emptied and removed in a worker thread. Idempotent."""
        cg, act.cg = act.cg, None
        if cg is None or self.cgroups is None:
            return
        pending = act.job is not None and not act.job.exit.done()  # cancelled: the spawn may still come
        if not pending and self.cgroups.give_back(cg):
            return
        spare = (act.spawner.pid,) if act.spawner is not None else ()  # it passes through while spawning
        try:
            left = await asyncio.to_thread(self.cgroups.remove, cg, spare)
        except OSError as exc:
            log.error("cannot clean up the cgroup of an action: %s", exc)
            return
        log.debug("killed %d processes left by the action in %s", left, cg)

    async def _run_spawned(self, req: RunRequest, act: _Action, spawner: Spawner, argv: list[str],
                           env: dict[str, str], cwd: str, t0: float) -> RunResult:
        io = ChildIO(req.output_cap, req.stdin)
        try:
            act.spawner = spawner
            act.job = self._send_spawn(act, spawner, argv, env, io.child_fds, cwd, req.cores)
            # The deadline only sends the kill: the exit it causes is what this waits for, as for any exit.
            io.start(req.timeout_s, act.time_out)
            if act.killed:  # a Kill that came while the request was being sent
                act.kill()
            setup_s = time.monotonic() - t0
            try:
                returncode = await act.job.exit  # the spawner killed its process group before it reaped
            except asyncio.CancelledError:
                act.stop()  # it must not outlive the request
                raise
            await self._end_cgroup(act)  # the rest of the tree: its output ends with it
            await io.wait_eof(KILL_GRACE_S)
        finally:
            io.close()
        return self._result(req, io, returncode, act.timed_out, act, t0, setup_s)

    def _send_spawn(self, act: _Action, spawner: Spawner, argv: list[str], env: dict[str, str],
                    fds: tuple[int, ...], cwd: str, cores: tuple[int, ...]) -> Job:
        """The spawn request, with the action's cgroup (its ``join_file``) for the spawner to move into."""
        if act.cg is None:
            return spawner.spawn(argv, env, fds, cwd=cwd, cores=sorted(cores))
        assert self.cgroups is not None
        procs = os.open(join_file(self.cgroups.h, act.cg), os.O_WRONLY | os.O_CLOEXEC)
        try:
            return spawner.spawn(argv, env, (*fds, procs), cwd=cwd, cores=sorted(cores))
        finally:
            os.close(procs)

    async def _run_here(self, req: RunRequest, act: _Action, argv: list[str], env: dict[str, str], cwd: str,
                        t0: float) -> RunResult:
        io = ChildIO(req.output_cap, req.stdin)
        if act.cg is not None:
            assert self.cgroups is not None
            argv = joining_argv(join_file(self.cgroups.h, act.cg), argv)
        try:
            act.pid = spawn_pinned(argv, env=env, cwd=cwd, cores=req.cores, fds=io.child_fds)
        except BaseException:
            io.close()
            raise
        io.start()
        watch = ExitWatch(act.pid)
        if act.killed:
            act.kill()
        setup_s = time.monotonic() - t0
        timed_out = False
        try:
            timed_out = not await watch.wait(req.timeout_s)
        finally:
            kill_group(act.pid)  # leftovers of the action go with it (the zombie still holds the pgid)
            try:
                await watch.wait(None)
                act.reaped = True
                returncode = watch.reap()
                await self._end_cgroup(act)
                await io.wait_eof(KILL_GRACE_S)
            finally:
                watch.close()
                io.close()
        return self._result(req, io, returncode, timed_out, act, t0, setup_s)

    @staticmethod
    def _result(req: RunRequest, io: ChildIO, returncode: int, timed_out: bool, act: _Action, t0: float,
                setup_s: float) -> RunResult:
        code = 137 if timed_out or act.killed else exit_status(returncode)
        log.debug("action %s: exit %d on cores %s", req.action, code, req.cores)
        return RunResult(code, io.out.value(), io.err.value(), io.truncated, timed_out, act.killed,
                         time.monotonic() - t0 - setup_s, setup_s, tuple(req.cores))

    async def kill(self, action: str) -> bool:
        act = self._actions.get(action)
        if act is None:
            return False
        act.kill()
        return True

    async def put(self, sandbox: str, path: str, data: bytes) -> None:
        await asyncio.to_thread(write_nofollow, self._dir(sandbox), split_relpath(path), data)

    async def get(self, sandbox: str, path: str, max_bytes: int = DEFAULT_GET_CAP) -> bytes:
        return await asyncio.to_thread(read_nofollow, self._dir(sandbox), split_relpath(path), max_bytes)

    async def close(self) -> None:
        for action in list(self._actions):
            await self.kill(action)
        exits = [a.job.exit for a in self._actions.values() if a.job is not None]
        if exits:  # let the spawner report them before it goes
            await asyncio.wait(exits, timeout=KILL_GRACE_S)
        if self._spawner is not None:
            await self._spawner.close()
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.close)

    async def recover(self) -> Reaped | None:
        """Before the agent says Hello: kill and remove what earlier agents of this node left in their action
        cgroups (the sandbox directories stay). None without action cgroups."""
        if self.cgroups is None:
            return None
        found = await asyncio.to_thread(self.cgroups.reap_predecessors)
        log.info("recovery: %d earlier agents of this node found, %d processes killed in %d of their "
                 "cgroups%s", found.incarnations, found.processes, found.cgroups,
                 f"; {found.skipped} of a live agent left alone" if found.skipped else "")
        return found


def _base_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}

