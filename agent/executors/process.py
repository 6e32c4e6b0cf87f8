"""Process executor: no Docker. A sandbox is the directory ``<root>/<sandbox>``; an action is a process
group pinned to its cores with ``taskset`` (or ``sched_setaffinity`` through a tiny Python shim).

Isolation is best effort: memory is limited with ``prlimit --as`` where available, there is no network or
filesystem isolation, and a ``setsid`` daemon can escape the process-group kill.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass

from .base import (
    DEFAULT_GET_CAP,
    ExecutorError,
    OutputCollector,
    RunRequest,
    RunResult,
    SandboxNotFound,
    SandboxSpec,
    check_name,
    check_request,
    drain,
    feed_stdin,
    exit_status,
    expand_dop,
    format_cpuset,
    parse_cpuset,
    read_nofollow,
    split_relpath,
    wait_exit,
    write_nofollow,
)

KILL_GRACE_S = 5.0
_AFFINITY_SHIM = "import os,sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); os.execvp(sys.argv[2], sys.argv[2:])"


def process_argv(cmd: str, cores: tuple[int, ...], mem_mib: int | None, taskset: str | None,
                 prlimit: str | None) -> list[str]:
    """Pure: the argv that pins ``sh -c cmd`` to ``cores`` (and caps its address space)."""
    argv: list[str] = []
    if prlimit and mem_mib:
        argv += [prlimit, f"--as={mem_mib << 20}", "--"]
    if taskset:
        argv += [taskset, "-c", format_cpuset(cores)]
    else:
        argv += [sys.executable, "-S", "-c", _AFFINITY_SHIM, ",".join(map(str, sorted(cores)))]
    return [*argv, "/bin/sh", "-c", cmd]


@dataclass
class _Action:
    proc: asyncio.subprocess.Process
    killed: bool = False


class ProcessExecutor:
    def __init__(self, root_dir: str, idle_cpus: str, mem_limit: bool = False) -> None:
        self.root = os.path.abspath(root_dir)
        os.makedirs(self.root, mode=0o755, exist_ok=True)
        self.idle = parse_cpuset(idle_cpus)
        self.allowed = set(os.sched_getaffinity(0))
        self._taskset, self._prlimit = shutil.which("taskset"), shutil.which("prlimit")
        self._mem_limit = mem_limit
        self._mem: dict[str, int] = {}
        self._actions: dict[str, _Action] = {}

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
        argv = process_argv(cmd, req.cores, mem, self._taskset, self._prlimit)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE if req.stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        act = self._actions[req.action] = _Action(proc)
        setup_s = time.monotonic() - t0
        out, err = OutputCollector(req.output_cap), OutputCollector(req.output_cap)
        io = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err), feed_stdin(proc.stdin, req.stdin))
        timed_out = False
        try:
            timed_out = not await wait_exit(proc, req.timeout_s)
        finally:
            _killpg(proc.pid)  # leftovers of the action go with it
            await proc.wait()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(io, KILL_GRACE_S)
            del self._actions[req.action]
        code = 137 if timed_out or act.killed else exit_status(proc.returncode or 0)
        return RunResult(code, out.value(), err.value(), out.truncated or err.truncated, timed_out,
                         act.killed, time.monotonic() - t0 - setup_s, setup_s, tuple(req.cores))

    async def kill(self, action: str) -> bool:
        act = self._actions.get(action)
        if act is None:
            return False
        act.killed = True
        _killpg(act.proc.pid)
        return True

    async def put(self, sandbox: str, path: str, data: bytes) -> None:
        await asyncio.to_thread(write_nofollow, self._dir(sandbox), split_relpath(path), data)

    async def get(self, sandbox: str, path: str, max_bytes: int = DEFAULT_GET_CAP) -> bytes:
        return await asyncio.to_thread(read_nofollow, self._dir(sandbox), split_relpath(path), max_bytes)

    async def close(self) -> None:
        for action in list(self._actions):
            await self.kill(action)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _base_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}

