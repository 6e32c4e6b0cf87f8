"""Facts about this machine: cores, NUMA layout, memory, cgroup version, Docker, GPUs.

Each file format has a pure parser (``parse_*``, unit-tested on sample text) and a thin reader that
takes a ``root`` so tests can point it at a fake tree. ``probe()`` gathers everything into ``Facts``.
Docker and NVML are imported lazily and every failure there means "not available", never a crash.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import platform
import re
import socket
import warnings
from dataclasses import dataclass, field
from typing import Any

from tangram import units

log = logging.getLogger("agent.probe")

_NODE_DIR = re.compile(r"^node([0-9]+)$")


# ---------------------------------------------------------------- pure parsers


def parse_cpulist(text: str) -> list[int]:
    """Kernel cpulist (``/sys/devices/system/cpu/online``, ``node*/cpulist``): ``"0-3,8\\n"`` -> [0,1,2,3,8].

    An empty file (a memory-only NUMA node) is ``[]``. Malformed text raises ValueError (`tangram.units`
    rules, the same as every other cpulist).
    """
    return list(units.parse_cpulist(text, "cpulist", allow_empty=True))


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` -> {"MemTotal": kB, ...}; lines without a number are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0])  # kB, or a plain count (HugePages_Total)
    return out


def parse_cgroup_version(mountinfo: str) -> str:
    """``/proc/self/mountinfo`` -> "v1" (a v1 cpuset hierarchy, hybrid included), "v2" or "none"."""
    v1_cpuset = v1_any = v2 = False
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = right.split()
        if not fields:
            continue
        fstype = fields[0]
        superopts = fields[2].split(",") if len(fields) > 2 else []
        mountopts = left.split()[5].split(",") if len(left.split()) > 5 else []
        if fstype == "cgroup2":
            v2 = True
        elif fstype == "cgroup":
            v1_any = True
            if "cpuset" in superopts or "cpuset" in mountopts:
                v1_cpuset = True
    if v1_cpuset:
        return "v1"
    if v2:
        return "v2"
    return "v1" if v1_any else "none"


def parse_numa(cpulists: dict[int, str]) -> list[list[int]]:
    """{node number: cpulist text} -> cpulists in node order, memory-only nodes left out."""
    return [cpus for _, text in sorted(cpulists.items()) if (cpus := parse_cpulist(text))]


def mem_offer_mib(meminfo: dict[str, int]) -> int:
    """Memory an agent offers for sandboxes by default: MemTotal minus min(4 GiB, 10 %) for the host."""
    total = meminfo.get("MemTotal", 0) // 1024
    return max(total - min(4096, total // 10), 0)


# ---------------------------------------------------------------- thin readers


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def online_cpus(root: str = "/") -> list[int]:
    """Online cores that this process may also use (affinity), so a container or taskset can get them."""
    try:
        online = parse_cpulist(_read(os.path.join(root, "sys/devices/system/cpu/online")))
    except (OSError, ValueError):
        online = sorted(os.sched_getaffinity(0))
    if root == "/":
        allowed = os.sched_getaffinity(0)
        online = [c for c in online if c in allowed] or online
    return online


def numa_cpulists(root: str = "/") -> list[list[int]]:
    base = os.path.join(root, "sys/devices/system/node")
    texts: dict[int, str] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for name in names:
        m = _NODE_DIR.match(name)
        if m:
            try:
                texts[int(m.group(1))] = _read(os.path.join(base, name, "cpulist"))
            except OSError:
                continue
    try:
        return parse_numa(texts)
    except ValueError:
        return []


def meminfo(root: str = "/") -> dict[str, int]:
    try:
        return parse_meminfo(_read(os.path.join(root, "proc/meminfo")))
    except OSError:
        return {}


def cgroup_version(root: str = "/") -> str:
    try:
        return parse_cgroup_version(_read(os.path.join(root, "proc/self/mountinfo")))
    except OSError:
        return "none"


def docker_reachable(timeout_s: float = 2.0) -> bool:
    """True when a dockerd answers ``ping`` (``$DOCKER_HOST`` or the default socket) within the timeout."""
    try:
        import docker  # optional on a node (only the docker executor needs it)
    except ImportError:
        return False
    client = None
    ok = False
    try:
        client = docker.from_env(timeout=max(1, round(timeout_s)))
        ok = bool(client.ping())
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        log.debug("docker not reachable: %s", exc)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
    if not ok:  # docker-py leaks the socket of a failed version probe: finalize it here, quietly
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
    return ok


def nvml_gpus() -> list[dict[str, Any]]:
    """GPUs from ``agent.gpu.nvml.discover()`` (as dicts); [] without the library, driver or devices."""
    try:  # GPU modules load on the GPU path only (node.py)
        from agent.gpu import nvml
    except Exception:  # noqa: BLE001 - module absent or broken: no GPUs
        return []
    try:
        found, reason = nvml.discover()
    except Exception as exc:  # noqa: BLE001
        log.debug("NVML discovery failed: %s", exc)
        return []
    if reason:
        log.debug("no NVML GPUs: %s", reason)
    return [g.to_dict() for g in found]


# ---------------------------------------------------------------- all together


@dataclass
class Facts:
    online: list[int]
    numa: list[list[int]]
    mem_total_mib: int
    mem_offer_mib: int
    cgroup: str
    docker: bool
    gpus: list[dict[str, Any]] = field(default_factory=list)
    hostname: str = ""
    python: str = ""


def probe(check_docker: bool = True, check_gpus: bool = True, root: str = "/") -> Facts:
    info = meminfo(root)
    return Facts(
        online=online_cpus(root),
        numa=numa_cpulists(root),
        mem_total_mib=info.get("MemTotal", 0) // 1024,
        mem_offer_mib=mem_offer_mib(info),
        cgroup=cgroup_version(root),
        docker=docker_reachable() if check_docker else False,
        gpus=nvml_gpus() if check_gpus else [],
        hostname=socket.gethostname(),
        python=platform.python_version(),
    )
