"""The embedded local default (architecture.md section 11), and the pieces `up` shares with SSH.

`tangram up` with no inventory starts cluster ``local``: the controller and one agent as detached
processes on this machine (``setsid``, stdio to log files under ``clusters/local/logs/``), on
127.0.0.1 free ports, no SSH. The executor is ``docker`` when dockerd answers (then the
``tangram/hostroot:1`` image is imported if missing), else ``process``; without NVML GPUs the
node gets emulated ones (8 x 80 GiB unless ``--gpus``/``--gpu-mem``).

The controller is started from its resolved configuration (``controller.json``, built by
``controller_config`` from the inventory), reports its ports through ``--ready-file``, and `up`
then blocks until every agent shows up in the controller's status records.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tangram.errors import BootstrapError, ConfigError, ControllerUnreachable, TangramError
from tangram_cli import state as st
from tangram_cli.render import status as rs

REWARD_MODEL = "agent.gpu.demo_services:reward"
HOSTROOT_IMAGE = "tangram/hostroot:1"
DEFAULT_LOCAL_GPUS = 8
DEFAULT_LOCAL_GPU_MEM_MIB = 80 * 1024
CONTROLLER_READY_TIMEOUT_S = 30.0
DOWN_STATES = ("down", "down*", "unreach", "boot", "lost", "gone")

# The controller CLI, runnable without a console script on PATH (and recognisable in /proc).
CONTROLLER_ARGV = [sys.executable, "-c", "from tangram_cli.main import cli; cli()", "controller"]
AGENT_ARGV = [sys.executable, "-m", "agent"]


# ---------------------------------------------------------------- resolved configuration


def _service_dict(s: Any, *, local_demo: bool) -> dict[str, Any]:
    model = s.model
    if model is None and s.runtime == "emulated":
        model = (
            REWARD_MODEL
            if local_demo or s.name in ("reward", "demo-reward")
            else "agent.gpu.demo_services:echo"
        )
    out: dict[str, Any] = {
        "name": s.name,
        "runtime": s.runtime,
        "model": model,
        "gpu_mem_mib": s.gpu_mem_mib or 0,
        "chunk_sizes": list(s.gpus),
        "load_s": float(s.load_s or 0.0),
    }
    if s.host_mem_mib:
        out["host_mem_mib"] = s.host_mem_mib
    if s.duration_ms is not None:
        out["t_ori"] = s.duration_ms / 1000
    return out


def controller_config(inv: Any, *, local_demo: bool = False) -> dict[str, Any]:
    """The controller's ``--config`` JSON (see tangram_cli/controller/config.py) from an Inventory.

    For the local default the demo needs GPU service ``reward`` (the emulated reward model in
    ``agent.gpu.demo_services``) and API ``search`` with a concurrency limit; both are added when
    the inventory does not define them.
    """
    services: dict[str, dict[str, Any]] = {}
    for node in inv.nodes:
        for s in node.services:
            services.setdefault(s.name, _service_dict(s, local_demo=local_demo))
    apis = [
        {"name": a.name, "mode": a.mode, "limit": a.limit, "period_s": (a.period_ms or 60_000) / 1000}
        for a in inv.apis
    ]
    if local_demo:
        if "reward" not in services:
            services["reward"] = {
                "name": "reward",
                "runtime": "emulated",
                "model": REWARD_MODEL,
                "gpu_mem_mib": 16 * 1024,
                "chunk_sizes": [1],
                "load_s": 1.0,
                "t_ori": 0.2,
                "host_mem_mib": 16 * 1024,
            }
        if not any(a["name"] == "search" for a in apis):
            apis.append({"name": "search", "mode": "concurrency", "limit": 4, "period_s": 60.0})
    profiles: dict[str, Any] = {}
    for p in inv.profiles:
        if p.efficiency is not None:
            profiles[p.name] = {"efficiency": {str(k): v for k, v in p.efficiency.items()}}
        else:
            profiles[p.name] = {"serial_fraction": p.serial_fraction}
    return {
        "cluster": inv.cluster,
        "scheduler": {"depth": inv.scheduler.depth, "client_grace_s": inv.scheduler.client_grace_ms / 1000},
        "services": list(services.values()),
        "apis": apis,
        "profiles": profiles,
    }


def agent_config(
    node: Any,
    *,
    cluster: str,
    controller: str,
    workdir: str,
    executor: str,
    emulated_gpus: int,
    gpu_mem_mib: int | None,
    cpus: Iterable[int] | None = None,
    idle_cpus: Iterable[int] | None = None,
    allow_remote: bool = False,
    curve: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The agent's ``--config agent.json`` (keys of agent.config.AgentConfig); ``curve`` holds the
    paths of the agent's secret certificate and the controller's public key."""
    cfg: dict[str, Any] = {
        "controller": controller,
        "name": node.name,
        "cluster": cluster,
        "executor": executor,
        "workdir": workdir,
    }
    cpus = list(cpus) if cpus is not None else (list(node.cpus) if node.cpus else None)
    idle = list(idle_cpus) if idle_cpus is not None else (list(node.idle_cpus) if node.idle_cpus else None)
    if cpus:
        cfg["cpus"] = cpus
    if idle:
        cfg["idle_cpus"] = idle
    if node.mem_mib:
        cfg["mem_mib"] = node.mem_mib
    if node.image:
        cfg["image"] = node.image
    if emulated_gpus:
        cfg["emulated_gpus"] = emulated_gpus
        if gpu_mem_mib:
            cfg["gpu_mem_mib"] = gpu_mem_mib
    if curve:
        cfg["curve"] = dict(curve)
    elif allow_remote:
        cfg["allow_remote"] = True
    return cfg


# ---------------------------------------------------------------- machine facts


def docker_answers(timeout_s: float = 3.0) -> bool:
    """True when ``docker.from_env().ping()`` succeeds."""
    try:
        import docker

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
    import docker

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
        import pynvml

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


# ---------------------------------------------------------------- processes


def spawn_detached(
    argv: list[str], log_path: Path, *, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session, stdin from /dev/null, stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log, open(os.devnull, "rb") as devnull:
        return subprocess.Popen(
            argv,
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            close_fds=True,
        )


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def parse_ready(text: str) -> dict[str, int]:
    """The controller's ready line -> ``{"agents": P, "submit": P, "status": P}`` (key spellings vary)."""
    for line in reversed([ln for ln in text.splitlines() if ln.strip().startswith("{")]):
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict):
            continue
        flat = dict(raw)
        if isinstance(raw.get("ports"), dict):
            flat.update(raw["ports"])
        ports: dict[str, int] = {}
        for key, value in flat.items():
            for want in ("agents", "submit", "status"):
                if isinstance(value, int) and not isinstance(value, bool) and str(key).startswith(want):
                    ports[want] = value
                elif isinstance(value, str) and str(key).startswith(want) and ":" in value:
                    with contextlib.suppress(ValueError):
                        ports[want] = int(value.rsplit(":", 1)[1])
        if len(ports) == 3:
            return ports
    return {}


def start_controller(
    name: str,
    *,
    bind: str,
    ports: Mapping[str, int],
    config: Mapping[str, Any],
    timeout_s: float = CONTROLLER_READY_TIMEOUT_S,
    foreground_argv: bool = False,
    certs: str | None = None,
) -> tuple[subprocess.Popen[bytes] | None, list[str], dict[str, int]]:
    """Write ``controller.json`` and start ``tangram controller`` detached; wait for its ready file.

    Returns (process, argv, ports). With ``foreground_argv`` nothing is started: the argv is
    returned for the caller to exec.
    """
    d = st.ensure_dirs(name)
    cfg_path = d / "controller.json"
    cfg_path.write_text(json.dumps(config, indent=2) + "\n")
    ready = d / "controller.ready"
    with contextlib.suppress(FileNotFoundError):
        ready.unlink()
    argv = [
        *CONTROLLER_ARGV,
        "--bind",
        bind,
        "--agents-port",
        str(ports.get("agents", 0)),
        "--submit-port",
        str(ports.get("submit", 0)),
        "--status-port",
        str(ports.get("status", 0)),
        "--journal",
        str(st.journal_path(name)),
        "--config",
        str(cfg_path),
        "--ready-file",
        str(ready),
    ]
    if certs:
        argv += ["--certs", str(certs)]
    if foreground_argv:
        return None, argv, {}
    log = st.logs_dir(name) / "controller.log"
    proc = spawn_detached(argv, log, cwd=d)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            got = parse_ready(ready.read_text(errors="replace"))
            if got:
                return proc, argv, got
        if proc.poll() is not None:
            raise BootstrapError(
                f"the controller exited with status {proc.returncode} during start",
                hint=f"read {log}",
                detail=log_tail(log),
            )
        time.sleep(0.05)
    terminate(proc.pid, timeout_s=3)
    raise BootstrapError(
        f"the controller did not report ready within {timeout_s:g}s", hint=f"read {log}", detail=log_tail(log)
    )


def terminate(
    pid: int | None,
    *,
    timeout_s: float = 10.0,
    words: tuple[str, ...] = (),
    first: signal.Signals = signal.SIGTERM,
) -> str:
    """``first`` (SIGTERM), wait; then SIGTERM again if ``first`` was another signal, wait a little;
    then SIGKILL. Returns "gone" (was not running), "stopped" or "killed"."""
    if not st.pid_alive(pid, words):
        return "gone"
    assert pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    if _wait_gone(pid, timeout_s):
        return "stopped"
    if first != signal.SIGTERM:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if _wait_gone(pid, 5.0):
            return "stopped"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, 5.0)
    return "killed"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        if not st.pid_alive(pid):
            return True
        time.sleep(0.05)
    return not st.pid_alive(pid)


# ---------------------------------------------------------------- waiting for agents


def wait_registered(
    status_address: str,
    names: Iterable[str],
    *,
    timeout_s: float,
    on_update: Callable[[dict[str, str]], None] | None = None,
    alive: Callable[[], str | None] | None = None,
    certs: str | None = None,
) -> dict[str, str]:
    """Poll the status socket until every node in ``names`` is registered and not down.

    Returns ``{node: state}``. Stops early when ``alive()`` returns a reason (a process died).
    On timeout the states seen last are returned (the caller reports the missing ones).
    """
    want = list(names)
    seen: dict[str, str] = dict.fromkeys(want, "waiting")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = st.query_status(status_address, sections=(), limit=0, timeout_s=2.0, certs=certs)
            rows = {rs.node_name(r): r for r in rs.rows(records, "nodes")}
            for n in want:
                if n in rows:
                    seen[n] = rs.node_state(rows[n]) or "registered"
        except ControllerUnreachable:
            pass
        except TangramError:
            pass
        if on_update:
            on_update(dict(seen))
        if all(is_up(seen[n]) for n in want):
            return seen
        if alive is not None and (why := alive()):
            for n in want:
                if not is_up(seen[n]):
                    seen[n] = why
            return seen
        if time.monotonic() >= deadline:
            return seen
        time.sleep(0.2)


def is_up(state: str) -> bool:
    return state not in ("waiting", "") and not state.startswith(DOWN_STATES) and " " not in state


# ---------------------------------------------------------------- the local cluster


def local_inventory() -> Any:
    from tangram_cli.inventory import local_default

    return local_default()


def up_local(
    *,
    executor: str = "auto",
    gpus: int | None = None,
    gpu_mem_mib: int | None = None,
    timeout_s: float = 120.0,
    on_event: Callable[[str], None] | None = None,
    cluster: str = st.DEFAULT_CLUSTER,
    curve: bool = False,
) -> tuple[st.ClusterState, bool]:
    """Start (or find) the local cluster. Returns (state, started_now). ``curve``: create CURVE keys
    and run controller and agent with them (still on 127.0.0.1)."""
    say = on_event or (lambda _m: None)
    with st.locked(cluster):
        old = st.load(cluster)
        if old is not None and old.controller_alive():
            records = None
            with contextlib.suppress(TangramError):
                records = st.query_status(old.status_address, timeout_s=2.0, certs=old.certs or None)
            if records is not None:
                return old, _restart_dead_agent(old, records, timeout_s, say)
            say("controller process runs but does not answer; restarting it")
            terminate(old.controller_pid, timeout_s=5, words=("tangram",))
        if old is not None:  # stale: clean up what may be left
            for h in old.hosts:
                terminate(h.pid, timeout_s=5, words=("agent",))
            st.remove(cluster)

        inv = local_inventory()
        node = inv.nodes[0]
        chosen = choose_executor(executor if executor != "auto" else node.executor, say)
        say(f"executor: {chosen}")
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
        certs = ""
        if curve:
            from tangram_cli import keys

            certs = str(keys.ensure_cluster_keys(cluster, [node.name]))
            say(f"CURVE keys: {certs}")
        proc, _argv, ports = start_controller(
            cluster,
            bind="127.0.0.1",
            ports={"agents": 0, "submit": 0, "status": 0},
            config=config,
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
            executor=chosen,
            gpus=gpu_text,
            certs=certs,
        )
        say(f"controller pid {proc.pid} on {state.address}")

        cpus = online_cpus()
        workdir = st.cluster_dir(cluster) / "agent"
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        acfg = agent_config(
            node,
            cluster=cluster,
            controller=state.agents_address,
            workdir=str(workdir),
            executor=chosen,
            emulated_gpus=emulated,
            gpu_mem_mib=gmem,
            cpus=cpus,
            idle_cpus=cpus[:1],
            curve=_local_curve(certs, node.name) if certs else None,
        )
        cfg_path = workdir / "agent.json"
        cfg_path.write_text(json.dumps(acfg, indent=2) + "\n")
        agent_log = st.logs_dir(cluster) / f"agent-{node.name}.log"
        aproc = spawn_detached([*AGENT_ARGV, "--config", str(cfg_path)], agent_log, cwd=workdir)
        state.hosts = [
            st.HostState(
                name=node.name, host="127.0.0.1", connection="local", workdir=str(workdir), pid=aproc.pid
            )
        ]
        st.write(state)
        say(f"agent {node.name} pid {aproc.pid}")

        def died() -> str | None:
            if aproc.poll() is not None:
                return f"agent exited with status {aproc.returncode}: {log_tail(agent_log, 1)}"
            if proc.poll() is not None:
                return f"controller exited with status {proc.returncode}"
            return None

        seen = wait_registered(
            state.status_address, [node.name], timeout_s=timeout_s, alive=died, certs=certs or None
        )
        if not is_up(seen[node.name]):
            reason = seen[node.name]
            if reason == "waiting":
                reason = f"agent did not register within {timeout_s:g}s"
            raise BootstrapError(
                f"local agent failed: {reason}",
                hint=f"read {agent_log} and {st.logs_dir(cluster) / 'controller.log'}; "
                "`tangram down` cleans up",
                detail=log_tail(agent_log, 20),
            )
        return state, True


def _local_curve(certs: str, node: str) -> dict[str, str]:
    """A local agent reads its keys straight from the cluster's certs directory."""
    from tangram_cli import keys

    d = Path(certs)
    return {
        "controller_public": str(d / f"{keys.CONTROLLER}.key"),
        "secret": str(d / f"{keys.agent_role(node)}.key_secret"),
    }


def _restart_dead_agent(
    state: st.ClusterState, records: dict[str, Any], timeout_s: float, say: Callable[[str], None]
) -> bool:
    """The controller answers; start the local agent again (from its agent.json) if it died.
    Returns True when an agent was started."""
    del records  # the controller may not have noticed the death yet (3 missed heartbeats): trust pids
    for h in state.hosts:
        if h.connection != "local" or st.pid_alive(h.pid, ("agent",)):
            continue
        with contextlib.suppress(OSError, ValueError):
            if st.pid_alive(int((Path(h.workdir) / "agent.pid").read_text().strip()), ("agent",)):
                continue
        cfg = Path(h.workdir) / "agent.json"
        if not cfg.is_file():
            continue
        say(f"agent {h.name} is not running; starting it again")
        log = st.logs_dir(state.name) / f"agent-{h.name}.log"
        proc = spawn_detached([*AGENT_ARGV, "--config", str(cfg)], log, cwd=Path(h.workdir))
        h.pid = proc.pid
        st.write(state)

        def died(proc: subprocess.Popen[bytes] = proc, log: Path = log) -> str | None:
            if proc.poll() is not None:
                return f"agent exited with status {proc.returncode}: {log_tail(log, 1)}"
            return None

        seen = wait_registered(
            state.status_address, [h.name], timeout_s=timeout_s, alive=died, certs=state.certs or None
        )
        if not is_up(seen[h.name]):
            raise BootstrapError(
                f"local agent failed: {seen[h.name]}", hint=f"read {log}", detail=log_tail(log, 20)
            )
        return True
    return False


def stop_local_agents(state: st.ClusterState, timeout_s: float = 10.0, grace_s: float = 5.0) -> list[str]:
    """Give local agents ``grace_s`` to finish their own shutdown (the controller sent them
    ``Shutdown``), then SIGTERM and SIGKILL those still running (by recorded pid or agent.pid)."""
    stopped = []
    for h in state.hosts:
        if h.connection != "local":
            continue
        pids = {h.pid}
        with contextlib.suppress(OSError, ValueError):
            pids.add(int((Path(h.workdir) / "agent.pid").read_text().strip()))
        for pid in pids:
            if pid is None or not st.pid_alive(pid, ("agent",)):
                continue
            if _wait_gone(pid, grace_s):
                continue
            if terminate(pid, timeout_s=timeout_s, words=("agent",)) != "gone":
                stopped.append(f"{h.name} (pid {pid})")
    return stopped


def remove_labelled_containers(cluster: str) -> int:
    """Safety net for `down`: remove containers labelled ``tangram.cluster=<cluster>``. Returns how many."""
    if not docker_answers(2.0):
        return 0
    import docker

    client = docker.from_env()
    try:
        found = client.containers.list(all=True, filters={"label": [f"tangram.cluster={cluster}"]})
        for c in found:
            with contextlib.suppress(Exception):
                c.remove(force=True)
        return len(found)
    finally:
        client.close()
