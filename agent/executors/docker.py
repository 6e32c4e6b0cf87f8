"""Docker executor: one long-lived container per sandbox, cores granted per action.

Two exec paths (``mode``):

* ``fastpath`` (root, cgroup v1 or v2, ``nsenter``): write the container's ``cpuset.cpus`` directly and read
  it back, create the action's sub-cgroup with exactly the granted cores, and run the command as a child of
  the agent that joins the container's cgroups and enters its namespaces (``fastpath.nsenter_argv``).
  Kill = SIGKILL every process in the action's sub-cgroup.
* ``docker``: ``container.update(cpuset_cpus=...)`` then ``exec_create``/``exec_start(socket=True)``;
  kill = ``kill -9 -<pgid>`` inside the container (runc makes each exec a session leader).

``auto`` picks ``fastpath`` when it is possible. Concurrency: actions on different sandboxes are independent.
Actions sharing a sandbox are allowed; the container's cpuset is then the union of their grants (on the
fast path each still runs on exactly its own cores). Between actions the container sits on the idle set.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from . import archive, fastpath
from .base import (
    DEFAULT_GET_CAP,
    WORKDIR,
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
    parse_owner,
    read_nofollow,
    split_relpath,
    wait_exit,
    write_nofollow,
)
from .images import HOSTROOT_IMAGE, hostroot_mounts

LABEL_CLUSTER = "tangram.cluster"
LABEL_SANDBOX = "tangram.sandbox"
KILL_GRACE_S = 5.0


def container_name(cluster: str, sandbox: str) -> str:
    return f"tangram-{cluster}-{sandbox}"


def container_kwargs(spec: SandboxSpec, cluster: str, idle_cpus: str, image: str) -> dict[str, Any]:
    """Pure: the ``containers.run`` arguments for a sandbox."""
    mem = f"{spec.mem_mib}m"
    kw: dict[str, Any] = dict(
        image=image, command=["sleep", "infinity"], name=container_name(cluster, spec.sandbox), detach=True,
        init=True, network_mode="none", mem_limit=mem, memswap_limit=mem, pids_limit=spec.pids_limit,
        cap_drop=["ALL"], security_opt=["no-new-privileges"], cpuset_cpus=idle_cpus, working_dir=WORKDIR,
        labels={**spec.labels, LABEL_CLUSTER: cluster, LABEL_SANDBOX: spec.sandbox},
    )
    if spec.user is not None:
        kw["user"] = spec.user
    if image == HOSTROOT_IMAGE:
        kw["volumes"] = hostroot_mounts()
    return kw


@dataclass
class _Sandbox:
    name: str
    cid: str
    pid: int
    env: dict[str, str]
    user: str | None
    cg: fastpath.ContainerCgroups | None  # None: docker path
    setpriv: tuple[str, ...]
    active: dict[str, tuple[int, ...]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Action:
    sandbox: _Sandbox
    proc: asyncio.subprocess.Process | None = None
    sub_cg: str | None = None
    exec_id: str | None = None
    killed: bool = False


def _env_list_to_dict(env: list[str] | None) -> dict[str, str]:
    out = {}
    for item in env or []:
        key, _, value = item.partition("=")
        out[key] = value
    return out


class DockerExecutor:
    def __init__(self, client: Any, cluster: str, idle_cpus: str, image_default: str = HOSTROOT_IMAGE,
                 mode: str = "auto") -> None:
        if mode not in ("auto", "fastpath", "docker"):
            raise ValueError(f"`mode` must be auto, fastpath or docker, got {mode!r}")
        self.client, self.cluster, self.image_default = client, check_name("cluster", cluster), image_default
        self.idle = parse_cpuset(idle_cpus)
        self.idle_cpus = format_cpuset(self.idle)
        fast_ok = os.geteuid() == 0 and shutil.which("nsenter") is not None
        if mode == "fastpath" and not fast_ok:
            raise ExecutorError("fastpath needs root and nsenter")
        self.fast = mode == "fastpath" or (mode == "auto" and fast_ok)
        self.mode = mode
        self._sandboxes: dict[str, _Sandbox] = {}
        self._actions: dict[str, _Action] = {}

    # ------------------------------------------------------------ sandboxes

    async def create_sandbox(self, spec: SandboxSpec) -> None:
        check_name("sandbox", spec.sandbox)
        kw = container_kwargs(spec, self.cluster, self.idle_cpus, spec.image or self.image_default)
        container = await asyncio.to_thread(self.client.containers.run, **kw)
        try:
            owner = parse_owner(spec.user)
            if owner is not None:  # the sandbox user owns its workdir, whatever the image says
                await asyncio.to_thread(archive.chown_dir, self.client.api, container.id, WORKDIR, owner)
            self._sandboxes[spec.sandbox] = await asyncio.to_thread(self._attach, container, spec.user)
        except BaseException:
            await asyncio.to_thread(container.remove, force=True)
            raise

    def _attach(self, container: Any, user: str | None) -> _Sandbox:
        container.reload()
        pid = int(container.attrs["State"]["Pid"])
        env = _env_list_to_dict(container.attrs["Config"].get("Env"))
        name = container.labels.get(LABEL_SANDBOX, "")
        owner = parse_owner(user) if user else None
        setpriv = _setpriv_flavour(pid) if self.fast else ()
        # Root inside the sandbox may only take the fast path when its capabilities can be dropped.
        drops = setpriv == fastpath.SETPRIV_FULL or (owner is not None and owner[0] != 0)
        cg = fastpath.discover(pid) if self.fast and (drops or self.mode == "fastpath") else None
        return _Sandbox(name, container.id, pid, env, user, cg, setpriv)

    async def _sandbox(self, name: str) -> _Sandbox:
        sb = self._sandboxes.get(check_name("sandbox", name))
        if sb is not None:
            return sb
        import docker.errors

        try:  # adopt a sandbox created by an earlier agent (reconciliation)
            container = await asyncio.to_thread(self.client.containers.get, container_name(self.cluster, name))
        except docker.errors.NotFound:
            raise SandboxNotFound(f"no sandbox {name!r}") from None
        user = container.attrs["Config"].get("User") or None
        sb = self._sandboxes[name] = await asyncio.to_thread(self._attach, container, user)
        return sb

    async def destroy_sandbox(self, sandbox: str) -> None:
        import docker.errors

        self._sandboxes.pop(check_name("sandbox", sandbox), None)
        name = container_name(self.cluster, sandbox)
        with contextlib.suppress(docker.errors.NotFound):
            container = await asyncio.to_thread(self.client.containers.get, name)
            await asyncio.to_thread(container.remove, force=True)

    async def list_sandboxes(self) -> list[str]:
        flt = {"label": [f"{LABEL_CLUSTER}={self.cluster}"]}
        found = await asyncio.to_thread(self.client.containers.list, all=True, filters=flt)
        return sorted(c.labels.get(LABEL_SANDBOX, "") for c in found)

    async def close(self) -> None:
        for action in list(self._actions):
            await self.kill(action)

    # ------------------------------------------------------------ cpusets

    async def _apply_cpuset(self, sb: _Sandbox) -> None:
        """Container cpuset := union of active grants, or the idle set when none."""
        cores = sorted({c for g in sb.active.values() for c in g}) or list(self.idle)
        cpus = format_cpuset(cores)
        if sb.cg is not None:
            try:
                back = fastpath.write_cpuset(sb.cg.cpuset, cpus)
                if parse_cpuset(back) == tuple(cores):
                    return
            except OSError:
                pass
        # The SDK drops falsy fields, so always send the full set.
        await asyncio.to_thread(self.client.api.update_container, sb.cid, cpuset_cpus=cpus)

    # ------------------------------------------------------------ run

    async def run(self, req: RunRequest) -> RunResult:
        check_request(req)
        if req.action in self._actions:
            raise ExecutorError(f"action {req.action!r} is already running")
        t0 = time.monotonic()
        sb = await self._sandbox(req.sandbox)
        act = self._actions[req.action] = _Action(sb)
        try:
            async with sb.lock:
                sb.active[req.action] = tuple(sorted(req.cores))
                await self._apply_cpuset(sb)
            if sb.cg is not None:
                return await self._run_fast(req, act, t0)
            return await self._run_docker(req, act, t0)
        finally:
            del self._actions[req.action]
            async with sb.lock:
                sb.active.pop(req.action, None)
                await self._apply_cpuset(sb)

    async def _run_fast(self, req: RunRequest, act: _Action, t0: float) -> RunResult:
        sb, cg = act.sandbox, act.sandbox.cg
        assert cg is not None
        cmd, env = expand_dop(req.cmd, req.dop, {**sb.env, **req.env})
        act.sub_cg = fastpath.make_action_cgroup(cg, req.action, format_cpuset(req.cores))
        join = [fastpath.procs_file(d) for d in cg.others] + [fastpath.procs_file(act.sub_cg)]
        owner = parse_owner(sb.user) if sb.user else None
        argv = fastpath.nsenter_argv(sb.pid, join, cmd, owner, sb.setpriv)
        out, err = OutputCollector(req.output_cap), OutputCollector(req.output_cap)
        try:
            act.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if req.stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
            setup_s = time.monotonic() - t0
            timed_out = await self._wait_fast(act, req, out, err)
            code = exit_status(act.proc.returncode if act.proc.returncode is not None else -9)
        finally:
            await asyncio.to_thread(self._kill_fast, act)
            await asyncio.to_thread(fastpath.remove_cgroup, act.sub_cg)
        if timed_out or act.killed:
            code = 137
        return RunResult(code, out.value(), err.value(), out.truncated or err.truncated, timed_out,
                         act.killed, time.monotonic() - t0 - setup_s, setup_s, tuple(req.cores))

    async def _wait_fast(self, act: _Action, req: RunRequest, out: OutputCollector,
                         err: OutputCollector) -> bool:
        proc = act.proc
        assert proc is not None
        io = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err), feed_stdin(proc.stdin, req.stdin))
        timed_out = not await wait_exit(proc, req.timeout_s)
        # The action ends with its main process: leftovers (background jobs) go too.
        await asyncio.to_thread(self._kill_fast, act)
        await proc.wait()
        try:
            await asyncio.wait_for(io, KILL_GRACE_S)
        except asyncio.TimeoutError:
            pass
        return timed_out

    def _kill_fast(self, act: _Action) -> None:
        if act.proc is not None and act.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(act.proc.pid, 9)
        if act.sub_cg is not None:
            fastpath.kill_cgroup(act.sub_cg, KILL_GRACE_S)

    async def _run_docker(self, req: RunRequest, act: _Action, t0: float) -> RunResult:
        sb = act.sandbox
        cmd, env = expand_dop(req.cmd, req.dop, req.env)
        api = self.client.api
        exec_id = (await asyncio.to_thread(
            api.exec_create, sb.cid, ["sh", "-c", cmd], stdin=req.stdin is not None, environment=env,
            workdir=WORKDIR, user=sb.user or ""))["Id"]
        act.exec_id = exec_id
        out, err = OutputCollector(req.output_cap), OutputCollector(req.output_cap)
        sock = await asyncio.to_thread(api.exec_start, exec_id, socket=True)
        setup_s = time.monotonic() - t0
        reader = asyncio.ensure_future(asyncio.to_thread(_pump_exec, sock, req.stdin, out, err))
        try:
            timed_out = await self._wait_docker(act, exec_id, reader, sock, req.timeout_s)
        finally:
            _close_exec_socket(sock)
        info = await asyncio.to_thread(api.exec_inspect, exec_id)
        code = 137 if timed_out or act.killed else int(info.get("ExitCode") or 0)
        return RunResult(code, out.value(), err.value(), out.truncated or err.truncated, timed_out,
                         act.killed, time.monotonic() - t0 - setup_s, setup_s, tuple(req.cores))

    async def _wait_docker(self, act: _Action, exec_id: str, reader: asyncio.Future[None], sock: Any,
                           timeout_s: float) -> bool:
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(reader), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await self._kill_docker(act, exec_id)
        try:
            await asyncio.wait_for(asyncio.shield(reader), KILL_GRACE_S)
        except asyncio.TimeoutError:  # a leftover still holds the stream: stop reading
            with contextlib.suppress(OSError):
                getattr(sock, "_sock", sock).shutdown(2)
            await reader
        return timed_out

    async def _kill_docker(self, act: _Action, exec_id: str) -> None:
        info = await asyncio.to_thread(self.client.api.exec_inspect, exec_id)
        host_pid = int(info.get("Pid") or 0)
        if not info.get("Running") or host_pid <= 0:
            return
        ns_pid = _ns_pid(host_pid)
        if ns_pid is None:
            return
        kill_id = (await asyncio.to_thread(
            self.client.api.exec_create, act.sandbox.cid, ["kill", "-9", "--", f"-{ns_pid}"],
            user=act.sandbox.user or ""))["Id"]
        await asyncio.to_thread(self.client.api.exec_start, kill_id)

    async def kill(self, action: str) -> bool:
        act = self._actions.get(action)
        if act is None:
            return False
        act.killed = True
        if act.sandbox.cg is not None:
            await asyncio.to_thread(self._kill_fast, act)
        elif act.exec_id is not None:
            await self._kill_docker(act, act.exec_id)
        return True

    # ------------------------------------------------------------ files

    async def put(self, sandbox: str, path: str, data: bytes) -> None:
        sb = await self._sandbox(sandbox)
        parts = split_relpath(path)
        owner = parse_owner(sb.user) if sb.user else None
        if sb.cg is not None:
            await asyncio.to_thread(write_nofollow, self._workdir(sb), parts, data, owner)
        else:
            await asyncio.to_thread(archive.put, self.client.api, sb.cid, WORKDIR, parts, data, owner)

    async def get(self, sandbox: str, path: str, max_bytes: int = DEFAULT_GET_CAP) -> bytes:
        sb = await self._sandbox(sandbox)
        parts = split_relpath(path)
        if sb.cg is not None:
            return await asyncio.to_thread(read_nofollow, self._workdir(sb), parts, max_bytes)
        return await asyncio.to_thread(archive.get, self.client.api, sb.cid, WORKDIR, parts, max_bytes)

    def _workdir(self, sb: _Sandbox) -> str:
        # Through the container's root as the kernel sees it; every component opened with O_NOFOLLOW.
        return f"/proc/{sb.pid}/root{WORKDIR}"



def _pump_exec(sock: Any, stdin: bytes | None, out: OutputCollector, err: OutputCollector) -> None:
    from docker.utils.socket import frames_iter

    raw = getattr(sock, "_sock", sock)
    if stdin is not None:
        with contextlib.suppress(OSError):
            raw.sendall(stdin)
            raw.shutdown(1)  # SHUT_WR
    with contextlib.suppress(OSError):
        for stream, chunk in frames_iter(sock, tty=False):
            (err if stream == 2 else out).feed(chunk)


def _setpriv_flavour(pid: int) -> tuple[str, ...]:
    """util-linux setpriv (a regular file) clears the bounding set; busybox's applet link only sets nnp."""
    found: tuple[str, ...] = ()
    for path in ("/usr/bin/setpriv", "/bin/setpriv"):
        with contextlib.suppress(OSError):
            mode = os.lstat(f"/proc/{pid}/root{path}").st_mode
            if stat.S_ISREG(mode):
                return fastpath.SETPRIV_FULL
            found = fastpath.SETPRIV_NNP
    return found


def _close_exec_socket(sock: Any) -> None:
    for obj in (getattr(sock, "_response", None), sock, getattr(sock, "_sock", None)):
        if obj is not None:
            with contextlib.suppress(OSError):
                obj.close()


def _ns_pid(host_pid: int) -> int | None:
    try:
        with open(f"/proc/{host_pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        return None
    return None
