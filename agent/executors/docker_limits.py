"""What a Docker sandbox may use: its user, its memory when the request names none, its disk.

* User: sandbox code runs as ``SandboxLimits.user`` (``uid:gid``, default ``65534:65534``), on every exec
  path (spawner, ``nsenter``, ``docker exec``), with no capabilities and ``no_new_privs``. The container's
  own processes (``docker-init`` and its ``sleep infinity``) run as another unprivileged user, the *keeper*
  (``keeper_for``): sandbox code cannot signal them, so the ``docker`` exec path can end an action with
  ``kill -9 -1`` as the sandbox user, which kills everything the action left (``docker_sweep``) and nothing
  else.
* Memory: a sandbox opened without ``mem`` (``mem_mib == 0``) gets ``SandboxLimits.mem_mib`` (the agent's
  ``sandbox_mem_mib``, else its ``mem_mib``, else the memory it offers: ``default_mem_mib``, as for process
  sandboxes); memory and memory+swap are the same (no swap).
* Disk (``SandboxLimits.disk_mib``, 0: no limit), enforced one of two ways, chosen once at agent start by
  ``choose_disk`` from what the daemon's storage driver allows:

  - ``storage_opt``: ``--storage-opt size=N`` caps the container's writable layer (overlay2 on xfs with
    ``pquota``, devicemapper, btrfs, zfs). Checked by creating (not starting) a container with it.
  - ``tmpfs``: elsewhere (overlay2 on ext4, as here): a read-only root file system, and ``/work`` and ``/tmp``
    as tmpfs volumes of ``disk_mib`` each (``local`` volume driver, anonymous: removed with the container).
    A write past the size fails with ENOSPC. tmpfs pages are memory: they also count against the sandbox's
    memory limit.

  When a disk limit is configured and neither way is possible, ``choose_disk`` raises ``ConfigError`` (the
  agent does not start) rather than run sandboxes without it.

The builders are pure but ``choose_disk`` (two or three Docker API calls).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from docker.types import DriverConfig, Mount

from agent.probe import mem_offer_mib, meminfo
from tangram.errors import ConfigError

from .base import WORKDIR, parse_owner

DEFAULT_USER = "65534:65534"
DEFAULT_DISK_MIB = 1024
MIN_MEM_MIB = 6  # dockerd refuses less
KEEPER = (65533, 65533)  # the container's own processes (init, sleeper); never the sandbox user
DISK_MODES = ("storage_opt", "tmpfs", "none")
# storage drivers whose `--storage-opt size` may work (overlay2 only on xfs mounted with pquota)
_SIZE_DRIVERS = ("overlay2", "devicemapper", "btrfs", "zfs")
log = logging.getLogger("agent.executors.docker")


@dataclass(frozen=True)
class SandboxLimits:
    user: str = DEFAULT_USER  # "uid:gid" of sandbox code (a sandbox's own SandboxSpec.user wins)
    mem_mib: int = 1024  # for a sandbox opened without `mem`
    disk_mib: int = DEFAULT_DISK_MIB  # writable space; 0: no limit
    disk: str = "tmpfs"  # how disk_mib is enforced: storage_opt | tmpfs | none (see choose_disk)

    def __post_init__(self) -> None:
        owner = parse_owner(self.user)
        if owner is None:
            raise ValueError("`user` must be 'uid:gid'")
        if self.mem_mib < MIN_MEM_MIB or self.disk_mib < 0:
            raise ValueError(f"`mem_mib` must be >= {MIN_MEM_MIB} and `disk_mib` >= 0")
        if self.disk not in DISK_MODES:
            raise ValueError(f"`disk` must be one of {DISK_MODES}, got {self.disk!r}")


def default_mem_mib(mem_mib: int | None) -> int:
    """The memory of a sandbox opened without ``mem``: ``mem_mib``; None: what the agent offers by default
    (``agent.probe.mem_offer_mib``). Raises ConfigError below what dockerd takes."""
    if mem_mib is None:
        mem_mib = mem_offer_mib(meminfo())
    if mem_mib < MIN_MEM_MIB:
        raise ConfigError(f"sandbox_mem_mib: {mem_mib} MiB is below the {MIN_MEM_MIB} MiB dockerd takes")
    return mem_mib


def keeper_for(owner: tuple[int, int]) -> tuple[int, int]:
    """The keeper's uid:gid for a sandbox user: ``KEEPER``, unless that is the sandbox user's uid."""
    return KEEPER if owner[0] != KEEPER[0] else (KEEPER[0] - 1, KEEPER[1] - 1)


def user_str(owner: tuple[int, int]) -> str:
    return f"{owner[0]}:{owner[1]}"


def mem_kwargs(mem_mib: int, limits: SandboxLimits) -> dict[str, Any]:
    """The memory limit of a sandbox asking for ``mem_mib`` (0: the default), swap included."""
    mem = f"{mem_mib or limits.mem_mib}m"
    return {"mem_limit": mem, "memswap_limit": mem}


def tmpfs_opts(size_mib: int, owner: tuple[int, int] | None, mode: int) -> dict[str, str]:
    """``local`` volume driver options for a tmpfs of ``size_mib`` (``owner`` None: root's)."""
    o = f"size={size_mib}m,mode={mode:o},nosuid,nodev"
    if owner is not None:
        o += f",uid={owner[0]},gid={owner[1]}"
    return {"type": "tmpfs", "device": "tmpfs", "o": o}


def disk_kwargs(limits: SandboxLimits, owner: tuple[int, int]) -> dict[str, Any]:
    """The ``containers.run`` arguments that enforce ``limits.disk_mib`` (see the module doc)."""
    if limits.disk_mib == 0 or limits.disk == "none":
        return {}
    if limits.disk == "storage_opt":
        return {"storage_opt": {"size": f"{limits.disk_mib}m"}}

    def volume(target: str, opts: dict[str, str]) -> Any:
        return Mount(target, "", type="volume", driver_config=DriverConfig("local", opts))

    return {
        "read_only": True,
        "mounts": [
            volume(WORKDIR, tmpfs_opts(limits.disk_mib, owner, 0o755)),
            volume("/tmp", tmpfs_opts(limits.disk_mib, None, 0o1777)),
        ],
    }


def choose_disk(client: Any, disk_mib: int, image: str) -> str:
    """How this daemon can enforce a disk limit of ``disk_mib`` (see the module doc): ``storage_opt``,
    ``tmpfs``, or ``none`` when ``disk_mib`` is 0. Raises ConfigError when neither way works."""
    if disk_mib == 0:
        return "none"
    info = client.info()
    driver = str(info.get("Driver", ""))
    status = {str(k): str(v) for k, v in (info.get("DriverStatus") or []) if isinstance(k, str)}
    fs = status.get("Backing Filesystem", "")
    why = f"storage driver {driver or '?'}" + (f" on {fs}" if fs else "")
    if driver in _SIZE_DRIVERS and (driver != "overlay2" or fs == "xfs"):
        err = _try_storage_opt(client, image, disk_mib)
        if err is None:
            return "storage_opt"
        why += f": --storage-opt size refused ({err})"
    else:
        why += ": no --storage-opt size"
    volume_drivers = (info.get("Plugins") or {}).get("Volume") or ["local"]
    if info.get("OSType", "linux") == "linux" and "local" in volume_drivers:
        log.info("sandbox disk limit %d MiB: tmpfs /work and /tmp, read-only root (%s)", disk_mib, why)
        return "tmpfs"
    raise ConfigError(
        f"sandbox_disk_mib: a disk limit of {disk_mib} MiB cannot be enforced by this dockerd ({why}, "
        f"and no local tmpfs volumes on {info.get('OSType', '?')})",
        hint="use a storage driver that supports --storage-opt size (overlay2 on xfs with pquota, btrfs, "
        "zfs), or set sandbox_disk_mib to 0 to run sandboxes without a disk limit",
    )


def _try_storage_opt(client: Any, image: str, disk_mib: int) -> str | None:
    """Create (never start) a container with ``--storage-opt size``; None when dockerd takes it."""
    try:
        cid = client.api.create_container(
            image,
            ["true"],
            host_config=client.api.create_host_config(
                storage_opt={"size": f"{disk_mib}m"}, network_mode="none"
            ),
            labels={"tangram.probe": "1"},
        )["Id"]
    except Exception as exc:  # noqa: BLE001 - docker.errors.APIError: the driver says no
        return " ".join(str(exc).split())[:200]
    try:
        client.api.remove_container(cid, force=True)
    except Exception as exc:  # noqa: BLE001 - it was accepted; a leftover probe is only untidy
        log.warning("cannot remove the storage-opt probe container %s: %s", cid[:12], exc)
    return None
