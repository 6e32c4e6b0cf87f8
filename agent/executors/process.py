"""Process executor: no Docker. A sandbox is the directory ``<root>/<sandbox>``; an action is ``sh -c cmd`` in
its own session, pinned to its cores from its first instruction, its output read by the event loop.

**Contained** (the default; docs/agent.md, "Process sandboxes"): every sandbox has a uid and gid of its own
(``users``: no passwd entry, from a range no account uses) that owns its directory (mode 0700, in a root-owned
parent: one sandbox cannot read another's files), and its actions run as that user with no capabilities,
no supplementary groups and ``no_new_privs``, so they cannot write root's files either. Each sandbox has
cgroups of its own (``proc_cgroups``): its ``mem`` (else ``sandbox_mem_mib``) as the memory limit of all its
actions together (past it the kernel's OOM killer kills, and the action reports exit 137 with neither
``killed`` nor ``timed_out``, as a Docker sandbox does), its ``pids_limit``, and per action a slot on exactly
the granted cores that is killed as a whole when the action ends (``setsid``, ``nohup``, double forks:
nothing outlives its action, nor the sandbox). Actions are started by a spawner per sandbox
(``proc_spawner``, sandbox mode) that joins the cgroups as root and then drops to the sandbox's user for good,
so it has nothing the sandbox's code does not have; it lives in the sandbox's cgroups and moves into the
action's slot for the ``posix_spawn`` and back after. ``put`` and ``get`` (``proc_files``) never follow a
symlink, and files put in a sandbox belong to its user. Where the host cannot give these guarantees (not
root; no cpuset, memory or pids controller; see ``proc_contain``) the executor refuses to start.

**Trusted code only** (``trusted_code_only``): the executor starts anyway and runs actions as before, as the
agent's own user: one spawner per agent (plain mode) that moves to the sandbox directory, pins itself to
the cores and ``posix_spawn``s, each action in a cgroup of its own (``cgroups``) where the agent can make
one, killed when the action ends; memory is limited with ``prlimit --as`` where available and asked for.
There is no other isolation.

Without a spawner (it could not start, or died), the agent spawns itself (``spawn.spawn_pinned``: the
spawning thread's affinity is inherited, no ``taskset`` exec) and watches the child through a pidfd; the
child is a shell that first moves itself into the action's cgroups and then, contained, execs ``setpriv``
to become the sandbox's user. ``recover`` kills what an earlier agent of this node left running.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import time

from agent.probe import mem_offer_mib, meminfo

from . import proc_files
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
from .proc_cgroups import SandboxCgroups
from .proc_contain import Containment, check, refusal, relocated, sandbox_home
from .proc_parts import (
    KILL_GRACE_S,
    _Action,
    _base_env,
    _read_json,
    _relocate,
    _Sandbox,
    _stop_spawner,
    _write_json,
    dropping_argv,
    joining_argv,
    process_argv,
    tidy_relocated,
)
from .spawn import ChildIO, ExitWatch, kill_group, spawn_pinned
from .spawner import Job, Spawner, SpawnerLost, plain_config, sandbox_config
from .users import CLAIMS_DIR, DEFAULT_BASE, DEFAULT_COUNT, UidPool, chown_tree, remove_owned

SPAWNER_TRIES, DEFAULT_PIDS = 3, 512  # failed spawner starts before the agent spawns itself; a sandbox's pids
log = logging.getLogger("agent.executors.process")


class ProcessExecutor:
    def __init__(self, root_dir: str, idle_cpus: str, mem_limit: bool = False, spawner: bool = True, *,
                 cluster: str = "default", node: str = "local", cgroups: bool | Hierarchy = True,
                 trusted_code_only: bool = False, sandbox_mem_mib: int | None = None,
                 uid_base: int = DEFAULT_BASE, uid_count: int = DEFAULT_COUNT, uid_claims: str = CLAIMS_DIR,
                 sandbox_base: str | None = None, containment: Containment | None = None) -> None:
        """``cluster``, ``node``: where the cgroups live (see ``cgroups``); ``cgroups``: False for none, True
        for the hierarchies found here, or the one to find and kill actions' processes in.
        ``trusted_code_only``: start without containment where the host cannot give it (else: refuse,
        ``proc_contain.ContainmentUnavailable``). ``sandbox_mem_mib``: the memory of a sandbox created
        without ``mem`` (default: what the node offers). ``uid_*``: the sandbox users (``users``).
        ``sandbox_base``: where contained sandboxes go when sandbox users cannot reach ``root_dir``
        (``proc_contain.sandbox_home``; ``root_dir`` becomes a symlink to them).
        ``containment``: what the host can give, when already known (default: ``proc_contain.check``).
        ``mem_limit`` (``prlimit --as``) is for trusted code only."""
        self.root = os.path.abspath(root_dir)
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
        self.sbcg: SandboxCgroups | None = None
        self._sandboxes: dict[str, _Sandbox] = {}
        self._adopt_lock: asyncio.Lock | None = None
        self._starting: set[asyncio.Task[None]] = set()
        given = cgroups if isinstance(cgroups, Hierarchy) else None
        home = sandbox_home(self.root, sandbox_base)
        found = containment or check(kill=given, use_cgroups=bool(cgroups), uid_base=uid_base,
                                     uid_count=uid_count, sandbox_root=home)
        missing = list(found.missing) or ([] if found.roles is not None else ["no cgroups"])
        if not missing:
            self.sbcg = self._open_cgroups(found, cluster, node, missing)
        self.contained = self.sbcg is not None
        if not self.contained:
            if not trusted_code_only:
                raise refusal(missing)
            log.warning("trusted_code_only: process sandboxes are NOT contained (%s); actions run as the "
                        "agent's own user (uid %d) with no limits", "; ".join(missing), os.geteuid())
            os.makedirs(self.root, mode=0o755, exist_ok=True)
            if cgroups:
                self.cgroups = ActionCgroups.open(cluster, node, given)
            return
        self._contain_root(home, uid_base, uid_count, uid_claims, sandbox_mem_mib)

    def _contain_root(self, home: str, uid_base: int, uid_count: int, uid_claims: str,
                      sandbox_mem_mib: int | None) -> None:
        """Contained sandboxes: their root at ``home`` (mode 0711), their users, their default memory."""
        self.configured_root = self.root
        self._closed = False
        self._relocated = relocated(self.root, home)
        if home != os.path.realpath(self.root):
            _relocate(self.root, home)
        self.root = home
        os.makedirs(self.root, mode=0o711, exist_ok=True)
        os.chmod(self.root, 0o711)  # sandbox users may pass through, not list or write
        self.uids = UidPool(uid_base, uid_count, uid_claims)
        if sandbox_mem_mib is None:
            sandbox_mem_mib = mem_offer_mib(meminfo())
        self.default_mem_mib = sandbox_mem_mib
        self._setpriv = shutil.which("setpriv")
        log.info("process sandboxes are contained: a user each (uids %d-%d), cgroups %s", uid_base,
                 uid_base + uid_count - 1, self.sbcg.roles.label if self.sbcg else "")

    def _open_cgroups(self, found: Containment, cluster: str, node: str,
                      missing: list[str]) -> SandboxCgroups | None:
        """The sandbox cgroups, tried for real (``missing`` gets why not)."""
        assert found.roles is not None
        sbcg = None
        try:
            sbcg = SandboxCgroups(found.roles, cluster, node)
            sbcg.probe([min(self.allowed)])
            return sbcg
        except (OSError, subprocess.SubprocessError) as exc:
            missing.append(f"cannot use cgroups for sandboxes ({found.roles.label}): {exc}")
            if sbcg is not None:
                with contextlib.suppress(OSError):
                    sbcg.close()
            return None

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

    def _meta(self, sandbox: str) -> str:
        """Root's record of a contained sandbox (its uid and limits): ``.<name>.json`` next to its directory
        (sandbox names cannot start with a dot)."""
        return os.path.join(self.root, f".{sandbox}.json")

    async def create_sandbox(self, spec: SandboxSpec) -> None:
        if not self.contained:
            os.makedirs(self._dir(spec.sandbox), mode=0o755, exist_ok=True)
            self._mem[spec.sandbox] = spec.mem_mib
            return
        self._dir(spec.sandbox)  # (checks the name)
        self._adopt_lock = self._adopt_lock or asyncio.Lock()
        async with self._adopt_lock:
            known = self._sandboxes.get(spec.sandbox)
            if known is not None:  # created again: new limits, same user, spawner and cgroups
                await asyncio.to_thread(self._ready, known.name, known.dir, known.uid, spec.mem_mib,
                                        spec.pids_limit)
                return
            sb = await asyncio.to_thread(self._create, spec)
            self._sandboxes[spec.sandbox] = sb
        if self.use_spawner:  # ready by the first action, usually
            task = asyncio.ensure_future(self._start_soon(sb))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_soon(self, sb: _Sandbox) -> None:
        await self._sandbox_spawner(sb)

    def _create(self, spec: SandboxSpec) -> _Sandbox:
        path = self._dir(spec.sandbox)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return self._adopt(spec.sandbox, spec.mem_mib, spec.pids_limit)
        try:
            uid = self.uids.claim(path)
        except BaseException:
            os.rmdir(path)
            raise
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchown(fd, uid, uid)
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            return self._ready(spec.sandbox, path, uid, spec.mem_mib, spec.pids_limit)
        except BaseException:
            self.uids.release(uid, path)
            shutil.rmtree(path, ignore_errors=True)
            raise

    def _adopt(self, sandbox: str, mem_mib: int = 0, pids_limit: int = 0) -> _Sandbox:
        """A sandbox directory this executor has not set up (an earlier agent's; or created again): its user
        (a new one, and its files chowned, when it has none of its own), its cgroups and limits."""
        path = self._dir(sandbox)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {sandbox!r}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise SandboxNotFound(f"no sandbox {sandbox!r}")
        meta = _read_json(self._meta(sandbox))
        uid = st.st_uid
        if not self.uids.holds(uid, path):
            uid = self.uids.claim(path)
            log.info("sandbox %s: its files now belong to its own user %d (were uid %d's)", sandbox, uid,
                     st.st_uid)
            chown_tree(path, uid, uid)
        os.chmod(path, 0o700)
        return self._ready(sandbox, path, uid, mem_mib or int(meta.get("mem_mib") or 0),
                           pids_limit or int(meta.get("pids_limit") or 0))

    def _ready(self, sandbox: str, path: str, uid: int, mem_mib: int, pids_limit: int) -> _Sandbox:
        assert self.sbcg is not None
        mem_mib, pids_limit = mem_mib or self.default_mem_mib, pids_limit or DEFAULT_PIDS
        _write_json(self._meta(sandbox), {"uid": uid, "mem_mib": mem_mib, "pids_limit": pids_limit})
        cg = self.sbcg.sandbox(sandbox, mem_mib, pids_limit)
        return _Sandbox(sandbox, path, uid, cg)

    async def _sandbox(self, sandbox: str) -> _Sandbox:
        """A contained sandbox by name (set up again after an agent restart); SandboxNotFound without one."""
        sb = self._sandboxes.get(sandbox)
        if sb is not None:
            return sb
        self._dir(sandbox)  # (checks the name)
        self._adopt_lock = self._adopt_lock or asyncio.Lock()
        async with self._adopt_lock:
            sb = self._sandboxes.get(sandbox)
            if sb is None:
                sb = self._sandboxes[sandbox] = await asyncio.to_thread(self._adopt, sandbox)
        return sb

    async def destroy_sandbox(self, sandbox: str) -> None:
        path = self._dir(sandbox)
        if not self.contained:
            self._mem.pop(sandbox, None)
            await asyncio.to_thread(shutil.rmtree, path, ignore_errors=True)
            return
        sb = self._sandboxes.pop(sandbox, None)
        if sb is not None:
            sb.gone = True
            if sb.spawner is not None:
                await _stop_spawner(sb.spawner, "the sandbox is destroyed")
        await asyncio.to_thread(self._destroy, sandbox, path, sb)

    def _destroy(self, sandbox: str, path: str, sb: _Sandbox | None) -> None:
        """Kill everything of the sandbox (its cgroups), remove its files (and what its user left in /tmp,
        /var/tmp and /dev/shm) and give its uid back. Idempotent."""
        assert self.sbcg is not None
        group = sb.cg if sb is not None else self.sbcg.sandboxes.get(sandbox)
        if group is not None:
            self.sbcg.remove_sandbox(group)
        try:
            uid = sb.uid if sb is not None else os.lstat(path).st_uid
        except FileNotFoundError:
            uid = int(_read_json(self._meta(sandbox)).get("uid") or -1)
        shutil.rmtree(path, ignore_errors=True)  # fd-based: never follows the sandbox's symlinks
        if uid in self.uids:
            remove_owned(uid)
            self.uids.release(uid, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._meta(sandbox))
        if self._closed:
            if self._relocated:
                tidy_relocated(self.root, self.configured_root)

    async def list_sandboxes(self) -> list[str]:
        try:
            with os.scandir(self.root) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:  # (a relocated place, tidied up after close)
            return []

    async def run(self, req: RunRequest) -> RunResult:
        if self.contained:
            return await self._run_contained(req)
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

    async def _run_contained(self, req: RunRequest) -> RunResult:
        check_request(req, self.allowed)
        if req.action in self._actions:
            raise ExecutorError(f"action {req.action!r} is already running")
        assert self.sbcg is not None
        t0 = time.monotonic()
        sb = await self._sandbox(req.sandbox)
        cmd, env = expand_dop(req.cmd, req.dop, {**_base_env(), "HOME": sb.dir, **req.env})
        argv = ["/bin/sh", "-c", cmd]
        act = self._actions[req.action] = _Action(sb=sb)
        try:
            act.slot = self.sbcg.take(sb.cg, req.cores)
            spawner = await self._sandbox_spawner(sb)
            if spawner is not None:
                res = await self._run_spawned(req, act, spawner, argv, env, sb.dir, t0)
            else:
                if self._setpriv is None:
                    raise ExecutorError(f"sandbox {sb.name!r} has no spawner, and there is no setpriv for "
                                        "the agent to start its action as the sandbox's user")
                drop = dropping_argv(self.sbcg.all_joins(sb.cg, act.slot), (sb.uid, sb.uid), self._setpriv,
                                     argv)
                res = await self._run_here(req, act, drop, env, sb.dir, t0)
        finally:
            try:
                await self._end_cgroup(act)
            finally:
                del self._actions[req.action]
        if res.exit_code == 137 and not (res.killed or res.timed_out):
            kills = self.sbcg.oom_kills(sb.cg)
            if kills > sb.cg.oom_seen:
                sb.cg.oom_seen = kills
                log.info("action %s: killed by the OOM killer at the memory limit of sandbox %s (%d MiB)",
                         req.action, sb.name, sb.cg.mem_mib)
        return res

    async def _sandbox_spawner(self, sb: _Sandbox) -> Spawner | None:
        """The sandbox's spawner, started on first use; None: the agent spawns its actions itself."""
        if not self.use_spawner or sb.failures >= SPAWNER_TRIES:
            return None
        if sb.spawner is not None and sb.spawner.alive:
            return sb.spawner
        sb.lock = sb.lock or asyncio.Lock()
        async with sb.lock:
            if sb.gone:
                return None
            if sb.spawner is None or not sb.spawner.alive:
                assert self.sbcg is not None
                try:
                    home, join = self.sbcg.spawner_cgroups(sb.cg)
                    sp = await Spawner.start(sandbox_config(home, join, sb.dir, (sb.uid, sb.uid)))
                except (ExecutorError, OSError) as exc:
                    sb.failures += 1
                    fallback = sb.failures >= SPAWNER_TRIES
                    log.warning("sandbox %s: no spawner (%s)%s", sb.name, exc,
                                ": the agent spawns its actions itself" if fallback else "")
                    return None
                sb.failures = 0
                if sb.gone:  # destroyed meanwhile
                    await _stop_spawner(sp, "the sandbox is destroyed")
                    return None
                sb.spawner = sp
        return sb.spawner

    async def _end_cgroup(self, act: _Action) -> None:
        """Kill what the action left in its cgroup (setsid daemons too): an empty one goes back to the pool at
        once; one with processes left is emptied and removed in a worker thread. Idempotent."""
        if act.slot is not None:
            await self._end_slot(act)
            return
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

    async def _end_slot(self, act: _Action) -> None:
        slot, act.slot = act.slot, None
        assert slot is not None
        assert act.sb is not None
        assert self.sbcg is not None
        pending = act.job is not None and not act.job.exit.done()  # cancelled: the spawn may still come
        if not pending and self.sbcg.give_back(act.sb.cg, slot):
            return
        spare = (act.spawner.pid,) if act.spawner is not None else ()  # it passes through while spawning
        if act.spawner is not None:
            act.spawner.forget(slot.dirs[0])  # (what it kept for the slot is of no use any more)
        try:
            left = await asyncio.to_thread(self.sbcg.remove, slot, spare)
        except OSError as exc:
            log.error("cannot clean up the cgroups of an action of sandbox %s: %s", act.sb.name, exc)
            return
        log.debug("killed %d processes left by the action in %s", left, slot.dirs[0])

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
            except SpawnerLost:  # its sandbox's destroy stopped the spawner before it reported the exit
                if not (act.killed or (act.sb is not None and act.sb.gone)):
                    raise
                act.killed, returncode = True, -signal.SIGKILL  # (a killed action, as fastrun's _exit_code)
            await self._end_cgroup(act)  # the rest of the tree: its output ends with it
            await io.wait_eof(KILL_GRACE_S)
        finally:
            io.close()
        return self._result(req, io, returncode, act.timed_out, act, t0, setup_s)

    def _send_spawn(self, act: _Action, spawner: Spawner, argv: list[str], env: dict[str, str],
                    fds: tuple[int, ...], cwd: str, cores: tuple[int, ...]) -> Job:
        """The spawn request, with the files of the action's cgroups (``join_file``s: its slot, or its cgroup)
        for the spawner to move into; a sandbox's spawner keeps a slot's files, so they go once per slot
        (``Spawner.spawn(slot=...)``). A sandbox's spawner has its directory already."""
        where = {"cores": sorted(cores)} if act.slot is not None else {"cwd": cwd, "cores": sorted(cores)}
        if act.slot is not None:
            assert act.sb is not None
            assert self.sbcg is not None
            sbcg, cg, slot = self.sbcg, act.sb.cg, act.slot
            # (a slot's name is never reused while its sandbox, and spawner, lives)
            return spawner.spawn_joining(argv, env, fds, lambda: sbcg.request_joins(cg, slot),
                                         slot=slot.dirs[0], **where)
        if act.cg is not None:
            assert self.cgroups is not None
            h, own = self.cgroups.h, act.cg
            return spawner.spawn_joining(argv, env, fds, lambda: [join_file(h, own)], **where)
        return spawner.spawn(argv, env, fds, **where)

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
        parts = split_relpath(path)
        if not self.contained:
            await asyncio.to_thread(write_nofollow, self._dir(sandbox), parts, data)
            return
        sb = await self._sandbox(sandbox)
        await asyncio.to_thread(proc_files.put, sb.dir, parts, data, sb.uid, sb.uid)

    async def get(self, sandbox: str, path: str, max_bytes: int = DEFAULT_GET_CAP) -> bytes:
        parts = split_relpath(path)
        if not self.contained:
            return await asyncio.to_thread(read_nofollow, self._dir(sandbox), parts, max_bytes)
        sb = await self._sandbox(sandbox)
        return await asyncio.to_thread(proc_files.get, sb.dir, parts, max_bytes, sb.uid)

    async def close(self) -> None:
        for action in list(self._actions):
            await self.kill(action)
        exits = [a.job.exit for a in self._actions.values() if a.job is not None]
        if exits:  # let the spawners report them before they go
            await asyncio.wait(exits, timeout=KILL_GRACE_S)
        for task in list(self._starting):
            task.cancel()
        if self._starting:
            await asyncio.wait(list(self._starting), timeout=KILL_GRACE_S)
        stops = [_stop_spawner(sb.spawner, "the agent stops") for sb in self._sandboxes.values()
                 if sb.spawner is not None]
        if stops:
            await asyncio.gather(*stops)
        if self._spawner is not None:
            await self._spawner.close()
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.close)
        if self.sbcg is not None:
            await asyncio.to_thread(self.sbcg.close)
            self._closed = True
            if self._relocated:
                tidy_relocated(self.root, self.configured_root)

    async def recover(self) -> Reaped | None:
        """Before the agent says Hello: kill and remove what earlier agents of this node left in their action
        cgroups (the sandbox directories stay). None without action cgroups."""
        cgs = self.sbcg or self.cgroups
        if cgs is None:
            return None
        found = await asyncio.to_thread(cgs.reap_predecessors)
        log.info("recovery: %d earlier agents of this node found, %d processes killed in %d of their "
                 "cgroups%s", found.incarnations, found.processes, found.cgroups,
                 f"; {found.skipped} of a live agent left alone" if found.skipped else "")
        return found
