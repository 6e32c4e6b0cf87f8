"""A minimal ``/etc`` for sandboxes of the hostroot image, instead of the host's own.

The hostroot image (``images.HOSTROOT_IMAGE``) exists so that a sandbox runs the host's toolchain (its Python,
shell, libraries) without pulling an image: the host's ``/usr``, ``/bin`` and ``/lib*`` are bind-mounted
read-only. That toolchain reads a few files under ``/etc``, but the host's whole ``/etc`` would show sandbox
code ``/etc/shadow``, SSH host keys, ``/etc/ssl/private``, credentials in ``pip.conf``, ``npmrc`` or
``gitconfig``, and the like. So the agent writes an ``/etc`` of its own, mounted read-only:

* generated: ``passwd`` and ``group`` (root, the sandbox user, the keeper of ``docker_limits``, nobody),
  ``hosts``, ``hostname`` and ``resolv.conf`` (Docker mounts its own over these three; a sandbox has no
  network), ``nsswitch.conf`` (files only);
* copied from the host where they exist and are world-readable (``HOST_ETC``): what the toolchain needs and
  what holds no secret: the dynamic linker's cache and configuration, ``alternatives`` (the targets of links
  in ``/usr/bin``), CA certificates (``ssl/certs``, never ``ssl/private``), the time zone, Python's and Java's
  configuration, mime types, protocols and services, the OS release. Symlinks are copied as symlinks (they
  resolve inside the sandbox, mostly into the host's ``/usr``); anything not world-readable is left out.

The directory is content-addressed, ``<root>/<hash>``: written once and never changed while a container has it
mounted; a host whose files changed gets a new one. ``build`` is pure; ``ensure`` writes.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass

HOST_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl/certs",
    "ssl/openssl.cnf",
    "pki/tls/certs",
    "pki/ca-trust/extracted",
    "ca-certificates.conf",
    "localtime",
    "timezone",
    "locale.alias",
    "python3",
    "python3.*",
    "java-*",
    "mime.types",
    "magic",
    "magic.mime",
    "protocols",
    "services",
    "os-release",
    "debian_version",
    "lsb-release",
)
MAX_FILE = 8 << 20  # a larger "configuration file" is not copied
MAX_ENTRIES = 20000


@dataclass(frozen=True)
class Entry:
    path: str  # relative to /etc
    kind: str  # "dir", "file", "link"
    data: bytes = b""  # file contents, or the link's target


def users(owner: tuple[int, int], keeper: tuple[int, int]) -> tuple[str, str]:
    """``passwd`` and ``group`` for root, the sandbox user (home: the workdir), the keeper and nobody."""
    pw: dict[int, str] = {0: "root:x:0:0:root:/root:/bin/sh"}
    gr: dict[int, str] = {0: "root:x:0:"}
    pw.setdefault(owner[0], f"sandbox:x:{owner[0]}:{owner[1]}:tangram sandbox:/work:/bin/sh")
    gr.setdefault(owner[1], f"sandbox:x:{owner[1]}:")
    pw.setdefault(keeper[0], f"keeper:x:{keeper[0]}:{keeper[1]}:tangram sandbox keeper:/:/usr/sbin/nologin")
    gr.setdefault(keeper[1], f"keeper:x:{keeper[1]}:")
    pw.setdefault(65534, "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin")
    gr.setdefault(65534, "nogroup:x:65534:")
    return (
        "".join(line + "\n" for _, line in sorted(pw.items())),
        "".join(line + "\n" for _, line in sorted(gr.items())),
    )


def generated(owner: tuple[int, int], keeper: tuple[int, int]) -> list[Entry]:
    passwd, group = users(owner, keeper)
    files = {
        "passwd": passwd,
        "group": group,
        "hostname": "sandbox\n",
        "resolv.conf": "",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files\nnetworks: files\n"
        "protocols: files\nservices: files\n",
    }
    return [Entry(name, "file", text.encode()) for name, text in files.items()]


def _world_readable(st: os.stat_result) -> bool:
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    return st.st_mode & need == need


def host_entries(etc: str = "/etc", wanted: tuple[str, ...] = HOST_ETC) -> list[Entry]:
    """The ``wanted`` paths (globs allowed in the last component) under ``etc``, recursively."""
    out: list[Entry] = []
    seen: set[str] = set()
    for pattern in wanted:
        parent, _, leaf = pattern.rpartition("/")
        try:
            names = sorted(n for n in os.listdir(os.path.join(etc, parent)) if fnmatch.fnmatchcase(n, leaf))
        except OSError:
            continue
        for name in names:
            rel = f"{parent}/{name}" if parent else name
            if rel not in seen:
                seen.add(rel)
                _walk(etc, rel, out)
    return out


def _walk(etc: str, rel: str, out: list[Entry]) -> None:
    if len(out) >= MAX_ENTRIES:
        return
    path = os.path.join(etc, rel)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            out.append(Entry(rel, "link", os.readlink(path).encode()))
        elif not _world_readable(st):
            return
        elif stat.S_ISDIR(st.st_mode):
            out.append(Entry(rel, "dir"))
            for name in sorted(os.listdir(path)):
                _walk(etc, f"{rel}/{name}", out)
        elif stat.S_ISREG(st.st_mode) and st.st_size <= MAX_FILE:
            with open(path, "rb") as f:
                out.append(Entry(rel, "file", f.read(MAX_FILE + 1)[:MAX_FILE]))
    except OSError:
        return


def build(owner: tuple[int, int], keeper: tuple[int, int], etc: str = "/etc") -> tuple[str, list[Entry]]:
    """(content hash, entries): the host's files first, the generated ones over them."""
    entries = {e.path: e for e in host_entries(etc)}
    for e in generated(owner, keeper):
        entries[e.path] = e
    ordered = [entries[k] for k in sorted(entries)]
    h = hashlib.sha256()
    for e in ordered:
        for part in (e.path.encode(), e.kind.encode(), e.data):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()[:20], ordered


def ensure(root: str, owner: tuple[int, int], keeper: tuple[int, int], etc: str = "/etc") -> str:
    """The directory (under ``root``) to mount as the sandbox's ``/etc``; written when it is not there yet."""
    digest, entries = build(owner, keeper, etc)
    final = os.path.join(root, digest)
    if os.path.isdir(final):
        return final
    os.makedirs(root, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".new-", dir=root)
    try:
        for e in entries:
            dest = os.path.join(tmp, e.path)
            os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
            if e.kind == "dir":
                os.makedirs(dest, mode=0o755, exist_ok=True)
            elif e.kind == "link":
                os.symlink(e.data, dest)
            else:
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(e.data)
                os.chmod(dest, 0o644)  # whatever the umask
        for d, _, _ in os.walk(tmp):
            os.chmod(d, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # another agent made it meanwhile (rename onto a non-empty directory fails)
            if not os.path.isdir(final):
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return final
