"""Sandbox users of the process executor: one unprivileged uid (and the gid of the same number) per sandbox.

The uids come from a range that no real account uses (``DEFAULT_BASE`` + 0 .. ``DEFAULT_COUNT`` - 1 unless
configured; ``range_conflicts`` checks it against ``/etc/passwd``, ``/etc/group``, ``/etc/subuid`` and
``/etc/subgid``); there is no passwd entry for them. Several agents may run on one host, each with its own
sandboxes, so a uid is *claimed* host-wide: ``CLAIMS_DIR/<uid>`` is a symlink to the sandbox directory that
has it, made with ``symlink`` (atomic: two agents cannot both make it). A claim whose directory is gone, or no
longer owned by that uid, is stale and may be taken again. New uids are handed out round-robin from a
counter kept in the claims directory (``next``, under ``flock``), so a uid comes back only after the whole
range went round: files a destroyed sandbox left where ``remove_owned`` does not look cannot reach the
next sandbox soon.

Everything here is synchronous (the executor calls it from worker threads) and needs root for the
``chown``s; the pure helpers are ``parse_id_ranges`` and ``overlaps``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterable

DEFAULT_BASE = 2_000_000
DEFAULT_COUNT = 1_000_000
CLAIMS_DIR = "/var/lib/tangram/sandbox-uids"
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable places a sandbox user can leave files in


class UidError(OSError):
    """No free uid, or a claim that cannot be made."""


# ---------------------------------------------------------------- pure


def parse_id_ranges(text: str, kind: str) -> list[tuple[str, int, int]]:
    """``kind`` "passwd"/"group": (name, id, id + 1) per entry; "sub": (name, start, start + count) per
    ``/etc/subuid`` line. Malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        try:
            if kind == "sub" and len(parts) >= 3:
                out.append((parts[0], int(parts[1]), int(parts[1]) + int(parts[2])))
            elif kind in ("passwd", "group") and len(parts) >= 3:
                out.append((parts[0], int(parts[2]), int(parts[2]) + 1))
        except ValueError:
            continue
    return out


def overlaps(base: int, count: int, ranges: Iterable[tuple[str, int, int]]) -> list[str]:
    """The names whose id range meets [base, base + count)."""
    return [name for name, lo, hi in ranges if lo < base + count and base < hi]


def range_conflicts(base: int, count: int, root: str = "/") -> list[str]:
    """``"/etc/passwd: alice"``-style entries that use an id in the range (files that do not exist count
    as empty)."""
    out = []
    for rel, kind in (
        ("etc/passwd", "passwd"),
        ("etc/group", "group"),
        ("etc/subuid", "sub"),
        ("etc/subgid", "sub"),
    ):
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        out += [f"/{rel}: {name}" for name in overlaps(base, count, parse_id_ranges(text, kind))]
    return out


# ---------------------------------------------------------------- claims


class UidPool:
    """Claims of one host (``claims_dir``) over [base, base + count)."""

    def __init__(
        self, base: int = DEFAULT_BASE, count: int = DEFAULT_COUNT, claims_dir: str = CLAIMS_DIR
    ) -> None:
        if base < 1000 or count < 1 or base + count > 2**32 - 2:
            raise ValueError(f"bad sandbox uid range {base} + {count}")
        self.base, self.count, self.dir = base, count, claims_dir

    def __contains__(self, uid: int) -> bool:
        return self.base <= uid < self.base + self.count

    def _claim_path(self, uid: int) -> str:
        return os.path.join(self.dir, str(uid))

    def _stale(self, uid: int) -> bool:
        """True when the claim of ``uid`` (if any) no longer holds: its directory is gone or not its own."""
        try:
            target = os.readlink(self._claim_path(uid))
        except FileNotFoundError:
            return True
        except OSError:  # not a symlink: not ours to judge
            return False
        try:
            return os.lstat(target).st_uid != uid
        except FileNotFoundError:
            return True

    def _locked(self):  # type: ignore[no-untyped-def]
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def claim(self, sandbox_dir: str) -> int:
        """A free uid, claimed for ``sandbox_dir`` (the caller then chowns the directory to it)."""
        fd = self._locked()
        try:
            nxt = _read_int(os.path.join(self.dir, "next"))
            for i in range(self.count):
                k = (nxt + i) % self.count
                uid = self.base + k
                if self._take(uid, sandbox_dir):
                    _write_int(os.path.join(self.dir, "next"), (k + 1) % self.count)
                    return uid
        finally:
            os.close(fd)
        raise UidError(errno.EUSERS, f"no free sandbox uid in {self.base}..{self.base + self.count - 1}")

    def _take(self, uid: int, sandbox_dir: str) -> bool:
        path = self._claim_path(uid)
        try:
            os.symlink(sandbox_dir, path)
            return True
        except FileExistsError:
            pass
        if not self._stale(uid):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            os.symlink(sandbox_dir, path)
        except FileExistsError:
            return False
        return True

    def holds(self, uid: int, sandbox_dir: str) -> bool:
        """Is ``uid`` claimed for ``sandbox_dir``? Retakes a lost or stale claim when it can."""
        if uid not in self:
            return False
        try:
            if os.readlink(self._claim_path(uid)) == sandbox_dir:
                return True
        except OSError:
            pass
        fd = self._locked()
        try:
            return self._take(uid, sandbox_dir)
        finally:
            os.close(fd)

    def release(self, uid: int, sandbox_dir: str) -> None:
        """Drop the claim of ``uid`` if it is ``sandbox_dir``'s."""
        path = self._claim_path(uid)
        try:
            if os.readlink(path) == sandbox_dir:
                os.unlink(path)
        except OSError:
            pass


def _read_int(path: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            return max(0, int(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0


def _write_int(path: str, value: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{value}\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- files of a sandbox user


def chown_tree(path: str, uid: int, gid: int) -> None:
    """Give ``path`` and everything below it to ``uid:gid`` without following symlinks (a directory left by
    an agent that ran actions as root, adopted by one that contains them)."""
    os.chown(path, uid, gid, follow_symlinks=False)
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)


def remove_owned(uid: int, places: Iterable[str] = SHARED_TMP) -> int:
    """Remove the entries directly under ``places`` that ``uid`` owns (what a sandbox user left in /tmp and
    the like); returns how many. Symlinks are removed, never followed."""
    removed = 0
    for place in places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
                if st.st_uid != uid:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(e.path)  # fd-based on Linux: does not follow symlinks inside
                else:
                    os.unlink(e.path)
                removed += 1
            except OSError:
                continue
    return removed
