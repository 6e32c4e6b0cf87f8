"""PutFile / GetFile in a contained process sandbox: the agent (root) touching a directory that sandbox code
owns and may change at any moment.

Both walk the path one component at a time from a descriptor of the sandbox directory (whose parent the
sandbox user cannot write: the directory itself cannot be swapped), with ``O_NOFOLLOW`` everywhere, so a
symlink is refused wherever it is (``PathRejected``). Beyond that:

* ``put`` creates missing directories and gives them to the sandbox user, and refuses a directory on the way
  that is not the sandbox user's. The file written is one the sandbox user owns with a single link (then it
  is truncated and rewritten, keeping its mode), or a new one made with ``O_EXCL`` after the name was
  unlinked: never a hard link to some other file (protected_hardlinks off, or a link made before), never a
  FIFO or device. It ends up owned by the sandbox's uid and gid.
* ``get`` reads only a regular file that the sandbox user owns: a hard link to a file of root's (which
  the sandbox could make where ``fs.protected_hardlinks`` is 0) is refused.
"""

from __future__ import annotations

import os
import stat

from .base import PathRejected, read_regular

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(root: str, parts: list[str], uid: int, gid: int, create: bool) -> int:
    """A descriptor of the directory that holds ``parts[-1]``."""
    fd = os.open(root, _DIR)
    try:
        for name in parts[:-1]:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    made = True
                except FileExistsError:
                    made = False
            try:
                nxt = os.open(name, _DIR, dir_fd=fd)
            except OSError as exc:
                raise PathRejected(f"cannot open {'/'.join(parts)!r}: {exc.strerror}") from exc
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            if create and made:
                os.fchown(fd, uid, gid)
            elif create and st.st_uid != uid:
                raise PathRejected(f"{name!r} in {'/'.join(parts)!r} is not the sandbox's")
        return fd
    except BaseException:
        os.close(fd)
        raise


def put(root: str, parts: list[str], data: bytes, uid: int, gid: int) -> None:
    parent = _walk(root, parts, uid, gid, create=True)
    name = "/".join(parts)
    try:
        fd = _open_own(parent, parts[-1], uid)
        if fd is None:
            fd = _create(parent, parts[-1], name)
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as f:
        os.fchown(fd, uid, gid)
        f.write(data)


def _open_own(parent: int, leaf: str, uid: int) -> int | None:
    """The existing file, truncated, when it is a regular file of the sandbox user (one link); else None."""
    try:
        fd = os.open(leaf, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None  # none, a symlink, a directory, a FIFO without reader...: the unlink path decides
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_nlink == 1:
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    return None


def _create(parent: int, leaf: str, name: str) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            os.unlink(leaf, dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError as exc:  # EISDIR, EPERM: a directory
            raise PathRejected(f"cannot write {name!r}: {exc.strerror}") from exc
        try:
            return os.open(leaf, flags, 0o644, dir_fd=parent)
        except FileExistsError:  # sandbox code made it again meanwhile
            continue
        except OSError as exc:
            raise PathRejected(f"cannot write {name!r}: {exc.strerror}") from exc
    raise PathRejected(f"cannot write {name!r}: it keeps coming back")


def get(root: str, parts: list[str], max_bytes: int, uid: int) -> bytes:
    return read_regular(_walk(root, parts, uid, uid, create=False), parts, max_bytes, uid)
