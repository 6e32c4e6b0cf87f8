"""Executor contract: sandboxes and per-action runs on granted cores.

Rules for every executor:

1. ``create_sandbox`` is called once per sandbox name; ``destroy_sandbox`` is idempotent.
2. ``run`` places the action on exactly ``req.cores`` for its whole life and gives the cores back
   (the sandbox returns to the idle set) when it ends, however it ends.
3. ``kill(action)`` kills the action's whole process tree; ``run`` then answers ``killed=True``.
   A deadline (``timeout_s``) does the same and answers ``timed_out=True``.
4. Output is capped per stream at ``req.output_cap`` bytes; nothing beyond the cap is buffered.
5. ``put``/``get`` take paths relative to the sandbox workdir (or absolute under it); ``..``, NUL and
   symlinks are refused, and ``get`` is bounded.

The helpers at the bottom are pure (apart from the ``*_nofollow`` file helpers, which only touch the
directory fd they are given).
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Protocol, runtime_checkable

from tangram import units

MiB = 1 << 20
DEFAULT_OUTPUT_CAP = 16 * MiB
DEFAULT_GET_CAP = 64 * MiB
WORKDIR = "/work"

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_ACTION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_ENV_DENY = frozenset({"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT"})


class ExecutorError(Exception):
    """Base of executor failures."""


class SandboxNotFound(ExecutorError):
    pass


class PathRejected(ExecutorError, ValueError):
    pass


class TooLarge(ExecutorError):
    pass


@dataclass(frozen=True)
class SandboxSpec:
    sandbox: str
    image: str
    mem_mib: int
    labels: dict[str, str] = field(default_factory=dict)
    pids_limit: int = 512
    user: str | None = None  # "uid:gid"; None keeps the image's user


@dataclass(frozen=True)
class RunRequest:
    action: str
    sandbox: str
    cmd: str
    cores: tuple[int, ...]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 60.0
    dop: int = 1
    output_cap: int = DEFAULT_OUTPUT_CAP
    stdin: bytes | None = None


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    killed: bool
    run_s: float
    setup_s: float
    cores: tuple[int, ...]


@runtime_checkable
class Executor(Protocol):
    async def create_sandbox(self, spec: SandboxSpec) -> None: ...
    async def destroy_sandbox(self, sandbox: str) -> None: ...
    async def run(self, req: RunRequest) -> RunResult: ...
    async def kill(self, action: str) -> bool: ...
    async def put(self, sandbox: str, path: str, data: bytes) -> None: ...
    async def get(self, sandbox: str, path: str, max_bytes: int = DEFAULT_GET_CAP) -> bytes: ...
    async def list_sandboxes(self) -> list[str]: ...
    async def close(self) -> None: ...


# ---------------------------------------------------------------- validation


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"`{kind}` must match {_NAME_RE.pattern}, got {value!r}")
    return value


def check_action(action: str) -> str:
    if not isinstance(action, str) or not _ACTION_RE.match(action):
        raise ValueError(f"`action` must match {_ACTION_RE.pattern}, got {action!r}")
    return action


def check_env(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not _ENV_KEY_RE.match(key) or key in _ENV_DENY:
            raise ValueError(f"environment key {key!r} is not allowed")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"environment value of {key!r} must be a string without NUL")
    return env


def check_request(req: RunRequest, allowed: Iterable[int] | None = None) -> None:
    check_action(req.action)
    check_name("sandbox", req.sandbox)
    check_env(req.env)
    if not req.cores or len(set(req.cores)) != len(req.cores):
        raise ValueError(f"`cores` must be non-empty and distinct, got {req.cores!r}")
    if allowed is not None and not set(req.cores) <= set(allowed):
        raise ValueError(f"`cores` {req.cores!r} outside the allowed set {sorted(allowed)!r}")
    if not 0 < req.timeout_s < 86400 or req.timeout_s != req.timeout_s:
        raise ValueError(f"`timeout_s` must be in (0, 86400), got {req.timeout_s!r}")
    if req.dop < 1 or req.output_cap < 0:
        raise ValueError("`dop` must be >= 1 and `output_cap` >= 0")


# ---------------------------------------------------------------- cpusets


# One cpulist syntax everywhere (docs/cli.md, "Units"): the executors' names for tangram.units'.
format_cpuset = units.format_cpulist
parse_cpuset = units.parse_cpulist


# ---------------------------------------------------------------- commands and output


def expand_dop(cmd: str, dop: int, env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """Replace the literal ``{dop}`` in ``cmd`` and set ``TANGRAM_DOP`` in a copy of ``env``."""
    if dop < 1:
        raise ValueError(f"`dop` must be >= 1, got {dop}")
    out = dict(env or {})
    out["TANGRAM_DOP"] = str(dop)
    return cmd.replace("{dop}", str(dop)), out


def exit_status(returncode: int) -> int:
    """asyncio's -N (killed by signal N) -> the shell convention 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class OutputCollector:
    """Keeps the first ``cap`` bytes of a stream; counts (and drops) the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.cap - len(self._buf)
        if room > 0:
            self._buf += chunk[:room]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def value(self) -> bytes:
        return bytes(self._buf)


# ---------------------------------------------------------------- safe file access


def split_relpath(path: str, workdir: str = WORKDIR) -> list[str]:
    """Path relative to the workdir as components; refuses escapes, NUL and empty names."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise PathRejected(f"bad path {path!r}")
    p = PurePosixPath(path)
    if p.is_absolute():
        try:
            p = p.relative_to(workdir)
        except ValueError:
            raise PathRejected(f"absolute path {path!r} is outside {workdir}") from None
    parts = [s for s in p.parts if s not in ("", ".")]
    if not parts or any(s == ".." for s in parts):
        raise PathRejected(f"path {path!r} escapes the workdir or names it")
    return parts


def _open_parent(root_fd: int, parts: list[str], create: bool) -> int:
    fd = os.dup(root_fd)
    try:
        for name in parts[:-1]:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except OSError as exc:
        os.close(fd)
        raise PathRejected(f"cannot open {'/'.join(parts)!r}: {exc.strerror}") from exc


def read_nofollow(root: str, parts: list[str], max_bytes: int) -> bytes:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent = _open_parent(root_fd, parts, create=False)
    finally:
        os.close(root_fd)
    return read_regular(parent, parts, max_bytes)


def read_regular(parent: int, parts: list[str], max_bytes: int, uid: int | None = None) -> bytes:
    """Read ``parts[-1]`` in the directory ``parent`` (an fd, closed here) without following a symlink: a
    regular file only (owned by ``uid`` when given), at most ``max_bytes``."""
    name = "/".join(parts)
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent)
    except OSError as exc:
        raise PathRejected(f"cannot open {name!r}: {exc.strerror}") from exc
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathRejected(f"{name!r} is not a regular file")
        if uid is not None and st.st_uid != uid:
            raise PathRejected(f"{name!r} is not the sandbox's (owner uid {st.st_uid})")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(f"{name!r} is larger than {max_bytes} bytes")
    return data


def write_nofollow(root: str, parts: list[str], data: bytes, owner: tuple[int, int] | None = None) -> None:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent = _open_parent(root_fd, parts, create=True)
    finally:
        os.close(root_fd)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(parts[-1], flags, 0o644, dir_fd=parent)
    except OSError as exc:
        raise PathRejected(f"cannot write {'/'.join(parts)!r}: {exc.strerror}") from exc
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PathRejected(f"{'/'.join(parts)!r} is not a regular file")
        f.write(data)
        if owner is not None:
            os.fchown(fd, *owner)


def parse_owner(user: str | None) -> tuple[int, int] | None:
    if user is None:
        return None
    uid, _, gid = user.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise ValueError(f"`user` must be 'uid[:gid]' numbers, got {user!r}")
    return int(uid), int(gid or uid)
