"""Docker executor: one long-lived container per sandbox, cores granted per action.

Two exec paths (``mode``):

* ``fastpath`` (root, cgroup v1 or v2, ``nsenter``): write the container's ``cpuset.cpus`` directly and read
  it back, create the action's sub-cgroup with exactly the granted cores, and start the command through the
  sandbox's spawner (``spawner``/``nsspawner``: a small process started once per sandbox, already in the
  container's namespaces and cgroups, which forks the action), or, where there is no spawner, as a child of
  the agent that joins the container's cgroups and enters its namespaces (``fastpath.nsenter_argv``).
  See ``fastrun``. Kill = SIGKILL every process in the action's sub-cgroup.
* ``docker``: ``container.update(cpuset_cpus=...)`` then ``exec_create``/``exec_start(socket=True)``;
  kill = ``kill -9 -<pgid>`` inside the container (runc makes each exec a session leader).

``auto`` picks ``fastpath`` when it is possible. Concurrency: actions on different sandboxes are independent.
Actions sharing a sandbox are allowed; the container's cpuset is then the union of their grants (on the
fast path each still runs on exactly its own cores). Between actions the container sits on the idle set.

Containment (``docker_limits``): sandbox code runs as an unprivileged user (``SandboxLimits.user``) with no
capabilities and ``no_new_privs`` on every path; the container has no network, a pids limit, a memory limit
(a default when the request names none), a disk limit, and with the hostroot image an ``/etc`` of the
agent's making (``sandbox_etc``), not the host's. Whatever an action starts ends with it: on the fast path
its sub-cgroup is emptied, on the ``docker`` path the sandbox is swept (``docker_sweep``) before its cores
go back to the idle set.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import docker.errors
from docker.utils.socket import frames_iter

from . import archive, docker_sweep, fastpath, fastrun, leftovers, sandbox_etc
from .base import (
    DEFAULT_GET_CAP,
    WORKDIR,
    ExecutorError,
    OutputCollector,
    RunRequest,
    RunResult,
    SandboxNotFound,
    SandboxSpec,
    TooLarge,
    check_name,
    check_request,
    expand_dop,
    format_cpuset,
    parse_cpuset,
    parse_owner,
    read_nofollow,
    split_relpath,
    write_nofollow,
)
from .docker_limits import (
    DEFAULT_DISK_MIB,
    DEFAULT_USER,
    SandboxLimits,
    choose_disk,
    default_mem_mib,
    disk_kwargs,
    keeper_for,
    mem_kwargs,
    user_str,
)
from .docker_pool import LABEL_POOL, SandboxPool, sandbox_of
from .images import HOSTROOT_IMAGE, hostroot_mounts
from .spawner import Spawner, container_config

LABEL_CLUSTER = "tangram.cluster"  # the cluster's name (for people: two clusters may share a name)
# The cluster's unique id (``tangram up`` makes one per cluster): what an agent lists, adopts and sweeps,
# and what ``tangram down`` removes. Containers without it were made by a cluster without an id (legacy).
LABEL_CLUSTER_ID = "tangram.cluster-id"
LABEL_SANDBOX = "tangram.sandbox"
LABEL_NODE = "tangram.node"  # the agent (node name) that created it: a restarted agent cleans only its own
LABEL_USER = leftovers.LABEL_USER  # the sandbox user (uid:gid); the container's own user is the keeper
OWN_LABELS = (LABEL_CLUSTER, LABEL_CLUSTER_ID, LABEL_SANDBOX)  # set by the agent whatever a request says
KILL_GRACE_S = 5.0
SPAWNER_TRIES = 3  # spawner starts that may fail per sandbox before it keeps to the nsenter path
log = logging.getLogger("agent.executors.docker")


def container_name(cluster: str, sandbox: str, cluster_id: str = "") -> str:
    """``tangram-<cluster>-<id>-<sandbox>``: unique on the daemon, even for two clusters of one name."""
    return f"tangram-{cluster}-{cluster_id}-{sandbox}" if cluster_id else f"tangram-{cluster}-{sandbox}"


def own_filter(cluster: str, cluster_id: str) -> dict[str, list[str]]:
    """The ``containers.list`` filter for a cluster's containers (``is_own`` finishes the job)."""
    if cluster_id:
        return {"label": [f"{LABEL_CLUSTER_ID}={cluster_id}"]}
    return {"label": [f"{LABEL_CLUSTER}={cluster}"]}


def is_own(labels: dict[str, str], cluster: str, cluster_id: str) -> bool:
    """Whether a container with ``labels`` belongs to this cluster: the same id; without an id (legacy),
    the same name and no id at all, so an agent without one never touches a cluster that has one."""
    if cluster_id:
        return labels.get(LABEL_CLUSTER_ID) == cluster_id
    return labels.get(LABEL_CLUSTER) == cluster and LABEL_CLUSTER_ID not in labels


def sandbox_owner(spec: SandboxSpec, limits: SandboxLimits) -> tuple[int, int]:
    """The uid and gid sandbox code runs as: the spec's, else the agent's default."""
    owner = parse_owner(spec.user or limits.user)
    assert owner is not None
    return owner


DEFAULT_LIMITS = SandboxLimits()


def container_kwargs(spec: SandboxSpec, cluster: str, idle_cpus: str, image: str, node: str = "",
                     limits: SandboxLimits = DEFAULT_LIMITS, etc_dir: str | None = None,
                     cluster_id: str = "") -> dict[str, Any]:
    """Pure: the ``containers.run`` arguments for a sandbox (``etc_dir``: its ``/etc`` with the hostroot
    image, see ``sandbox_etc``; ``cluster_id``: the cluster's unique id, labelled and in the name)."""
    owner = sandbox_owner(spec, limits)
    labels = {**spec.labels, LABEL_CLUSTER: cluster, LABEL_SANDBOX: spec.sandbox, LABEL_USER: user_str(owner)}
    labels.pop(LABEL_CLUSTER_ID, None)  # only the agent's own id, never one from the request
    if cluster_id:
        labels[LABEL_CLUSTER_ID] = cluster_id
    if node:
        labels[LABEL_NODE] = node
    kw: dict[str, Any] = dict(
        image=image, command=["sleep", "infinity"], name=container_name(cluster, spec.sandbox, cluster_id),
        detach=True, init=True, network_mode="none", **mem_kwargs(spec.mem_mib, limits),
        pids_limit=spec.pids_limit,
        cap_drop=["ALL"], security_opt=["no-new-privileges"], cpuset_cpus=idle_cpus, working_dir=WORKDIR,
        labels=labels, user=user_str(keeper_for(owner)), environment={"HOME": WORKDIR},
        **disk_kwargs(limits, owner),
    )
    if image == HOSTROOT_IMAGE:
        kw["volumes"] = hostroot_mounts(etc_dir)
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
    owner: tuple[int, int] | None = None  # the sandbox user as numbers (None: the container's root)
    nsenter_ok: bool = False  # the nsenter chain can take every privilege away (see _attach)
    active: dict[str, tuple[int, ...]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    spawner: Spawner | None = None
    spawner_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    spawner_failures: int = 0
    slots: fastpath.SlotPool | None = None  # the actions' sub-cgroups (fast path)
    sweepable: bool = False  # the container's init runs as the keeper: docker_sweep may kill all of `user`
    procs_dir: str | None = None  # the container's own cgroup, where docker_sweep looks (None: cannot)
    dirty: bool = False  # a docker exec ran since the last sweep
    destroying: bool = False  # destroy_sandbox has begun: a job whose spawner goes reads as killed

    def __post_init__(self) -> None:
        if self.cg is not None:
            self.slots = fastpath.SlotPool(self.cg)


@dataclass
class _Action:
    sandbox: _Sandbox
    fast: fastrun.FastAction = field(default_factory=fastrun.FastAction)
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
                 mode: str = "auto", spawner: bool = True, node: str = "", *, user: str = DEFAULT_USER,
                 mem_mib: int | None = None, disk_mib: int = DEFAULT_DISK_MIB,
                 workdir: str | None = None, cluster_id: str = "", pool_max: int = 0,
                 pool_concurrency: int = 1, pool_labels: dict[str, str] | None = None) -> None:
        """``node``: the agent's node name, labelled on the containers it creates (``LABEL_NODE``).
        ``cluster_id``: the cluster's unique id (``LABEL_CLUSTER_ID``, see ``is_own``); "" for a cluster
        without one, whose containers are then told apart by name only.
        ``user``, ``mem_mib`` (None: ``docker_limits.default_mem_mib``), ``disk_mib``: see
        ``docker_limits.SandboxLimits``; raises ConfigError when this dockerd cannot enforce ``disk_mib``.
        ``workdir``: the agent's, where the hostroot sandboxes' ``/etc`` is written (None: ``~/.tangram``).
        ``pool_max`` > 0: keep warm sandbox pools of at most that many idle containers (``docker_pool``;
        ``pool_concurrency`` made at once, each with ``pool_labels``); 0: none."""
        if mode not in ("auto", "fastpath", "docker"):
            raise ValueError(f"`mode` must be auto, fastpath or docker, got {mode!r}")
        self.client, self.cluster, self.image_default = client, check_name("cluster", cluster), image_default
        self.cluster_id = check_name("cluster id", cluster_id) if cluster_id else ""
        self.idle = parse_cpuset(idle_cpus)
        self.idle_cpus = format_cpuset(self.idle)
        fast_ok = os.geteuid() == 0 and shutil.which("nsenter") is not None
        if mode == "fastpath" and not fast_ok:
            raise ExecutorError("fastpath needs root and nsenter")
        self.fast = mode == "fastpath" or (mode == "auto" and fast_ok)
        self.mode = mode
        self.node = node
        self.use_spawner = spawner and self.fast and hasattr(os, "pidfd_open")
        self.limits = SandboxLimits(user, default_mem_mib(mem_mib), disk_mib,
                                    choose_disk(client, disk_mib, image_default))
        self.etc_root = os.path.join(workdir or os.path.expanduser("~/.tangram"), "sandbox-etc")
        self._etc: dict[tuple[int, int], str] = {}
        self._sandboxes: dict[str, _Sandbox] = {}
        self._actions: dict[str, _Action] = {}
        self._cold = 0  # sandboxes being created without the pool
        self.pool = SandboxPool(self, os.path.dirname(self.etc_root), max_idle=pool_max,
                                concurrency=pool_concurrency, labels=pool_labels) if pool_max > 0 else None

    # ------------------------------------------------------------ sandboxes

    def claim_sandbox(self, spec: SandboxSpec) -> bool:
        """A warm sandbox of ``spec``'s shape from the pool, claimed for it at once; False: none ready."""
        if self.pool is None or check_name("sandbox", spec.sandbox) in self._sandboxes:
            return False
        sb = self.pool.take(spec, self.pool.shape_of(spec, OWN_LABELS))
        if sb is not None:
            self._sandboxes[spec.sandbox] = sb
        return sb is not None

    async def create_sandbox(self, spec: SandboxSpec) -> None:
        if self.claim_sandbox(spec):
            return
        check_name("sandbox", spec.sandbox)
        self._cold += 1
        try:
            kw = await asyncio.to_thread(self._kwargs, spec)
            self._sandboxes[spec.sandbox] = await self._make(spec, kw)
        finally:
            self._cold -= 1
            if self.pool is not None:
                self.pool.wake()

    def _kwargs(self, spec: SandboxSpec) -> dict[str, Any]:
        """Blocking (writes the hostroot ``/etc`` once): the ``containers.run`` arguments of a sandbox."""
        image = spec.image or self.image_default
        etc_dir = self._etc_dir(sandbox_owner(spec, self.limits)) if image == HOSTROOT_IMAGE else None
        return container_kwargs(spec, self.cluster, self.idle_cpus, image, self.node, self.limits, etc_dir,
                                self.cluster_id)

    async def _make(self, spec: SandboxSpec, kw: dict[str, Any], call: Any = asyncio.to_thread) -> _Sandbox:
        """Run the container of ``kw``; ``call`` runs each blocking step (the pool has threads of its own)."""
        container = await call(self.client.containers.run, **kw)
        try:
            if self.limits.disk != "tmpfs":  # the sandbox user owns its workdir (a tmpfs is made so)
                owner = sandbox_owner(spec, self.limits)
                await call(archive.chown_dir, self.client.api, container.id, WORKDIR, owner)
            sb = await call(self._attach, container)
            await self._spawner(sb)  # started now, so that the first action does not wait for it
        except BaseException:
            await call(container.remove, force=True, v=True)
            raise
        return sb

    def _etc_dir(self, owner: tuple[int, int]) -> str:
        """The hostroot sandboxes' ``/etc`` for this sandbox user (written once per agent and user)."""
        found = self._etc.get(owner)
        if found is None or not os.path.isdir(found):
            found = self._etc[owner] = sandbox_etc.ensure(self.etc_root, owner, keeper_for(owner))
        return found

    def _attach(self, container: Any) -> _Sandbox:
        container.reload()
        pid = int(container.attrs["State"]["Pid"])
        env = _env_list_to_dict(container.attrs["Config"].get("Env"))
        name = container.labels.get(LABEL_SANDBOX, "")
        # made here: the label names the sandbox user; made before there were labels: the container's user
        user = container.labels.get(LABEL_USER) or container.attrs["Config"].get("User") or None
        owner = parse_owner(user) if user else None
        setpriv = _setpriv_flavour(pid) if self.fast else ()
        # The nsenter chain starts from the agent's root: it may only run sandbox code where the image's
        # setpriv can take every privilege away (util-linux: no bounding set, for root too; busybox: only
        # no_new_privs, enough for a user that is not root, as the uid change clears its capabilities).
        # Elsewhere the spawner (which always drops them itself) or docker exec run it.
        nsenter_ok = setpriv == fastpath.SETPRIV_FULL or (
            setpriv == fastpath.SETPRIV_NNP and owner is not None and owner[0] != 0)
        cg = fastpath.discover(pid) if self.fast and (nsenter_ok or self.use_spawner) else None
        sb = _Sandbox(name, container.id, pid, env, user, cg, setpriv, owner, nsenter_ok)
        sb.sweepable = LABEL_USER in container.labels and owner is not None
        sb.procs_dir = cg.cpuset if cg is not None else docker_sweep.container_procs_dir(pid)
        return sb

    async def _spawner(self, sb: _Sandbox) -> Spawner | None:
        """The sandbox's live spawner, started on first use; None: take another path."""
        if not self.use_spawner or sb.cg is None:
            return None
        if sb.spawner is not None and sb.spawner.alive:
            return sb.spawner
        async with sb.spawner_lock:
            if sb.spawner is not None and sb.spawner.alive:
                return sb.spawner
            if sb.spawner_failures >= SPAWNER_TRIES:
                return None
            if sb.spawner is not None:
                await sb.spawner.close()
            sb.spawner = None
            try:
                sb.spawner = await Spawner.start(container_config(
                    sb.pid, sb.cid, home=fastpath.join_file(sb.cg.cpuset, sb.cg.v2),
                    join=[fastpath.procs_file(d) for d in sb.cg.others], user=sb.owner))
            except (ExecutorError, OSError) as exc:
                sb.spawner_failures += 1
                log.warning("sandbox %s: no spawner (%s); actions take the %s path", sb.name, exc,
                            "nsenter" if sb.nsenter_ok else "docker exec")
                return None
        return sb.spawner

    async def _sandbox(self, name: str) -> _Sandbox:
        sb = self._sandboxes.get(check_name("sandbox", name))
        if sb is not None:
            return sb

        try:  # adopt a sandbox created by an earlier agent (reconciliation)
            container = await asyncio.to_thread(self.client.containers.get, self._name(name))
        except docker.errors.NotFound:
            raise SandboxNotFound(f"no sandbox {name!r}") from None
        if not is_own(container.labels, self.cluster, self.cluster_id):
            raise SandboxNotFound(f"no sandbox {name!r} of this cluster")
        sb = self._sandboxes[name] = await asyncio.to_thread(self._attach, container)
        sb.name = name  # a claimed pooled container has no sandbox label
        return sb

    async def destroy_sandbox(self, sandbox: str) -> None:
        sb = self._sandboxes.pop(check_name("sandbox", sandbox), None)
        if sb is not None:
            sb.destroying = True
        if sb is not None and sb.spawner is not None:  # it sits in the container's cgroups: out first
            await sb.spawner.close()
        if sb is not None and sb.slots is not None:
            sb.slots.remove_all()
        name = sb.cid if sb is not None else self._name(sandbox)  # the id: a claim's rename may be pending
        with contextlib.suppress(docker.errors.NotFound):
            container = await asyncio.to_thread(self.client.containers.get, name)
            if self._own(container):
                await asyncio.to_thread(container.remove, force=True, v=True)  # v: its tmpfs volumes too

    async def list_sandboxes(self) -> list[str]:
        flt = own_filter(self.cluster, self.cluster_id)
        # one call and no inspects: a container removed meanwhile cannot fail the listing
        found = await asyncio.to_thread(self.client.api.containers, all=True, filters=flt)
        names = {self._sandbox_of(c.get("Labels") or {}, c["Names"][0]) for c in found
                 if is_own(c.get("Labels") or {}, self.cluster, self.cluster_id)}
        names.update(self.pool.pending().values() if self.pool is not None else ())
        return sorted(n for n in names if n)

    def _sandbox_of(self, labels: dict[str, str], name: str) -> str | None:
        """The sandbox a container holds: its label, or (claimed from a pool) its name; None: pooled, idle."""
        if LABEL_POOL in labels and LABEL_SANDBOX not in labels:
            return sandbox_of(name, self._name(""))
        return labels.get(LABEL_SANDBOX, "")

    def busy_cores(self) -> set[int]:
        """Cores running an action now."""
        return {c for sb in self._sandboxes.values() for grant in sb.active.values() for c in grant}

    def _name(self, sandbox: str) -> str:
        return container_name(self.cluster, sandbox, self.cluster_id)

    def _own(self, container: Any) -> bool:
        return is_own(container.labels, self.cluster, self.cluster_id)

    async def recover(self) -> leftovers.Leftovers:
        """Before the agent says Hello: kill the actions an earlier agent of this node left running in its
        containers (see ``leftovers``); the containers and their files stay, for the controller to adopt."""
        found = await asyncio.to_thread(self._recover)
        log.info("recovery: %d running sandboxes of this node checked: %d processes killed in %d action "
                 "cgroups, %d old spawners and %d docker execs killed, %d left processes swept",
                 found.containers, found.processes, found.slots, found.spawners, found.execs, found.swept)
        if self.pool is not None:
            await self.pool.recover()
        return found

    def _recover(self) -> leftovers.Leftovers:
        flt = {**own_filter(self.cluster, self.cluster_id), "status": "running"}
        mine = [c for c in self.client.containers.list(filters=flt)  # no node label: made before labels
                if self._own(c) and c.labels.get(LABEL_NODE) in (None, self.node)]

        def one(c: Any) -> leftovers.Leftovers:
            try:
                return leftovers.reap_container(self.client.api, c.id, self.fast)
            except Exception as exc:  # noqa: BLE001 - e.g. removed meanwhile
                log.warning("recovery: cannot check sandbox container %s: %s", c.name, exc)
                return leftovers.Leftovers()

        out = leftovers.Leftovers()
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="recover") as pool:  # an inspect per box
            for found in pool.map(one, mine):
                out.add(found)
        return out

    async def close(self) -> None:
        for action in list(self._actions):
            await self.kill(action)
        exits = [a.fast.job.exit for a in self._actions.values() if a.fast.job is not None]
        if exits:  # let the spawners report them before they go
            await asyncio.wait(exits, timeout=KILL_GRACE_S)
        for sb in list(self._sandboxes.values()):
            if sb.spawner is not None:
                await sb.spawner.close()
        if self.pool is not None:
            await self.pool.close()

    # ------------------------------------------------------------ cpusets

    async def _apply_cpuset(self, sb: _Sandbox) -> None:
        """Container cpuset := union of active grants, or the idle set when none."""
        cores = sorted({c for g in sb.active.values() for c in g}) or list(self.idle)
        cpus = format_cpuset(cores)
        if sb.slots is not None:  # (the fast path)
            try:
                sb.slots.set_cpus(cpus)
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
                if await self._spawner(sb) is not None:
                    return await fastrun.run_spawned(req, act.fast, sb, t0)
                if sb.nsenter_ok:
                    return await fastrun.run_nsenter(req, act.fast, sb, t0)
            return await self._run_docker(req, act, t0)
        finally:
            del self._actions[req.action]
            async with sb.lock:
                sb.active.pop(req.action, None)
                if sb.dirty and not sb.active:  # before the cores go: nothing of it may stay on them
                    await self._sweep(sb)
                await self._apply_cpuset(sb)

    async def _sweep(self, sb: _Sandbox) -> None:
        """After the last running action of a sandbox that took the docker exec path: kill what it left."""
        sb.dirty = False
        if not sb.sweepable or sb.owner is None:
            return
        spare = (sb.spawner.pid,) if sb.spawner is not None else ()
        try:
            await asyncio.to_thread(docker_sweep.sweep, self.client.api, sb.cid, sb.user or "", sb.owner[0],
                                    sb.procs_dir, spare)
        except Exception as exc:  # noqa: BLE001 - docker.errors.*: e.g. the container is gone
            log.warning("sandbox %s: cannot sweep what its actions left: %s", sb.name, exc)

    async def _run_docker(self, req: RunRequest, act: _Action, t0: float) -> RunResult:
        sb = act.sandbox
        cmd, env = expand_dop(req.cmd, req.dop, req.env)
        api = self.client.api
        exec_id = (await asyncio.to_thread(
            api.exec_create, sb.cid, ["sh", "-c", cmd], stdin=req.stdin is not None, environment=env,
            workdir=WORKDIR, user=sb.user or ""))["Id"]
        act.exec_id = exec_id
        sb.dirty = True
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
        except TimeoutError:
            timed_out = True
            await self._kill_docker(act, exec_id)
        try:
            await asyncio.wait_for(asyncio.shield(reader), KILL_GRACE_S)
        except TimeoutError:  # a leftover still holds the stream: stop reading
            with contextlib.suppress(OSError):
                getattr(sock, "_sock", sock).shutdown(2)
            await reader
        return timed_out

    async def _kill_docker(self, act: _Action, exec_id: str) -> None:
        sb = act.sandbox
        await asyncio.to_thread(leftovers.kill_exec, self.client.api, sb.cid, sb.user or "", exec_id)
        async with sb.lock:  # the action's background processes too, unless another action runs there
            if sb.dirty and len(sb.active) <= 1:
                await self._sweep(sb)

    async def kill(self, action: str) -> bool:
        act = self._actions.get(action)
        if act is None:
            return False
        act.killed = act.fast.killed = True
        if act.fast.sub_cg is not None:
            await act.fast.kill()
        elif act.exec_id is not None:
            await self._kill_docker(act, act.exec_id)
        return True

    # ------------------------------------------------------------ files

    async def put(self, sandbox: str, path: str, data: bytes) -> None:
        sb = await self._sandbox(sandbox)
        parts = split_relpath(path)
        try:
            if sb.cg is not None:
                await asyncio.to_thread(write_nofollow, self._workdir(sb), parts, data, sb.owner)
            else:
                await asyncio.to_thread(archive.put, self.client.api, sb.cid, WORKDIR, parts, data, sb.owner)
        except (OSError, docker.errors.APIError) as exc:
            if getattr(exc, "errno", None) == errno.ENOSPC or "no space left" in str(exc).lower():
                raise TooLarge(f"{path!r}: no space left in the sandbox's workdir "
                               f"(disk limit {self.limits.disk_mib} MiB)") from None
            raise

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


