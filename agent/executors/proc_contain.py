"""Can this host contain the process executor's sandboxes? What is missing, and the refusal that names it.

The process executor contains a sandbox only when all of these hold (``check``):

* the agent runs as root (it gives every sandbox a uid of its own, chowns its files, sets cgroup limits);
* a cgroup hierarchy to find and kill every process of an action, and the cpuset, memory and pids
  controllers (cgroup v1 or v2: ``proc_cgroups.pick_roles``);
* the sandbox uid range meets no account, group or subordinate id range of this host;
* no directory above the sandboxes is writable by every user (one could swap the sandboxes' parent);
  and every one lets other users through (``o+x``), or sandbox code could not open its own files by their
  absolute path (Python does, for a script): where the configured place is below one that does not (the
  default workdir is in root's home, usually 0700), ``sandbox_home`` puts them under ``RELOCATED_BASE``;
* the cgroups can really be made and joined (``proc_cgroups.SandboxCgroups.probe``, done by the executor).

Where they do not, the executor refuses to start (``ContainmentUnavailable``, a ``ConfigError``: the agent
exits 2 and logs it) unless the operator said ``trusted_code_only``: then actions run as before, as the
agent's own user, with no containment. ``tangram up`` on a laptop passes that flag itself when it has to
(tangram_cli/bootstrap/local.py) and says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass, field

from tangram.errors import ConfigError

from .cgroups import Hierarchy
from .proc_cgroups import Roles, SandboxCgroups, discover_roles
from .users import DEFAULT_BASE, DEFAULT_COUNT, range_conflicts

FLAG = "`trusted_code_only: true` (--trusted-code-only)"
RELOCATED_BASE = "/var/lib/tangram/sandboxes"


class ContainmentUnavailable(ConfigError):
    """The process executor cannot contain sandboxes here and was not told that the code is trusted."""


@dataclass
class Containment:
    """What ``check`` found: the cgroup roles to use, or what is missing (empty: sandboxes are contained)."""

    roles: Roles | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.roles is not None and not self.missing


def check(
    *,
    kill: Hierarchy | None = None,
    use_cgroups: bool = True,
    uid_base: int = DEFAULT_BASE,
    uid_count: int = DEFAULT_COUNT,
    sandbox_root: str | None = None,
    probe: bool = False,
) -> Containment:
    """The static checks of the module doc (the executor then makes the cgroups for real; ``probe``: so
    does this, in a throw-away node, for a caller that starts an agent and wants to know first)."""
    out = Containment()
    euid = os.geteuid()
    if euid != 0:
        out.missing.append(
            f"the agent runs as uid {euid}, not root, so it cannot give each sandbox a user "
            "of its own nor set cgroup limits"
        )
    if not use_cgroups:
        out.missing.append("action cgroups are switched off")
    else:
        try:
            out.roles, lacking = discover_roles(kill)
        except OSError as exc:
            out.roles, lacking = None, [f"cannot read the cgroup mounts: {exc}"]
        out.missing += lacking
    conflicts = range_conflicts(uid_base, uid_count)
    if conflicts:
        shown = ", ".join(conflicts[:4]) + (f" and {len(conflicts) - 4} more" if len(conflicts) > 4 else "")
        last = uid_base + uid_count - 1
        out.missing.append(
            f"the sandbox uid range {uid_base}-{last} is in use ({shown}); "
            "set sandbox_uid_base / sandbox_uid_count"
        )
    if sandbox_root is not None:
        bad = open_ancestor(sandbox_root)
        if bad:
            out.missing.append(f"{bad} (above the sandbox directories) is writable by every user")
    if probe and out.roles is not None and not out.missing:
        sbcg = None
        try:
            sbcg = SandboxCgroups(out.roles, "probe", f"probe-{os.getpid()}")
            sbcg.probe([min(os.sched_getaffinity(0))])
        except Exception as exc:  # noqa: BLE001 - whatever it is, sandboxes cannot be contained
            out.missing.append(f"cannot use cgroups for sandboxes ({out.roles.label}): {exc}")
        finally:
            if sbcg is not None:
                with contextlib.suppress(OSError):
                    sbcg.close()
    return out


def closed_ancestor(path: str) -> str | None:
    """The first existing directory above ``path`` that other users cannot pass through (no ``o+x``);
    None when they can reach ``path`` (directories still to be made are made 0755 or 0711)."""
    path = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return path
        except FileNotFoundError:
            pass
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def sandbox_home(configured: str, base: str | None = None) -> str:
    """Where contained sandboxes live: ``configured`` (its symlinks resolved) when sandbox users can reach
    it, else ``<base>/<hash of configured>`` (the executor then leaves a symlink at ``configured``). The
    base: ``RELOCATED_BASE``, or ``<tmp>/tangram-sandboxes`` for a ``configured`` in the temporary directory
    (an agent whose workdir is temporary leaves nothing in /var/lib) when that is root's and no one else's."""
    real = os.path.realpath(configured)
    if closed_ancestor(real) is None:
        return real
    if base is None:
        base = RELOCATED_BASE
        tmp = os.path.realpath(tempfile.gettempdir())
        if real.startswith(tmp.rstrip("/") + "/") and _roots_own(os.path.join(tmp, "tangram-sandboxes")):
            base = os.path.join(tmp, "tangram-sandboxes")
    return os.path.join(base, _key(configured))


def relocated(configured: str, home: str) -> bool:
    """Whether ``home`` (from ``sandbox_home``) is a relocation of ``configured``."""
    return os.path.basename(home) == _key(configured) and home != os.path.abspath(configured)


def _key(configured: str) -> str:
    return hashlib.sha256(os.path.abspath(configured).encode()).hexdigest()[:16]


def _roots_own(path: str) -> bool:
    """``path`` is (now) a directory of root's that nobody else may write to: not someone's trap in /tmp."""
    with contextlib.suppress(FileExistsError, PermissionError):
        os.mkdir(path, 0o711)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def open_ancestor(path: str) -> str | None:
    """The first existing directory at or above ``path`` that every user may write to without the sticky
    bit (so that anyone could rename what is in it); None when there is none."""
    path = os.path.abspath(path)
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def refusal(missing: list[str]) -> ContainmentUnavailable:
    return ContainmentUnavailable(
        "the process executor cannot contain sandboxes on this host: " + "; ".join(missing),
        hint="run the agent as root on a host with the cpuset, memory and pids cgroup controllers (cgroup "
        "v1 or v2), or use the docker executor; only if every action runs trusted code, set "
        f"{FLAG} to run actions as the agent's own user without any containment",
    )
