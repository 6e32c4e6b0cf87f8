"""Pieces of the process executor (``process.py``): the argv of an action, what the executor knows of a
contained sandbox and of a running action, and small file helpers. Pure except ``_relocate`` and the
JSON helpers, which touch only the paths they are given."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass

from .proc_cgroups import SandboxGroup, Slot
from .proc_contain import closed_ancestor
from .spawn import kill_group
from .spawner import Job, Spawner

log = logging.getLogger("agent.executors.process")

KILL_GRACE_S = 5.0


def process_argv(cmd: str, mem_mib: int | None, prlimit: str | None) -> list[str]:
    """Pure: the argv of ``sh -c cmd`` (behind ``prlimit --as`` when a memory cap is asked for)."""
    argv: list[str] = []
    if prlimit and mem_mib:
        argv += [prlimit, f"--as={mem_mib << 20}", "--"]
    return [*argv, "/bin/sh", "-c", cmd]


JOIN_SELF = 'echo 0 > "$0" || exit 125; exec "$@"'


def joining_argv(join: str, argv: list[str]) -> list[str]:
    """Pure: ``argv`` behind a shell that first moves itself into a cgroup (``join``: its ``join_file``) and
    then execs it (for the agent's own spawns; the spawner moves itself instead)."""
    return ["/bin/sh", "-c", JOIN_SELF, join, *argv]


JOIN_DROP = 'umask 077; while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'


def dropping_argv(joins: list[str], user: tuple[int, int], setpriv: str, argv: list[str]) -> list[str]:
    """Pure: the agent's own spawn of a contained action: a root shell that moves itself into each of
    ``joins`` and then execs ``setpriv`` to become ``user`` (real, effective and saved ids: no capability
    left), with no supplementary groups, ``no_new_privs`` and empty inheritable and bounding sets."""
    uid, gid = user
    return [
        "/bin/sh",
        "-c",
        JOIN_DROP,
        "tangram-join",
        *joins,
        "--",
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
        *argv,
    ]


@dataclass
class _Sandbox:
    """A contained sandbox as this executor knows it."""

    name: str
    dir: str
    uid: int
    cg: SandboxGroup
    spawner: Spawner | None = None
    lock: asyncio.Lock | None = None
    failures: int = 0  # spawner starts that failed in a row
    gone: bool = False


@dataclass
class _Action:
    pid: int = 0  # spawned by the agent itself
    job: Job | None = None  # or by the spawner
    spawner: Spawner | None = None
    killed: bool = False
    timed_out: bool = False
    reaped: bool = False  # after this the pid may be reused: never signal it again
    cg: str | None = None  # the action's cgroup (trusted code only), until removed
    sb: _Sandbox | None = None  # contained: the action's sandbox
    slot: Slot | None = None  # and its slot, until given back or removed

    def kill(self) -> None:
        self.killed = True
        self.stop()

    def time_out(self) -> None:
        self.timed_out = True
        self.stop()

    def stop(self) -> None:
        if self.job is not None and self.spawner is not None:
            self.spawner.kill(self.job)
            if self.spawner.untrusted:  # sandbox code may have stopped it: then it never reports
                asyncio.get_running_loop().call_later(KILL_GRACE_S, self._check_reported)
        elif self.pid and not self.reaped:
            kill_group(self.pid)

    def _check_reported(self) -> None:
        if self.job is not None and self.spawner is not None and not self.job.exit.done():
            self.spawner.abandon("it did not report a killed action")


def _base_env() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/"),
    }


def _relocate(configured: str, home: str) -> None:
    """Contained sandboxes in ``home`` instead of ``configured`` (which sandbox users cannot reach): move
    what ``configured`` holds there (an earlier agent's sandboxes), and leave a symlink to it in its place."""
    os.makedirs(home, mode=0o711, exist_ok=True)
    why = closed_ancestor(os.path.realpath(configured))
    if os.path.islink(configured):
        os.unlink(configured)
    elif os.path.isdir(configured):
        for name in os.listdir(configured):
            try:
                os.rename(os.path.join(configured, name), os.path.join(home, name))
            except OSError as exc:
                log.warning("cannot move %s to %s: %s", os.path.join(configured, name), home, exc)
        try:
            os.rmdir(configured)
        except OSError as exc:
            log.warning("contained sandboxes are in %s; %s stays as it is: %s", home, configured, exc)
            return
    os.makedirs(os.path.dirname(configured), exist_ok=True)
    os.symlink(home, configured)
    log.info(
        "contained sandboxes are in %s (%s links there): their users could not pass through %s",
        home,
        configured,
        why,
    )


async def _stop_spawner(sp: Spawner, why: str) -> None:
    """End a sandbox's spawner now (it may be stopped by sandbox code: no waiting for it to leave)."""
    watch = sp.watch
    sp.abandon(why)
    if watch is not None:
        await watch.wait(KILL_GRACE_S)


def _read_json(path: str) -> dict:  # type: ignore[type-arg]
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: str, data: dict) -> None:  # type: ignore[type-arg]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(
        os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w", encoding="utf-8"
    ) as f:
        json.dump(data, f)
    os.replace(tmp, path)


def tidy_relocated(root: str, configured_root: str) -> None:
    """After close: a relocated sandbox root with no sandbox left goes (the next agent makes it again),
    and so does the symlink at the configured place."""
    with contextlib.suppress(OSError):
        with os.scandir(root) as it:
            entries = list(it)
        if any(e.is_dir(follow_symlinks=False) for e in entries):
            return
        for e in entries:
            os.unlink(e.path)  # (meta files of sandboxes gone)
        os.rmdir(root)
        if os.path.islink(configured_root):
            os.unlink(configured_root)
