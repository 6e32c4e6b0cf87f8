"""put/get through the Docker archive API (used when the agent cannot reach /proc/<pid>/root).

Every component under the workdir is stat-ed with HEAD first and a symlink anywhere is refused, so a
copy never follows a link out of the workdir. Reads are bounded by ``max_bytes``.
"""
from __future__ import annotations

import base64
import io
import json
import posixpath
import tarfile
from typing import Any

from .base import PathRejected, TooLarge

GO_MODE_DIR = 1 << 31
GO_MODE_SYMLINK = 1 << 27
GO_MODE_IRREGULAR = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)


def _stat(api: Any, cid: str, path: str) -> dict[str, Any] | None:
    res = api.head(api._url("/containers/{0}/archive", cid), params={"path": path})
    if res.status_code == 404:
        return None
    api._raise_for_status(res)
    header = res.headers.get("x-docker-container-path-stat")
    return json.loads(base64.b64decode(header)) if header else None


def _walk(api: Any, cid: str, workdir: str, parts: list[str]) -> list[dict[str, Any] | None]:
    """Stat of each prefix; refuses a symlink or non-directory on the way."""
    stats, path = [], workdir
    for i, name in enumerate(parts):
        path = posixpath.join(path, name)
        st = _stat(api, cid, path)
        stats.append(st)
        if st is None:
            break
        if st["mode"] & GO_MODE_SYMLINK or st.get("linkTarget"):
            raise PathRejected(f"{'/'.join(parts[:i + 1])!r} is a symlink")
        if i < len(parts) - 1 and not st["mode"] & GO_MODE_DIR:
            raise PathRejected(f"{'/'.join(parts[:i + 1])!r} is not a directory")
    return stats


def get(api: Any, cid: str, workdir: str, parts: list[str], max_bytes: int) -> bytes:
    stats = _walk(api, cid, workdir, parts)
    st = stats[-1] if len(stats) == len(parts) else None
    if st is None:
        raise PathRejected(f"{'/'.join(parts)!r} does not exist")
    if st["mode"] & GO_MODE_IRREGULAR:
        raise PathRejected(f"{'/'.join(parts)!r} is not a regular file")
    if st["size"] > max_bytes:
        raise TooLarge(f"{'/'.join(parts)!r} is larger than {max_bytes} bytes")
    stream, _ = api.get_archive(cid, posixpath.join(workdir, *parts))
    buf = bytearray()
    for chunk in stream:
        buf += chunk
        if len(buf) > max_bytes + 64 * 1024:
            raise TooLarge(f"{'/'.join(parts)!r} grew past {max_bytes} bytes")
    with tarfile.open(fileobj=io.BytesIO(bytes(buf))) as tar:
        member = tar.next()
        if member is None or not member.isreg():
            raise PathRejected(f"{'/'.join(parts)!r} is not a regular file")
        f = tar.extractfile(member)
        assert f is not None
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(f"{'/'.join(parts)!r} is larger than {max_bytes} bytes")
    return data


def put(api: Any, cid: str, workdir: str, parts: list[str], data: bytes,
        owner: tuple[int, int] | None) -> None:
    stats = _walk(api, cid, workdir, parts)
    existing = len(stats) - (1 if stats and stats[-1] is None else 0)
    existing = min(existing, len(parts) - 1)  # the deepest existing parent directory
    buf = io.BytesIO()
    uid, gid = owner or (0, 0)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for depth in range(existing + 1, len(parts)):
            info = tarfile.TarInfo("/".join(parts[existing:depth]))
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, gid
            tar.addfile(info)
        info = tarfile.TarInfo("/".join(parts[existing:]))
        info.size, info.mode, info.uid, info.gid = len(data), 0o644, uid, gid
        tar.addfile(info, io.BytesIO(data))
    dest = posixpath.join(workdir, *parts[:existing])
    if not api.put_archive(cid, dest, buf.getvalue()):
        raise PathRejected(f"docker refused to write {'/'.join(parts)!r}")


def chown_dir(api: Any, cid: str, path: str, owner: tuple[int, int], mode: int = 0o755) -> None:
    """Give ``path`` (a directory) to ``owner`` by extracting a one-entry tar over it."""
    parent, name = posixpath.split(path.rstrip("/"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, *owner
        tar.addfile(info)
    if not api.put_archive(cid, parent or "/", buf.getvalue()):
        raise PathRejected(f"docker refused to chown {path!r}")
