"""A real OpenSSH server per test, on 127.0.0.x: each address of 127.0.0.0/8 stands for one "node",
with its own sshd, so a multi-node inventory is tested on one machine.

    def test_probe(sshd_factory, ssh_key):
        server = sshd_factory("127.0.0.2")          # started, accepting connections
        server.host, server.port, server.host_key   # where it listens, its public host key
        server.regenerate_host_key()                # restart on the same port with a new key

Each server runs ``/usr/sbin/sshd -D -e -f <generated config>`` from a private temporary
directory: its own ed25519 host key, ``AuthorizedKeysFile`` pointing at the ``ssh_key`` client
key, root login by key only, ``StrictModes no``, ``UsePAM no``, the internal SFTP server and a
pidfile. The fixtures skip (with the reason) where sshd is missing or the tests are not root;
on CI (`.ci/run`) both hold, so the SSH tests run.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 10.0


@dataclass
class ClientKey:
    path: Path  # private key, OpenSSH format, no passphrase
    public: str  # "ssh-ed25519 AAAA... comment"


def make_client_key(directory: Path, name: str = "id_ed25519") -> ClientKey:
    import asyncssh  # lazily: the plugin must load where asyncssh is not installed (GPU machines)

    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"tangram-test-{name}")
    path = directory / name
    key.write_private_key(str(path))
    path.chmod(0o600)
    public = key.export_public_key("openssh").decode().strip()
    (directory / f"{name}.pub").write_text(public + "\n")
    return ClientKey(path, public)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _accepting(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.settimeout(1.0)
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


@dataclass
class Sshd:
    host: str
    port: int
    directory: Path
    authorized: list[ClientKey]
    proc: subprocess.Popen[bytes] | None = None
    host_key: str = ""  # public host key, "ssh-ed25519 AAAA..."
    _log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._log = self.directory / "sshd.log"

    @property
    def config_path(self) -> Path:
        return self.directory / "sshd_config"

    def _write_files(self) -> None:
        import asyncssh

        key = asyncssh.generate_private_key("ssh-ed25519", comment=f"host-{self.host}")
        host_key = self.directory / "ssh_host_ed25519_key"
        host_key.unlink(missing_ok=True)
        key.write_private_key(str(host_key))
        host_key.chmod(0o600)
        self.host_key = key.export_public_key("openssh").decode().strip()
        auth = self.directory / "authorized_keys"
        auth.write_text("".join(k.public + "\n" for k in self.authorized))
        auth.chmod(0o600)
        self.config_path.write_text(
            "\n".join(
                [
                    f"ListenAddress {self.host}:{self.port}",
                    f"HostKey {host_key}",
                    f"PidFile {self.directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {auth}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "StrictModes no",
                    "UsePAM no",
                    "AllowAgentForwarding no",
                    "X11Forwarding no",
                    "PrintMotd no",
                    "MaxStartups 20:30:60",
                    "Subsystem sftp internal-sftp",
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )

    def start(self) -> Sshd:
        if not self.host_key:
            self._write_files()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log_text()[-2000:]}")
            if _accepting(self.host, self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sshd on {self.host}:{self.port} did not accept within {START_TIMEOUT_S}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def regenerate_host_key(self) -> str:
        """Stop, write a new host key, start again on the same address and port."""
        self.stop()
        self._write_files()
        self.start()
        return self.host_key

    def log_text(self) -> str:
        try:
            return self._log.read_text(errors="replace")
        except OSError:
            return ""


def sshd_available() -> str | None:
    """None if real-sshd tests can run here, else the reason to skip."""
    if not os.path.exists(SSHD):
        return f"{SSHD} not installed (apt-get install openssh-server)"
    if os.geteuid() != 0:
        return "real-sshd tests log in as root and must run as root"
    return None


@pytest.fixture(scope="session")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> ClientKey:
    """An ed25519 client key that every ``sshd_factory`` server authorizes (for root)."""
    return make_client_key(tmp_path_factory.mktemp("ssh-client"))


@pytest.fixture
def sshd_factory(tmp_path: Path, ssh_key: ClientKey) -> Iterator[Callable[..., Sshd]]:
    """``start(host="127.0.0.2", port=None, authorized=None) -> Sshd``; all stopped at teardown."""
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    servers: list[Sshd] = []

    def start(
        host: str = "127.0.0.2", port: int | None = None, authorized: list[ClientKey] | None = None
    ) -> Sshd:
        for _ in range(3):  # a free port can be taken between probe and bind: retry
            server = Sshd(
                host,
                port or _free_port(host),
                tmp_path / f"sshd-{host}-{len(servers)}",
                authorized if authorized is not None else [ssh_key],
            )
            servers.append(server)
            try:
                return server.start()
            except RuntimeError:
                if port is not None:
                    raise
        raise RuntimeError(f"could not start sshd on {host}")

    yield start
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()
