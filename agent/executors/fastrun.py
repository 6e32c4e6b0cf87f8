"""One action on the Docker fast path, given the container's cgroups (``fastpath``).

Two ways to start the command, both without dockerd:

* ``run_spawned``: through the sandbox's spawner (``spawner.Spawner``), which already lives in the
  container's namespaces and cgroups; the forked child joins the action's cpuset sub-cgroup and execs.
  No exec besides the command's own shell, one cgroup move.
* ``run_nsenter``: the fallback (no spawner: it failed to start, or is gone): ``sh`` joins every cgroup,
  ``nsenter`` enters the namespaces, ``setpriv`` drops privileges, then the shell (``fastpath.nsenter_argv``).

Both create the action's sub-cgroup with exactly the granted cores first, and end the same way: what is
left in the sub-cgroup is killed, the output is read to its end (bounded by ``KILL_GRACE_S``), the
sub-cgroup is removed. Cgroup file operations take well under a millisecond and run inline; only a
cgroup that does not empty at once is waited for in a worker thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

from . import fastpath
from .base import RunRequest, RunResult, exit_status, expand_dop, format_cpuset
from .spawn import ChildIO, ExitWatch, kill_group, spawn_pinned
from .spawner import Job, Spawner, SpawnerLost

KILL_GRACE_S = 5.0
SHELL = "/bin/sh"


@dataclass
class FastAction:
    sub_cg: str | None = None  # the action's slot of the sandbox's fastpath.SlotPool
    pool: fastpath.SlotPool | None = None
    spawner: Spawner | None = None
    job: Job | None = None
    pid: int = 0  # nsenter path: our child, until reaped
    killed: bool = False
    timed_out: bool = False

    def time_out(self) -> None:
        """The deadline passed: kill the main process (the rest of the tree goes when the action ends)."""
        self.timed_out = True
        self.kill_now()

    def _spared(self) -> tuple[int, ...]:
        # the spawner passes through the sub-cgroup while it starts the action: never kill it
        return (self.spawner.pid,) if self.spawner is not None else ()

    def kill_now(self) -> bool:
        """The part of a kill that is instant (on the loop thread); True when the cgroup is already empty."""
        if self.spawner is not None and self.job is not None:
            self.spawner.kill(self.job)
        if self.pid:
            kill_group(self.pid)
        return self.sub_cg is None or fastpath.kill_cgroup_once(self.sub_cg, self._spared())

    async def kill(self) -> bool:
        """SIGKILL the whole tree: the main process, and everything in the sub-cgroup until it is empty
        (False: it did not empty within ``KILL_GRACE_S``)."""
        if self.kill_now() or self.sub_cg is None:
            return True
        return await asyncio.to_thread(fastpath.kill_cgroup, self.sub_cg, KILL_GRACE_S, self._spared())

    def take_slot(self, sb: Any, req: RunRequest) -> None:
        self.pool = sb.slots
        self.sub_cg = sb.slots.take(format_cpuset(req.cores))


def _result(req: RunRequest, io: ChildIO | None, code: int, timed_out: bool, act: FastAction, t0: float,
            setup_s: float) -> RunResult:
    assert io is not None
    if timed_out or act.killed:
        code = 137
    return RunResult(code, io.out.value(), io.err.value(), io.truncated, timed_out, act.killed,
                     time.monotonic() - t0 - setup_s, setup_s, tuple(req.cores))


async def run_spawned(req: RunRequest, act: FastAction, sb: Any, t0: float) -> RunResult:
    """The action through the sandbox's spawner (``sb.spawner`` is alive)."""
    cmd, env = expand_dop(req.cmd, req.dop, {**sb.env, **req.env})
    act.take_slot(sb, req)
    io: ChildIO | None = None
    try:
        io = ChildIO(req.output_cap, req.stdin)
        act.spawner = sb.spawner
        sub = act.sub_cg
        assert sub is not None
        # its slot's join file goes once per slot, forgotten when the slot is removed (the name comes back)
        act.job = sb.spawner.spawn_joining([SHELL, "-c", cmd], env, io.child_fds,
                                           lambda: [fastpath.join_file(sub, sb.cg.v2)], slot=sub)
        # The deadline only starts the kill: the exit it causes is what this waits for, as for any exit.
        io.start(req.timeout_s, act.time_out)
        if act.killed:  # a Kill that came while the request was being sent
            act.kill_now()
        setup_s = time.monotonic() - t0
        code = await _exit_code(act, sb)
    finally:
        await _end(act, io)  # the output is complete only after this
    return _result(req, io, code, act.timed_out, act, t0, setup_s)


async def _exit_code(act: FastAction, sb: Any) -> int:
    """The spawned job's exit status. Its spawner gone before it reported the exit while the
    action was being killed with its sandbox (the controller sends a Kill and the sandbox's
    destroy when it closes, and the destroy may come first): a killed action, not an error.
    Otherwise (the spawner died under a live sandbox) ``SpawnerLost`` stands."""
    assert act.job is not None
    try:
        return exit_status(await act.job.exit)
    except SpawnerLost:
        if not (act.killed or sb.destroying):
            raise
        act.killed = True
        return 137


async def run_nsenter(req: RunRequest, act: FastAction, sb: Any, t0: float) -> RunResult:
    """The fallback: an ``nsenter`` chain started by the agent (see ``fastpath.nsenter_argv``)."""
    cg = sb.cg
    cmd, env = expand_dop(req.cmd, req.dop, {**sb.env, **req.env})
    act.take_slot(sb, req)
    assert act.sub_cg is not None
    join = [fastpath.procs_file(d) for d in cg.others] + [fastpath.procs_file(act.sub_cg)]
    argv = fastpath.nsenter_argv(sb.pid, join, cmd, sb.owner, sb.setpriv)
    io: ChildIO | None = None
    watch: ExitWatch | None = None
    try:
        io = ChildIO(req.output_cap, req.stdin)
        act.pid = spawn_pinned(argv, env=env, cwd=None, cores=None, fds=io.child_fds)
        io.start()
        watch = ExitWatch(act.pid)
        if act.killed:  # a Kill that came while it was being started
            act.kill_now()
        setup_s = time.monotonic() - t0
        timed_out = not await watch.wait(req.timeout_s)
        # The action ends with its main process: leftovers (background jobs) go too, before the reap.
        await act.kill()
        await watch.wait(None)
        act.pid, code = 0, 137
        with contextlib.suppress(ChildProcessError):
            code = exit_status(watch.reap())
    finally:
        if watch is not None:
            watch.close()
        await _end(act, io)  # the output is complete only after this
    return _result(req, io, code, timed_out, act, t0, setup_s)


async def _end(act: FastAction, io: ChildIO | None) -> None:
    """Kill what is left, read the output to its end (bounded), give the slot back."""
    emptied = False
    try:
        emptied = await act.kill()
        if act.pid and act.job is None:  # nsenter path cut short (cancelled): reap our child
            with contextlib.suppress(ChildProcessError):
                await asyncio.to_thread(os.waitpid, act.pid, 0)
            act.pid = 0
        if io is not None:
            await io.wait_eof(KILL_GRACE_S)
    finally:
        if io is not None:
            io.close()
        sub, act.sub_cg = act.sub_cg, None  # a late Kill must not touch the slot once it is back
        if sub is not None and act.pool is not None and not (emptied and act.pool.give_back(sub)):
            if act.spawner is not None:  # its name may come back for a new cgroup: no stale file for it
                act.spawner.forget(sub)
            await asyncio.to_thread(fastpath.remove_cgroup, sub)
