"""Bootstrap plan: what `tangram up` does on each host, as data. PURE: no I/O, no clock.

Per host the steps are connect, check, probe, upload, install, start, wait (docs/operations.md §3.3).
This module builds each remote command as a string whose every variable part is either checked
by the inventory (host names, users, paths, python) or passed through ``shlex.quote``; tests
check the strings. ``bootstrap/ssh.py`` only runs them.

Remote paths may start with ``~/``; ``sh_path`` turns that into ``"$HOME"/...`` so the shell
still expands it after quoting, and ``sftp_path`` into a path relative to the login directory.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

STEP_NAMES = ("connect", "check", "probe", "upload", "install", "start", "wait")

PROBE_BOOTSTRAP = "import sys,json;exec(json.loads(sys.stdin.readline()))"

# Runs on the node under any python3 >= 3.8 with the standard library only. It must never raise:
# every fact is gathered on its own, and a failure becomes null plus an entry in "errors".
FACTS_SCRIPT = r"""
import json, os, platform, shutil, sys
facts, errors = {}, {}
def fact(name, fn):
    try:
        facts[name] = fn()
    except Exception as exc:
        facts[name] = None
        errors[name] = "%s: %s" % (type(exc).__name__, exc)
def read(path):
    with open(path) as f:
        return f.read().strip()
def cpulist(text):
    out = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out
def numa():
    base = "/sys/devices/system/node"
    if not os.path.isdir(base):
        return {}
    nodes = sorted(int(n[4:]) for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit())
    return {str(n): read("%s/node%d/cpulist" % (base, n)) for n in nodes}
def meminfo():
    for line in read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
def cgroup():
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return {"version": 2, "controllers": read("/sys/fs/cgroup/cgroup.controllers").split()}
    return {"version": 1, "controllers": sorted(os.listdir("/sys/fs/cgroup"))}
def docker():
    sock = "/var/run/docker.sock"
    return {"socket": os.path.exists(sock), "access": os.access(sock, os.R_OK | os.W_OK),
            "cli": shutil.which("docker") is not None}
def nvidia():
    libs = ("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so.1",
            "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1", "/usr/lib/libnvidia-ml.so.1")
    return {"smi": shutil.which("nvidia-smi"), "nvml": any(os.path.exists(p) for p in libs),
            "devices": sorted(d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit())}
def disk():
    u = shutil.disk_usage(os.path.expanduser("~"))
    return {"path": os.path.expanduser("~"), "free_mib": u.free // 2**20, "total_mib": u.total // 2**20}
def modules():
    import importlib.util
    return {m: importlib.util.find_spec(m) is not None for m in ("zmq", "msgpack", "docker", "torch")}
fact("python", lambda: ".".join(map(str, sys.version_info[:3])))
fact("executable", lambda: sys.executable)
fact("arch", platform.machine)
fact("system", lambda: platform.system() + " " + platform.release())
fact("hostname", platform.node)
fact("cpu_count", os.cpu_count)
fact("online_cpus", lambda: read("/sys/devices/system/cpu/online"))
fact("allowed_cpus", lambda: sorted(os.sched_getaffinity(0)))
fact("numa", numa)
fact("mem_total_mib", meminfo)
fact("cgroup", cgroup)
fact("docker", docker)
fact("nvidia", nvidia)
fact("disk", disk)
fact("modules", modules)
facts["errors"] = errors
sys.stdout.write(json.dumps(facts, sort_keys=True) + "\n")
sys.stdout.flush()
"""


# --------------------------------------------------------------------------------------------
# Paths and quoting


def sh_path(path: str) -> str:
    """Quote a remote path for ``sh``, keeping a leading ``~/`` expandable."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:].rstrip("/")
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"'
    return shlex.quote(path)


def sftp_path(path: str) -> str:
    """SFTP paths are relative to the login directory; ``~/x`` becomes ``x``."""
    if path == "~":
        return "."
    return path.removeprefix("~/")


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def cluster_dir(workdir: str, cluster: str) -> str:
    return join(workdir, cluster)


def bundle_dir(workdir: str, cluster: str, digest: str) -> str:
    return join(workdir, cluster, "bundles", digest)


def venv_dir(workdir: str, cluster: str, digest: str) -> str:
    return join(workdir, cluster, f"venv-{digest[:16]}")


# --------------------------------------------------------------------------------------------
# Bundle hash


def bundle_hash(files: Mapping[str, bytes]) -> str:
    """sha256 over the sorted relative paths and their bytes (length-prefixed, so unambiguous)."""
    h = hashlib.sha256(b"tangram-bundle-1\0")
    for path in sorted(files):
        data = files[path]
        name = path.replace("\\", "/").encode()
        h.update(len(name).to_bytes(8, "big") + name + len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Command builders


def probe_argv(python: str = "python3") -> list[str]:
    """The probe: a stdlib one-liner that reads the facts script from stdin (execnet style)."""
    return [python, "-c", PROBE_BOOTSTRAP]


def probe_stdin(script: str = FACTS_SCRIPT) -> str:
    """The probe's stdin: the script as one JSON line."""
    return json.dumps(script) + "\n"


def argv_to_command(argv: Sequence[str]) -> str:
    """An argv list as one remote shell command, every element quoted."""
    return " ".join(shlex.quote(a) for a in argv)


def install_command(python: str, bundle: str, venv: str, *, system_site_packages: bool = False) -> str:
    """Create ``venv`` and install the bundle's wheels offline; idempotent (skips a finished venv)."""
    v, b = sh_path(venv), sh_path(bundle)
    # With the node's site-packages, the venv needs no pip of its own (ensurepip takes seconds per
    # node, and Debian ships it separately): the node's pip serves, or pip_install_command adds one.
    flags = " --system-site-packages --without-pip" if system_site_packages else ""
    create = f"{shlex.quote(python)} -m venv{flags} {v}"
    pip = f"{v}/bin/python -m pip install --quiet --no-index --find-links {b}/wheels -r {b}/requirements.txt"
    if system_site_packages:
        return f"test -f {v}/.complete || {{ {create} && touch {v}/.complete; }}"
    return f"test -f {v}/.complete || {{ {create} && {pip} && touch {v}/.complete; }}"


def pip_install_command(venv: str, packages: Sequence[str]) -> str:
    """Install ``packages`` into ``venv`` with pip: the node's own (visible through the venv's system
    site-packages), else one ``ensurepip`` puts into the venv. Needs a package index."""
    vpy = f"{sh_path(venv)}/bin/python"
    pkgs = " ".join(shlex.quote(p) for p in packages)
    return (
        f"{{ {vpy} -m pip --version >/dev/null 2>&1 || {vpy} -m ensurepip --default-pip >/dev/null; }} && "
        f"{vpy} -m pip install --quiet {pkgs}"
    )


def start_command(run_dir: str, venv: str, *, config: str = "agent.json") -> str:
    """Start the agent once, detached, every stdio stream redirected (else the channel hangs).

    ``flock -n`` makes a second start a no-op failure (exit 1): the agent inherits the lock.
    """
    python = f"{sh_path(venv)}/bin/python"
    return (
        f"cd {sh_path(run_dir)} && flock -n agent.lock setsid -f {python} -m agent "
        f"--config {shlex.quote(config)} </dev/null >>agent.log 2>&1"
    )


def stop_command(run_dir: str, *, signal: str = "TERM") -> str:
    """Signal the agent whose pid is in ``<run_dir>/agent.pid``; a missing or non-numeric pid is an error."""
    if signal not in ("TERM", "KILL", "INT"):
        raise ValueError(f"unsupported signal {signal!r}")
    pidfile = f"{sh_path(run_dir)}/agent.pid"
    return (
        f"pid=$(cat {pidfile} 2>/dev/null) && "
        'case "$pid" in ""|*[!0-9]*) echo "no agent pid" >&2; exit 3;; esac && '
        f'kill -{signal} "$pid"'
    )


RUN_FILES = ("agent.json", "agent.key_secret", "controller.key")  # what `up` writes into a run directory


@dataclass(frozen=True)
class NodeCheck:
    """What `up` needs to know about a node before it does anything there (``ssh.check_node`` reads it
    over SFTP, running no shell: a node's rc files can cost a second per command)."""

    home: str
    running: bool
    hashes: dict[str, str]  # file name in the run directory -> sha256 hex
    bundle: str  # the bundle hash in its .complete marker, or ""
    ready: bool  # the venv is set up (bundle extracted, modules there)

    def differing(self, files: Mapping[str, bytes]) -> list[str]:
        """The names of ``files`` whose content differs from what the node holds."""
        return [n for n, data in files.items() if self.hashes.get(n) != hashlib.sha256(data).hexdigest()]


def ready_command(venv: str) -> str:
    """Mark the venv ready once the bundle is extracted into it and its modules import."""
    return f"touch {sh_path(venv)}/.ready"


def purge_command(run_dir: str) -> str:
    """Remove everything `up` left in the node's run directory (agent venvs, bundles, logs,
    ``agent.key_secret``, ``controller.key``), then its parent if that is now empty; prints
    ``gone`` when the run directory no longer exists."""
    r = sh_path(run_dir)
    parent = run_dir.rstrip("/").rsplit("/", 1)[0] if "/" in run_dir.rstrip("/") else ""
    rmdir = f"rmdir -- {sh_path(parent)} 2>/dev/null; " if parent not in ("", "~", "/") else ""
    return f"rm -rf -- {r}; {rmdir}test -e {r} || echo gone"


def remove_containers_command(cluster_id: str) -> str:
    """Remove the node's containers of the cluster with id ``cluster_id`` (label ``tangram.cluster-id``);
    never by the cluster's name alone, which another cluster on the same Docker daemon may share."""
    if not cluster_id:
        raise ValueError("a cluster id is needed: containers are never removed by name alone")
    return _remove_containers(shlex.quote(f"label=tangram.cluster-id={cluster_id}"))


def _remove_containers(label: str) -> str:
    return (
        "command -v docker >/dev/null 2>&1 && "
        f"ids=$(docker ps -aq --filter {label}) && "
        '[ -n "$ids" ] && docker rm -f $ids >/dev/null'
    )


CID_LABEL = '"label=tangram.cluster-id=$cid"'  # $cid: a hex id the command itself found
AGENT_ALIVE = (
    'case "$pid" in ""|*[!0-9]*) false;; '
    '*) kill -0 "$pid" 2>/dev/null && grep -q agent /proc/"$pid"/cmdline 2>/dev/null;; esac'
)


def teardown_command(run_dir: str, cluster_id: str, *, purge: bool, wait_s: float = 10.0) -> str:
    """`down` on one node in one command (every shell a node starts may run slow rc files):

    * stop the agent of ``run_dir`` by its pidfile: SIGTERM, up to ``wait_s``, then SIGKILL; prints
      ``agent=stopped``, or ``agent=stuck`` when it still runs (then nothing else is done);
    * remove the containers of ``cluster_id``; without one, with ``purge``, of the id in the node's own
      agent.json (a hex string, or nothing); never by the cluster's name alone;
    * with ``purge``, remove the run directory (``purge_command``: prints ``gone``)."""
    r = sh_path(run_dir)
    ticks = max(1, int(wait_s / 0.2))
    stop = (
        f"pid=$(cat {r}/agent.pid 2>/dev/null); alive() {{ {AGENT_ALIVE}; }}; stuck=; "
        'if alive; then kill -TERM "$pid"; i=0; '
        f'while alive && [ "$i" -lt {ticks} ]; do sleep 0.2; i=$((i+1)); done; '
        'if alive; then kill -KILL "$pid"; sleep 0.5; fi; '
        "if alive; then stuck=1; echo agent=stuck; else echo agent=stopped; fi; fi; "
    )
    if cluster_id:
        cid = f"cid={shlex.quote(cluster_id)}; "
    elif purge:
        pattern = shlex.quote('s/.*"cluster_id": *"\\([0-9a-f]*\\)".*/\\1/p')
        cid = f"cid=$(sed -n {pattern} {r}/agent.json 2>/dev/null | head -n 1); "
    else:
        cid = "cid=; "
    docker = f'[ -n "$cid" ] && {_remove_containers(CID_LABEL)}; '
    rest = f"{cid}{docker}{purge_command(run_dir)}" if purge else f"{cid}{docker}true"
    return f'{stop}if [ -z "$stuck" ]; then {rest}; fi'


# --------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class Step:
    name: str
    summary: str
    command: str | None = None  # remote shell command, or None for steps done by the runner
    stdin: str | None = None


@dataclass(frozen=True)
class HostPlan:
    node: str
    destination: str
    bundle: str
    steps: tuple[Step, ...]


def host_plan(node: object, cluster: str, digest: str, *, system_site_packages: bool = False) -> HostPlan:
    """The steps for one inventory node (any object with the ``Node`` attributes)."""
    workdir, python = node.workdir, node.python  # type: ignore[attr-defined]
    bdir, venv, run_dir = (
        bundle_dir(workdir, cluster, digest),
        venv_dir(workdir, cluster, digest),
        cluster_dir(workdir, cluster),
    )
    host = node.host  # type: ignore[attr-defined]
    dest = f"{node.user}@{'[' + host + ']' if ':' in host else host}:{node.port}"  # type: ignore[attr-defined]
    steps = (
        Step("connect", f"ssh {dest} (host key {node.host_key_policy}, timeout {node.connect_timeout_ms}ms)"),  # type: ignore[attr-defined]
        Step(
            "check",
            f"sftp: {run_dir}/agent.pid, sha256 of {', '.join(RUN_FILES)}, the bundle's .complete, the "
            "venv's .ready; an agent running with these files ends here (unless --force)",
        ),
        Step(
            "probe",
            "python, cores, NUMA, memory, cgroup, docker, GPUs, disk",
            argv_to_command(probe_argv(python)),
            probe_stdin(),
        ),
        Step(
            "upload",
            f"sftp bundle to {bdir} unless its .complete matches",
        ),
        Step(
            "install",
            f"venv {venv}",
            install_command(python, bdir, venv, system_site_packages=system_site_packages),
        ),
        Step("start", f"agent in {run_dir}", start_command(run_dir, venv)),
        Step("wait", "until the agent registers with the controller"),
    )
    return HostPlan(node.name, dest, digest, steps)  # type: ignore[attr-defined]


def plan(nodes: Iterable[object], cluster: str, digest: str) -> list[HostPlan]:
    return [host_plan(n, cluster, digest) for n in nodes if getattr(n, "connection", "ssh") == "ssh"]


def render(plans: Sequence[HostPlan], *, verbose: bool = False) -> str:
    """``tangram up --dry-run``: the plan as text, one block per host."""
    if not plans:
        return "nothing to bootstrap over SSH (every node is local)\n"
    lines = [f"bootstrap plan: {len(plans)} host(s), bundle {plans[0].bundle[:12]}"]
    for p in plans:
        lines.append(f"{p.node}  {p.destination}")
        for i, s in enumerate(p.steps, 1):
            lines.append(f"  {i}. {s.name:<8} {s.summary}")
            if verbose and s.command:
                lines.append(f"       $ {s.command}")
    return "\n".join(lines) + "\n"
