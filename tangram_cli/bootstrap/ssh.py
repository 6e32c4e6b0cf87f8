"""SSH runner for `tangram up`: connect, run, upload. Thin: commands come from ``plan.py``.

Policy (the operator's view of it: docs/operations.md §3.3 and §3.5):

* Host keys are checked against Tangram's own known_hosts file (``~/.tangram/known_hosts``,
  injectable). ``accept-new`` records the first key seen for ``host:port`` and logs its
  fingerprint; a different key later raises ``HostKeyMismatch`` and leaves the file alone.
  ``strict`` requires a recorded key. Host-key checking is never switched off.
* ``config=None`` (a user's ``~/.ssh/config`` cannot add ProxyCommand or ForwardAgent),
  agent forwarding off, only public-key authentication, the inventory's ``identity_file``
  passed explicitly (then the ssh-agent is not consulted), ``keepalive_interval=15``.
* Failures are sorted into typed errors: ``HostUnreachable`` (refused, timeout, DNS),
  ``AuthFailed`` (permission denied), ``HostKeyMismatch``; other SSH failures are a plain
  ``BootstrapError``. Only ``HostUnreachable`` is retried, a bounded number of times with jitter.
* ``run_on_hosts`` bounds concurrency (8 by default: sshd's ``MaxStartups`` starts dropping
  unauthenticated connections at 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import shlex
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncssh

from tangram_cli import state as st
from tangram_cli.bootstrap import plan
from tangram_cli.errors import AuthFailed, BootstrapError, HostKeyMismatch, HostUnreachable

log = logging.getLogger("tangram.bootstrap.ssh")

DEFAULT_KNOWN_HOSTS = "~/.tangram/known_hosts"
KEEPALIVE_S = 15
MAX_PARALLEL = 8
T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Known hosts


def known_hosts_path() -> str:
    """Tangram's own known_hosts file: ``$TANGRAM_HOME/known_hosts`` (``~/.tangram/known_hosts``)."""
    return str(st.home() / "known_hosts")


def host_pattern(host: str, port: int) -> str:
    """The OpenSSH known_hosts name: ``host`` for port 22, else ``[host]:port``."""
    return host if port == 22 and ":" not in host else f"[{host}]:{port}"


class KnownHosts:
    """Tangram's known_hosts file, OpenSSH format, plain (unhashed) names. Appends only."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(os.path.expanduser(str(path or DEFAULT_KNOWN_HOSTS)))

    def keys_for(self, host: str, port: int) -> list[asyncssh.SSHKey]:
        name = host_pattern(host, port)
        keys = []
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        for line in lines:
            fields = line.split()
            if len(fields) >= 3 and not line.startswith("#") and name in fields[0].split(","):
                with contextlib.suppress(asyncssh.KeyImportError, ValueError):
                    keys.append(asyncssh.import_public_key(f"{fields[1]} {fields[2]}"))
        return keys

    def add(self, host: str, port: int, key: asyncssh.SSHKey) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        line = f"{host_pattern(host, port)} {key.export_public_key('openssh').decode().strip()}\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line.encode())
        finally:
            os.close(fd)


class _Client(asyncssh.SSHClient):
    """Called by asyncssh for a host key that is not among the recorded ones."""

    def __init__(
        self, store: KnownHosts, host: str, port: int, policy: str, recorded: list[asyncssh.SSHKey]
    ) -> None:
        self.store, self.host, self.port, self.policy, self.recorded = store, host, port, policy, recorded
        self.verdict: str | None = None  # "mismatch" | "unknown" | "recorded"
        self.offered: asyncssh.SSHKey | None = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.offered = key
        if self.recorded:
            self.verdict = "mismatch"
            return False
        if self.policy != "accept-new":
            self.verdict = "unknown"
            return False
        self.store.add(self.host, self.port, key)
        self.verdict = "recorded"
        log.warning(
            "recorded new host key for %s: %s %s",
            host_pattern(self.host, self.port),
            key.get_algorithm(),
            fingerprint(key),
        )
        return True


def fingerprint(key: asyncssh.SSHKey) -> str:
    """``SHA256:... (ssh-ed25519)``, as `ssh-keygen -l` shows a key."""
    return f"{key.get_fingerprint('sha256')} ({key.get_algorithm()})"


def keyscan_type(key: asyncssh.SSHKey | None) -> str:
    """The ``ssh-keyscan -t`` name of a key's type (``ssh-ed25519`` -> ``ed25519``)."""
    alg = key.get_algorithm() if key is not None else "ssh-ed25519"
    kind = "ecdsa" if "ecdsa" in alg else "ed25519" if "ed25519" in alg else "rsa"
    return f"{kind}-sk" if alg.startswith("sk-") else kind


def _host_key_error(node: Any, client: _Client | None, known_hosts: Path) -> HostKeyMismatch:
    """A changed (or, under ``strict``, unrecorded) host key: the old and new fingerprints where known,
    and the exact commands that accept the new key into Tangram's own known_hosts file."""
    pattern = host_pattern(node.host, node.port)
    offered = client.offered if client is not None else None
    new = fingerprint(offered) if offered is not None else "unknown"
    kh = shlex.quote(str(known_hosts))
    scan = f"ssh-keyscan -p {node.port} -t {keyscan_type(offered)} {node.host}"
    if client is not None and client.verdict == "unknown":
        return HostKeyMismatch(
            f"no recorded host key for {pattern} (host_key_policy strict); the host offers {new}",
            host=node.name,
            hint=f"check {new} with the host's administrator, then record it: {scan} >> {kh}",
        )
    old = ", ".join(fingerprint(k) for k in client.recorded) if client and client.recorded else "unknown"
    forget = f"ssh-keygen -R {shlex.quote(pattern)} -f {kh}"
    accept = (
        f"{forget} && {scan} >> {kh}"
        if getattr(node, "host_key_policy", "accept-new") == "strict"
        else f"{forget}, then rerun (host_key_policy accept-new records the new key)"
    )
    return HostKeyMismatch(
        f"host key for {pattern} changed: recorded {old}, offered {new}",
        host=node.name,
        hint=f"if the change is expected (the host was reinstalled), check {new} with its administrator, "
        f"then accept it: {accept}",
    )


# --------------------------------------------------------------------------------------------
# Connect


def _classify(exc: BaseException, node: Any, client: _Client | None, known_hosts: Path) -> BootstrapError:
    """A typed error whose message does not repeat the node's name (callers show it beside it)."""
    where = f"{node.user}@{host_pattern(node.host, node.port)}"
    name = getattr(node, "name", node.host)
    if isinstance(exc, asyncssh.HostKeyNotVerifiable) or (
        client and client.verdict in ("mismatch", "unknown")
    ):
        return _host_key_error(node, client, known_hosts)
    if isinstance(exc, asyncssh.PermissionDenied):
        return AuthFailed(f"permission denied for {where} (public key)", host=name)
    if isinstance(exc, socket.gaierror):
        return HostUnreachable(f"cannot resolve {node.host}: {exc.strerror or exc}", host=name)
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        secs = node.connect_timeout_ms / 1000
        return HostUnreachable(f"timed out after {secs:g}s connecting to {where}", host=name)
    if isinstance(exc, ConnectionRefusedError):
        return HostUnreachable(f"connection refused by {host_pattern(node.host, node.port)}", host=name)
    if isinstance(exc, OSError | asyncssh.ConnectionLost):
        return HostUnreachable(f"cannot reach {where}: {getattr(exc, 'strerror', None) or exc}", host=name)
    if isinstance(exc, asyncssh.Error):
        return BootstrapError(f"ssh to {where} failed: {exc.reason}", host=name)
    return BootstrapError(f"ssh to {where} failed: {type(exc).__name__}: {exc}", host=name)


def _client_keys(node: Any) -> list[asyncssh.SSHKey] | None:
    if not node.identity_file:
        return None  # asyncssh's defaults: ~/.ssh/id_* and the ssh-agent
    path = os.path.expanduser(node.identity_file)
    try:
        return [asyncssh.read_private_key(path)]
    except (OSError, asyncssh.KeyImportError) as exc:
        raise AuthFailed(
            f"cannot read identity_file {node.identity_file}: {getattr(exc, 'strerror', None) or exc}",
            host=node.name,
            hint="point ssh.identity_file at an unencrypted private key (a dedicated deploy key)",
        ) from None


RetryHook = Callable[[int, int, float, BootstrapError], None]


async def connect(
    node: Any,
    known_hosts_path: str | os.PathLike[str] | None = None,
    policy: str | None = None,
    *,
    attempts: int = 3,
    backoff_s: float = 0.5,
    rng: random.Random | None = None,
    on_retry: RetryHook | None = None,
) -> asyncssh.SSHClientConnection:
    """Open an SSH connection to an inventory ``Node`` under Tangram's host-key policy.

    ``HostUnreachable`` is retried up to ``attempts`` times in all; before each retry
    ``on_retry(attempt, attempts, delay_s, error)`` is called. The last error says how many attempts
    were made (``(3 attempts)``) and carries the count as ``attempts``."""
    store = KnownHosts(known_hosts_path)
    policy = policy or getattr(node, "host_key_policy", "accept-new")
    if policy not in ("accept-new", "strict"):
        raise BootstrapError(f"unknown host_key_policy {policy!r}")
    keys = _client_keys(node)
    rng = rng or random.Random()
    attempts = max(1, attempts)
    for attempt in range(1, attempts + 1):
        try:
            return await _connect_once(node, store, policy, keys)
        except HostUnreachable as exc:
            if attempt >= attempts:
                raise _counted(exc, attempt) from exc.__cause__
            delay = backoff_s * 2 ** (attempt - 1) * rng.uniform(0.5, 1.5)
            log.info("%s unreachable, retry %d/%d in %.2fs", node.host, attempt, attempts - 1, delay)
            if on_retry is not None:
                on_retry(attempt, attempts, delay, exc)
        await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _counted(exc: BootstrapError, attempts: int) -> BootstrapError:
    """``exc`` again, its message saying how many attempts were made (when more than one)."""
    if attempts > 1:
        exc = type(exc)(
            f"{exc.message} ({attempts} attempts)", host=exc.host, hint=exc.hint, detail=exc.detail
        )
    exc.attempts = attempts  # type: ignore[attr-defined]
    return exc


async def _connect_once(
    node: Any, store: KnownHosts, policy: str, keys: list[asyncssh.SSHKey] | None
) -> asyncssh.SSHClientConnection:
    recorded = store.keys_for(node.host, node.port)
    client = _Client(store, node.host, node.port, policy, recorded)
    timeout = node.connect_timeout_ms / 1000
    options: dict[str, Any] = {
        "port": node.port,
        "username": node.user,
        "known_hosts": (recorded, [], []),  # trusted, CA, revoked; never None (that disables checks)
        "config": None,
        "agent_forwarding": False,
        "x11_forwarding": False,
        "preferred_auth": "publickey",
        "connect_timeout": timeout,
        "login_timeout": timeout,
        "keepalive_interval": KEEPALIVE_S,
        "client_factory": lambda: client,
    }
    if keys is not None:
        options.update(client_keys=keys, agent_path=None)
    try:
        return await asyncssh.connect(node.host, **options)
    except (TimeoutError, OSError, asyncssh.Error) as exc:
        raise _classify(exc, node, client, store.path) from exc


# --------------------------------------------------------------------------------------------
# Run and upload


@dataclass(frozen=True)
class RunResult:
    exit_status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


async def run(
    conn: asyncssh.SSHClientConnection,
    argv_or_cmd: str | Sequence[str],
    stdin: str | None = None,
    timeout: float = 60.0,
    *,
    check: bool = False,
) -> RunResult:
    """Run a command (a string from plan.py, or an argv list that is quoted here)."""
    cmd = argv_or_cmd if isinstance(argv_or_cmd, str) else plan.argv_to_command(argv_or_cmd)
    host = conn.get_extra_info("peername", ("?", 0))[0]
    try:
        r = await conn.run(cmd, input=stdin, check=False, timeout=timeout)
    except asyncssh.TimeoutError:
        raise BootstrapError(f"{host}: command timed out after {timeout:g}s: {cmd[:80]}", host=host) from None
    except (OSError, asyncssh.Error) as exc:
        raise HostUnreachable(f"{host}: connection lost while running {cmd[:80]}: {exc}", host=host) from exc
    status = r.exit_status if r.exit_status is not None else 255
    result = RunResult(status, str(r.stdout or ""), str(r.stderr or ""))
    if check and not result.ok:
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        raise BootstrapError(f"{host}: exit {status} from {cmd[:80]}: {tail[0][:200]}", host=host)
    return result


def read_tree(src: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> dict[str, bytes]:
    """A directory (recursively) or a list of files as ``{relative path: bytes}``."""
    if isinstance(src, str | os.PathLike) and Path(src).is_dir():
        root = Path(src)
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()
        }
    files = [src] if isinstance(src, str | os.PathLike) else list(src)
    return {Path(f).name: Path(f).read_bytes() for f in files}


async def upload(
    conn: asyncssh.SSHClientConnection,
    local: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | Mapping[str, bytes],
    remote_dir: str,
    *,
    marker: bool = True,
) -> bool:
    """Copy files over SFTP into ``remote_dir`` (0700, files 0600), then write ``.complete``
    holding the bundle hash. Returns False (nothing sent) when ``.complete`` already matches.
    ``marker=False``: always copy, and neither read nor write ``.complete``."""
    files = dict(local) if isinstance(local, Mapping) else read_tree(local)
    digest = plan.bundle_hash(files)
    base = plan.sftp_path(remote_dir)
    async with conn.start_sftp_client() as sftp:
        complete = f"{base}/.complete"
        if marker:
            with contextlib.suppress(asyncssh.SFTPError, OSError):
                async with sftp.open(complete, "rb") as f:
                    if (await f.read()).decode(errors="replace").strip() == digest:
                        return False
        await _makedirs(sftp, base)
        for rel in sorted(files):
            if rel.startswith("/") or ".." in rel.split("/"):
                raise BootstrapError(f"refusing to upload outside the bundle: {rel!r}")
            parent = "/".join(rel.split("/")[:-1])
            if parent:
                await _makedirs(sftp, f"{base}/{parent}")
            await _write(sftp, f"{base}/{rel}", files[rel])
        if marker:
            await _write(sftp, complete, (digest + "\n").encode())
    return True


async def _makedirs(sftp: asyncssh.SFTPClient, path: str) -> None:
    cur = ""
    for part in path.split("/"):
        cur = f"{cur}/{part}" if cur else (part or "/")
        if part in ("", "."):
            continue
        if not await sftp.isdir(cur):
            await sftp.mkdir(cur, asyncssh.SFTPAttrs(permissions=0o700))


async def _write(sftp: asyncssh.SFTPClient, path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    async with sftp.open(tmp, "wb", asyncssh.SFTPAttrs(permissions=0o600)) as f:
        await f.write(data)
    await sftp.posix_rename(tmp, path)


async def check_node(
    conn: asyncssh.SSHClientConnection, run_dir: str, bundle_dir: str, venv: str
) -> plan.NodeCheck:
    """What `up` needs to know about a node, read over one SFTP session (no shell runs): the login's
    home, whether the agent of ``run_dir`` runs (its ``agent.pid`` names a live process whose
    command line mentions ``agent``), the sha256 of the files `up` writes there, the bundle's
    ``.complete`` hash and whether the venv is ready (``.ready``)."""
    run, bdir = plan.sftp_path(run_dir), plan.sftp_path(bundle_dir)
    async with conn.start_sftp_client() as sftp:
        home = await sftp.realpath(".")
        pid = (await _read_small(sftp, f"{run}/agent.pid") or b"").decode(errors="replace").strip()
        cmdline = await _read_small(sftp, f"/proc/{pid}/cmdline") if pid.isdigit() else None
        hashes = {}
        for name in plan.RUN_FILES:
            data = await _read_small(sftp, f"{run}/{name}")
            if data is not None:
                hashes[name] = hashlib.sha256(data).hexdigest()
        marker = (await _read_small(sftp, f"{bdir}/.complete") or b"").decode(errors="replace").strip()
        ready = await sftp.exists(f"{plan.sftp_path(venv)}/.ready")
    return plan.NodeCheck(home, bool(cmdline and b"agent" in cmdline), hashes, marker, bool(ready))


async def _read_small(sftp: asyncssh.SFTPClient, path: str, limit: int = 1 << 20) -> bytes | None:
    """A small remote file's bytes, or None when it cannot be read."""
    try:
        async with sftp.open(path, "rb") as f:
            return bytes(await f.read(limit))
    except (asyncssh.SFTPError, OSError):
        return None


async def probe(
    conn: asyncssh.SSHClientConnection, python: str = "python3", timeout: float = 60.0
) -> dict[str, Any]:
    """Run the stdlib facts script (plan.FACTS_SCRIPT) and return its JSON facts."""
    r = await run(conn, plan.probe_argv(python), stdin=plan.probe_stdin(), timeout=timeout)
    host = conn.get_extra_info("peername", ("?", 0))[0]
    if not r.ok:
        raise BootstrapError(
            f"{host}: probe failed (exit {r.exit_status}): {r.stderr.strip()[-200:]}",
            host=host,
            hint=f"check that {shlex.quote(python)} (Python >= 3.8) runs on the node",
        )
    try:
        facts: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BootstrapError(
            f"{host}: probe printed no JSON facts", host=host, detail=r.stdout[-500:]
        ) from None
    return facts


# --------------------------------------------------------------------------------------------
# Many hosts


async def run_on_hosts(
    nodes: Iterable[Any],
    fn: Callable[[Any], Awaitable[T]],
    parallel: int = MAX_PARALLEL,
) -> dict[str, T | BaseException]:
    """``await fn(node)`` for every node, at most ``parallel`` at a time (so at most that many
    SSH handshakes are in flight). Returns ``{node.name: result or exception}`` in input order;
    one host's failure never cancels the others (KeyboardInterrupt and cancellation still do)."""
    sem = asyncio.Semaphore(max(1, parallel))
    nodes = list(nodes)

    async def one(node: Any) -> T | BaseException:
        async with sem:
            try:
                return await fn(node)
            except Exception as exc:
                return exc

    results = await asyncio.gather(*(one(n) for n in nodes))
    return {n.name: r for n, r in zip(nodes, results, strict=True)}
