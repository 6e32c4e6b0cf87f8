"""Local sandbox images built with ``docker import`` (no registry needed).

* ``tangram/hostroot:1``: only empty mount-point directories. Sandboxes from it bind-mount the host's
  ``/usr``, ``/bin`` and ``/lib*`` read-only (``hostroot_mounts()``), so the host's Python runs inside
  without pulling anything. Not the host's ``/etc``: the Docker executor mounts a minimal one of its own
  (``sandbox_etc``: generated users, and the few host files the toolchain needs, none of them secret).
* ``tangram-test:busybox``: a static busybox with its applet links, for small failure-case sandboxes.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from typing import Any

import docker.errors

HOSTROOT_IMAGE = "tangram/hostroot:1"
BUSYBOX_IMAGE = "tangram-test:busybox"
HOSTROOT_DIRS = ("usr", "bin", "lib", "lib64", "etc", "sbin", "tmp", "work", "proc", "sys", "dev")
# Not /sbin: `--init` mounts /sbin/docker-init, which cannot sit on a read-only bind of the host's /sbin.
# The image keeps an empty /sbin; the host's sbin tools are still reachable as /usr/sbin on merged-usr hosts.
HOSTROOT_BINDS = ("/usr", "/bin", "/lib", "/lib64")
SKELETON_DIRS = ("bin", "etc", "tmp", "work", "proc", "sys", "dev")


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o1777 if name in ("tmp", "work") else mode  # any sandbox user may write its workdir
    tar.addfile(info)


def hostroot_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in HOSTROOT_DIRS:
            _add_dir(tar, name)
    return buf.getvalue()


def busybox_tar(busybox: str) -> bytes:
    """A rootfs with /bin/busybox and one symlink per applet."""
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in SKELETON_DIRS:
            _add_dir(tar, name)
        tar.add(busybox, arcname="bin/busybox")
        for applet in applets:
            if applet != "busybox" and "/" not in applet:
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type, link.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(link)
    return buf.getvalue()


def hostroot_mounts(etc_dir: str | None = None) -> dict[str, dict[str, str]]:
    """Docker SDK ``volumes=`` for the host directories that exist here, all read-only; ``etc_dir`` (a
    ``sandbox_etc.ensure`` directory) becomes ``/etc`` (None: the image's empty one)."""
    out = {p: {"bind": p, "mode": "ro"} for p in HOSTROOT_BINDS if os.path.exists(p)}
    if etc_dir is not None:
        out[etc_dir] = {"bind": "/etc", "mode": "ro"}
    return out


def has_image(client: Any, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_image(client: Any, tag: str, build: Callable[[], bytes]) -> str:
    """``docker import`` the tar from ``build()`` as ``tag`` unless it exists; returns the tag."""
    if not has_image(client, tag):
        repository, _, version = tag.rpartition(":")
        client.api.import_image_from_data(build(), repository=repository, tag=version)
    return tag


def ensure_hostroot_image(client: Any) -> str:
    return ensure_image(client, HOSTROOT_IMAGE, hostroot_tar)


def ensure_busybox_image(client: Any, tag: str = BUSYBOX_IMAGE) -> str:
    busybox = shutil.which("busybox") or "/bin/busybox"
    return ensure_image(client, tag, lambda: busybox_tar(busybox))
