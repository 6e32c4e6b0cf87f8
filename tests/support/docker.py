"""Session fixtures for real Docker: a daemon (the running one, or a private one), local images, a sweep.

* ``docker_client``: ``docker.DockerClient`` to ``$DOCKER_HOST`` or ``/var/run/docker.sock``; when neither
  answers and we are root with ``dockerd`` installed, a private dockerd with its own data-root, exec-root,
  pidfile and socket under a temporary directory (``--bridge=none --iptables=false --ip-forward=false``),
  stopped at session end.
* ``busybox_image`` / ``hostroot_image``: the tags of the ``docker import`` images (built once, reused).
* ``test_labels``: labels every test container carries; at session end containers with these labels are
  removed (only this session's, so parallel runs against a shared daemon leave each other alone).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

SESSION = uuid.uuid4().hex[:12]
TEST_LABELS = {"tangram.test": "1", "tangram.test.session": SESSION}
DEFAULT_SOCK = "/var/run/docker.sock"
START_TIMEOUT_S = 60.0


def _ping(base_url: str) -> bool:
    """True when a Docker daemon answers ``GET /_ping`` at ``base_url`` (unix sockets are probed
    with a plain socket, so a dead daemon leaks nothing)."""
    if base_url.startswith("unix://"):
        import socket

        path = base_url[len("unix://"):]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(path)
                sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
                return b" 200 " in sock.recv(256)
        except OSError:
            return False
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.DockerClient(base_url=base_url, timeout=5)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def running_daemon_url() -> str | None:
    url = os.environ.get("DOCKER_HOST") or f"unix://{DEFAULT_SOCK}"
    if url.startswith("unix://") and not os.path.exists(url[len("unix://"):]):
        return None
    return url if _ping(url) else None


def can_start_private() -> bool:
    return os.geteuid() == 0 and shutil.which("dockerd") is not None


def docker_available() -> str | None:
    """None when Docker is usable, else the reason it is not."""
    try:
        import docker  # noqa: F401
    except ImportError:
        return "the docker SDK is not installed"
    if running_daemon_url() or can_start_private():
        return None
    return "no dockerd answers and a private one cannot be started (needs root and dockerd)"


def dockerd_argv(tmp: str) -> list[str]:
    return ["dockerd", "--bridge=none", "--iptables=false", "--ip-forward=false",
            f"--data-root={tmp}/data", f"--exec-root={tmp}/exec", f"--pidfile={tmp}/docker.pid",
            "-H", f"unix://{tmp}/docker.sock"]


@contextlib.contextmanager
def private_dockerd() -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix="tangram-dockerd-")
    log = open(os.path.join(tmp, "dockerd.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(dockerd_argv(tmp), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"unix://{tmp}/docker.sock"
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while not (os.path.exists(f"{tmp}/docker.sock") and _ping(url)):
            if proc.poll() is not None or time.monotonic() > end:
                with open(os.path.join(tmp, "dockerd.log"), "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"private dockerd did not start:\n{tail}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def sweep(client: Any, labels: dict[str, str]) -> int:
    flt = {"label": [f"{k}={v}" for k, v in labels.items()]}
    removed = 0
    for c in client.containers.list(all=True, filters=flt):
        with contextlib.suppress(Exception):
            c.remove(force=True, v=True)
            removed += 1
    return removed


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    reason = docker_available()
    if reason:
        pytest.skip(reason)
    import docker

    with contextlib.ExitStack() as stack:
        url = running_daemon_url() or stack.enter_context(private_dockerd())
        client = docker.DockerClient(base_url=url, timeout=60)
        stack.callback(client.close)
        try:
            yield client
        finally:
            sweep(client, TEST_LABELS)


@pytest.fixture(scope="session")
def busybox_image(docker_client: Any) -> str:
    from agent.executors.images import ensure_busybox_image

    return ensure_busybox_image(docker_client)


@pytest.fixture(scope="session")
def hostroot_image(docker_client: Any) -> str:
    from agent.executors.images import ensure_hostroot_image

    return ensure_hostroot_image(docker_client)


@pytest.fixture(scope="session")
def test_labels() -> dict[str, str]:
    return dict(TEST_LABELS)
