"""The embedded local default (docs/operations.md §2), and the pieces `up` shares with SSH.

`tangram up` with no inventory starts cluster ``local``: the controller and one agent as detached
processes on this machine (``setsid``, stdio to log files under ``clusters/local/logs/``), on
127.0.0.1 free ports, no SSH, with CURVE keys in the cluster's 0700 ``certs/`` directory (only this
user can connect as an agent or a client; ``curve=False``, `tangram up --insecure`, runs plain TCP,
which any local user can use: development only). The executor is ``docker`` when dockerd answers
(then the ``tangram/hostroot:1`` image is imported if missing), else ``process``; without NVML GPUs the
node gets emulated ones (8 x 80 GiB unless ``--gpus``/``--gpu-mem``). ``--sandbox-pool`` and ``--job``
(local_flags.py) add warm sandbox pools (Docker only) and RL jobs to the controller's configuration.

The controller is started from its resolved configuration (``controller.json``, built by
``controller_config`` from the inventory: tangram_cli/inventory/configs.py), reports its ports
through ``--ready-file``, and `up` then blocks until every agent shows up in the controller's status
records. `up` on a recorded cluster keeps what runs; a controller that died is restarted in place
(restart.py); the process helpers live in procs.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tangram.errors import ConfigError, TangramError
from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.bootstrap import procs, restart
from tangram_cli.errors import BootstrapError

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from tangram_cli.bootstrap.local_flags import LocalExtras
    from tangram_cli.controller.config import ControllerConfig
    from tangram_cli.inventory import Inventory, Node

# Imported where used, not here (start-up cost: `tangram down` and the other callers of this module's
# helpers load it in ~0.1 s): docker-py (~0.3 s) and the modules that need it, pynvml, the process
# executor's containment check (~0.1 s), and the inventory with the configurations it makes
# (tangram_cli.inventory: pydantic and yaml, ~0.35 s), which only starting a cluster needs.

HOSTROOT_IMAGE = "tangram/hostroot:1"
DEFAULT_LOCAL_GPUS = 8
DEFAULT_LOCAL_GPU_MEM_MIB = 80 * 1024

# Callers (`down`, tests) reach the process helpers through this module too.
is_up = procs.is_up
parse_ready = procs.parse_ready
start_controller = procs.start_controller
stop_local_agents = procs.stop_local_agents
terminate = procs.terminate
wait_registered = procs.wait_registered


# ---------------------------------------------------------------- machine facts


def docker_answers(timeout_s: float = 3.0) -> bool:
    """True when ``docker.from_env().ping()`` succeeds."""
    try:
        import docker  # start-up cost: see the note at the top

        client = docker.from_env(timeout=int(max(1, timeout_s)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 (any failure means "no docker")
        return False


def ensure_hostroot() -> None:
    """Import ``tangram/hostroot:1`` if missing, then start one throw-away sandbox-like container
    (``--init --network none``, host directories read-only) to prove dockerd can run them."""
    import docker  # start-up cost: see the note at the top

    from agent.executors.images import ensure_hostroot_image, hostroot_mounts

    client = docker.from_env()
    try:
        ensure_hostroot_image(client)
        client.containers.run(
            HOSTROOT_IMAGE,
            ["true"],
            init=True,
            network_mode="none",
            remove=True,
            volumes=hostroot_mounts(),
            labels={"tangram.probe": "1"},
        )
    finally:
        client.close()


def choose_executor(requested: str, on_event: Callable[[str], None] | None = None) -> str:
    """``auto`` -> ``docker`` when dockerd answers and can run a hostroot container, else ``process``."""
    if requested not in ("auto", "docker", "process", "fastpath"):
        raise ConfigError(f"unknown executor {requested!r}", hint="use auto, docker or process")
    if requested == "process":
        return "process"
    if docker_answers():
        try:
            ensure_hostroot()
        except Exception as exc:  # noqa: BLE001
            why = " ".join(str(exc).split())[:300]
            if requested != "auto":
                raise BootstrapError(
                    f"dockerd answers but cannot run a {HOSTROOT_IMAGE} container: {why}",
                    hint="check `docker info` and `docker run --init`, or `tangram up --executor process`",
                ) from None
            if on_event:
                on_event(f"docker cannot run sandboxes here ({why}); using the process executor")
            return "process"
        return "docker"
    if requested == "auto":
        return "process"
    raise BootstrapError(
        "dockerd does not answer",
        hint="start dockerd (see docs/operations.md), or run `tangram up --executor process`",
    )


def nvml_gpu_count() -> int:
    """GPUs NVML finds here (0 without a driver)."""
    try:
        import pynvml  # start-up cost: see the note at the top

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 (no NVML)
        return 0


def online_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


# ---------------------------------------------------------------- the local cluster


def local_inventory() -> Inventory:
    from tangram_cli.inventory import local_default  # start-up cost: see the note at the top

    return local_default()


@dataclass(frozen=True)
class LocalUp:
    """What `tangram up` did to the local cluster. ``how``: "started" (a fresh cluster),
    "running" (it ran; dead agents were started again), "restarted" (the controller was
    restarted in place on its recorded ports)."""

    state: st.ClusterState
    how: str
    restarted: restart.Restarted | None = None
    agents: tuple[restart.AgentOutcome, ...] = ()

    @property
    def started(self) -> bool:
        """Something was started (the cluster, its controller or an agent)."""
        return self.how != "running" or any(a.how == "restarted" for a in self.agents)

    def summary(self) -> str | None:
        """One line on what was restarted, or None."""
        if self.restarted is not None:
            return self.restarted.summary()
        again = [a.describe() for a in self.agents if a.how == "restarted"]
        return "; ".join(again) or None

    def to_dict(self) -> dict[str, Any]:
        """The state record plus ``started``, ``how`` and, after a restart in place, ``restarted``."""
        doc: dict[str, Any] = {
            **self.state.to_dict(),
            "started": self.started,
            "how": self.how,
            "security": "curve" if self.state.certs else "plain",
        }
        if self.restarted is not None:
            r = self.restarted
            doc["restarted"] = {
                "controller_pid": r.controller_pid,
                "ports": r.ports,
                "why": r.why,
                "agents": {a.name: {"how": a.how, "pid": a.pid} for a in r.agents},
            }
        return doc


def up_local(
    *,
    executor: str = "auto",
    gpus: int | None = None,
    gpu_mem_mib: int | None = None,
    timeout_s: float = 120.0,
    on_event: Callable[[str], None] | None = None,
    cluster: str = st.DEFAULT_CLUSTER,
    curve: bool = True,
    extras: LocalExtras | None = None,
) -> tuple[st.ClusterState, bool]:
    """`bring_up_local` for callers that want (state, started_now); what was restarted is told
    through ``on_event``."""
    r = bring_up_local(
        executor=executor,
        gpus=gpus,
        gpu_mem_mib=gpu_mem_mib,
        timeout_s=timeout_s,
        on_event=on_event,
        cluster=cluster,
        curve=curve,
        extras=extras,
    )
    if on_event and r.restarted is not None:
        on_event(r.restarted.summary())
    return r.state, r.started


def bring_up_local(
    *,
    executor: str = "auto",
    gpus: int | None = None,
    gpu_mem_mib: int | None = None,
    timeout_s: float = 120.0,
    on_event: Callable[[str], None] | None = None,
    cluster: str = st.DEFAULT_CLUSTER,
    curve: bool = True,
    extras: LocalExtras | None = None,
) -> LocalUp:
    """Start, keep or restart the local cluster. A running cluster is kept (dead agents are started
    again); one whose controller died is restarted in place, on the recorded ports, keeping live
    agents; otherwise a fresh one starts. ``curve``: CURVE keys for a fresh cluster (the default;
    False: plain TCP on 127.0.0.1, which every local user can reach); ``extras``: its warm sandbox
    pools and RL jobs (local_flags.py; None: neither). A kept or restarted cluster keeps what it was
    started with (``security_line`` says which; its ``controller.json`` holds its pools and jobs)."""
    say = on_event or (lambda _m: None)
    with st.locked(cluster):
        old = st.load(cluster)
        if old is not None:
            found = _existing(old, timeout_s, say)
            if found is not None:
                return found
        setup = _LocalSetup.choose(executor, gpus, gpu_mem_mib, say, extras)
        state = _start_fresh_controller(cluster, setup, curve, say)
        _start_first_agent(state, setup, timeout_s, say)
        return LocalUp(state, "started")


def security_line(state: st.ClusterState) -> str:
    """One line on how the cluster's sockets are secured (`tangram up` prints it)."""
    if state.certs:
        return (
            f"security: CURVE, keys in {state.certs} (only this user can read them; "
            "`tangram keys add NAME` for other users or jobs)"
        )
    return (
        "security: plain TCP on 127.0.0.1 (--insecure): any local user can connect as an agent or a "
        "client; for development only (`tangram down`, then `tangram up` for CURVE)"
    )


def _existing(old: st.ClusterState, timeout_s: float, say: Callable[[str], None]) -> LocalUp | None:
    """A recorded cluster: kept, restarted in place, or cleaned up (None: start a fresh one)."""
    pid = old.controller_pid
    if old.controller_is_ours():
        if _answers(old):
            agents = restart.ensure_local_agents(old, timeout_s=timeout_s, say=say, wait_all=False)
            return LocalUp(old, "running", agents=agents)
        say(f"controller pid {pid} runs but does not answer; stopping it")
        procs.terminate(pid, timeout_s=5, words=(str(st.controller_config_path(old.name)),))
        why = f"controller pid {pid} did not answer"
    elif st.pid_alive(pid):
        why = f"controller pid {pid} now runs another program"
    else:
        why = f"controller pid {pid} is gone"
    missing = restart.missing_record(old)
    if missing is None:
        r = restart.restart_local(old, why=why, timeout_s=timeout_s, say=say)
        return LocalUp(old, "restarted", restarted=r, agents=r.agents)
    say(f"{why}; cannot restart it in place ({missing}): starting a fresh cluster")
    for h in old.hosts:
        procs.terminate(procs.local_agent_pid(h), timeout_s=5, words=("agent",))
    if removed := remove_cluster_containers(old.name, old.cluster_id):
        say(f"removed {removed} sandbox container(s) left by the previous cluster (id {old.cluster_id})")
    st.remove(old.name)
    return None


def _answers(state: st.ClusterState) -> bool:
    try:
        st.query_status(state.status_address, limit=0, timeout_s=2.0, certs=state.certs or None)
    except TangramError:
        return False
    return True


@dataclass(frozen=True)
class _LocalSetup:
    node: Node
    executor: str
    emulated: int
    gpu_mem_mib: int
    gpu_text: str
    config: ControllerConfig
    pool_max: int = 0  # the agent's `pool_max` when --sandbox-pool asks for more than its default

    @classmethod
    def choose(
        cls,
        executor: str,
        gpus: int | None,
        gpu_mem_mib: int | None,
        say: Callable[[str], None],
        extras: LocalExtras | None = None,
    ) -> _LocalSetup:
        from tangram_cli.inventory.configs import controller_config  # start-up cost: see the top

        inv = local_inventory()
        node = inv.nodes[0]
        chosen = choose_executor(executor if executor != "auto" else node.executor, say)
        say(f"executor: {chosen}")
        pool = extras.sandbox_pool if extras is not None else 0
        if pool and chosen == "process":
            raise BootstrapError(
                f"--sandbox-pool {pool}: the executor chosen here is process (dockerd does not answer or "
                "cannot run sandboxes), and only the Docker executor keeps warm sandbox pools",
                hint="start dockerd (docs/operations.md), then `tangram up --executor docker "
                f"--sandbox-pool {pool}`; or drop --sandbox-pool",
            )
        real_gpus = nvml_gpu_count()
        if gpus is not None:
            emulated = gpus
        elif real_gpus:
            emulated = 0
        else:
            emulated = node.gpu_count if isinstance(node.gpu_count, int) else DEFAULT_LOCAL_GPUS
        gmem = gpu_mem_mib or node.gpu_mem_mib or DEFAULT_LOCAL_GPU_MEM_MIB
        gpu_text = f"{emulated} emulated x {gmem // 1024}GiB" if emulated else f"{real_gpus} (NVML)"
        say(f"gpus: {gpu_text}")
        config = controller_config(inv, local_demo=True)
        if extras is not None:
            config = extras.apply(config)
            for line in extras.describe():
                say(line)
        return cls(node, chosen, emulated, gmem, gpu_text, config, pool)


def _start_fresh_controller(
    cluster: str, setup: _LocalSetup, curve: bool, say: Callable[[str], None]
) -> st.ClusterState:
    certs = ""
    if curve:
        certs = str(keys.ensure_cluster_keys(cluster, [setup.node.name]))
        say(f"CURVE keys: {certs}")
    else:
        say("no keys (--insecure): plain TCP on 127.0.0.1")
    restart.forget_controller_state(cluster)
    cluster_id = st.new_cluster_id()
    proc, _argv, ports = procs.start_controller(
        cluster,
        bind="127.0.0.1",
        ports={"agents": 0, "submit": 0, "status": 0},
        config=replace(setup.config, cluster_id=cluster_id),
        certs=certs or None,
    )
    assert proc is not None
    state = st.ClusterState(
        name=cluster,
        controller_pid=proc.pid,
        bind="127.0.0.1",
        advertise="127.0.0.1",
        ports=ports,
        started_at=time.time(),
        inventory="<local default>",
        executor=setup.executor,
        gpus=setup.gpu_text,
        certs=certs,
        cluster_id=cluster_id,
    )
    st.write(state)
    say(f"controller pid {proc.pid} on {state.address}")
    return state


def _start_first_agent(
    state: st.ClusterState, setup: _LocalSetup, timeout_s: float, say: Callable[[str], None]
) -> None:
    from tangram_cli.inventory.configs import agent_config  # start-up cost: see the top

    node, cpus = setup.node, online_cpus()
    workdir = st.cluster_dir(state.name) / "agent"
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    acfg = agent_config(
        node,
        cluster=state.name,
        controller=state.agents_address,
        workdir=str(workdir),
        executor=setup.executor,
        emulated_gpus=setup.emulated,
        gpu_mem_mib=setup.gpu_mem_mib,
        cpus=cpus,
        idle_cpus=cpus[:1],
        curve=_local_curve(state.certs, node.name) if state.certs else None,
        cluster_id=state.cluster_id,
    )
    if setup.executor == "process":
        acfg = _contain_or_trust(acfg, say)
    if setup.pool_max > acfg.pool_max:  # the agent's own bound on idle pooled sandboxes (all shapes)
        acfg = acfg.with_values(pool_max=setup.pool_max)
    (workdir / "agent.json").write_text(acfg.to_json())
    host = st.HostState(name=node.name, host="127.0.0.1", connection="local", workdir=str(workdir))
    proc = procs.start_local_agent(state.name, host)
    host.pid = proc.pid
    state.hosts = [host]
    st.write(state)
    say(f"agent {node.name} pid {proc.pid}")
    restart.wait_agents(state, [node.name], {node.name: proc}, None, timeout_s)


def _contain_or_trust(acfg: AgentConfig, say: Callable[[str], None]) -> AgentConfig:
    """The process executor refuses to start where it cannot contain sandboxes (not root, no cpuset, memory
    or pids cgroup: docs/agent.md). The local default must still come up with one command: there it runs
    actions uncontained (``trusted_code_only``, as the user who ran `tangram up`) and says so."""
    from agent.executors.proc_contain import check  # start-up cost: see the note at the top

    missing = check(probe=True).missing
    if not missing:
        return acfg
    say(f"sandboxes are NOT contained (trusted code only): {missing[0]}")
    return acfg.with_values(trusted_code_only=True)


def _local_curve(certs: str, node: str) -> dict[str, str]:
    """A local agent reads its keys straight from the cluster's certs directory."""
    d = Path(certs)
    return {
        "controller_public": str(d / f"{keys.CONTROLLER}.key"),
        "secret": str(d / f"{keys.agent_role(node)}.key_secret"),
    }


def remove_cluster_containers(cluster: str, cluster_id: str) -> int:
    """Safety net for `down`: remove the containers of cluster ``cluster`` whose id is ``cluster_id``
    (labels ``tangram.cluster`` and ``tangram.cluster-id`` both match). Returns how many. Without an id
    (a legacy state) nothing is removed: containers labelled only by name may belong to another
    cluster of that name (another user, or another TANGRAM_HOME, on this Docker daemon)."""
    if not cluster_id or not docker_answers(2.0):
        return 0
    import docker  # start-up cost: see the note at the top

    from agent.executors.docker import LABEL_CLUSTER, LABEL_CLUSTER_ID

    client = docker.from_env()
    try:
        wanted = [f"{LABEL_CLUSTER}={cluster}", f"{LABEL_CLUSTER_ID}={cluster_id}"]
        found = client.containers.list(all=True, filters={"label": wanted})
        for c in found:
            with contextlib.suppress(Exception):
                c.remove(force=True, v=True)
        return len(found)
    finally:
        client.close()
