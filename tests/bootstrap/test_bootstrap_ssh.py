"""bootstrap/ssh.py against real OpenSSH servers on 127.0.0.2 and 127.0.0.3."""

from __future__ import annotations

import asyncio
import getpass
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.sshd import _free_port, make_client_key

from tangram_cli.bootstrap import plan, ssh
from tangram_cli.errors import AuthFailed, BootstrapError, HostKeyMismatch, HostUnreachable
from tangram_cli.inventory import Node

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(60)]


def node_for(
    server, key, *, name: str | None = None, policy: str = "accept-new", port: int | None = None
) -> Node:
    return Node(
        name=name or f"node-{server.host}",
        host=server.host,
        port=port or server.port,
        user=getpass.getuser(),
        identity_file=str(key.path),
        role="cpu",
        cpus=None,
        idle_cpus=(),
        mem_mib=None,
        executor="process",
        image=None,
        gpus=0,
        services=(),
        workdir="~/.tangram",
        python=sys.executable,
        host_key_policy=policy,
        connect_timeout_ms=5000,
    )


@pytest.fixture
def known_hosts(tmp_path: Path) -> Path:
    return tmp_path / "tangram-home" / "known_hosts"


async def test_connect_and_probe_returns_facts(sshd_factory, ssh_key, known_hosts):
    server = sshd_factory("127.0.0.2")
    node = node_for(server, ssh_key)
    async with await ssh.connect(node, known_hosts) as conn:
        facts = await ssh.probe(conn, node.python)
    assert facts["cpu_count"] == os.cpu_count()
    assert facts["python"] == ".".join(map(str, sys.version_info[:3]))
    assert facts["arch"] and facts["mem_total_mib"] > 0
    assert isinstance(facts["numa"], dict) and facts["errors"] == {}
    assert set(facts["allowed_cpus"]) <= set(range(os.cpu_count()))
    assert facts["cgroup"]["version"] in (1, 2)
    line = known_hosts.read_text().strip()
    assert line == f"[127.0.0.2]:{server.port} {server.host_key.rsplit(' ', 1)[0]}"
    assert oct(known_hosts.stat().st_mode & 0o777) == "0o600"


async def test_changed_host_key_is_refused_and_file_untouched(sshd_factory, ssh_key, known_hosts):
    server = sshd_factory("127.0.0.2")
    node = node_for(server, ssh_key)
    async with await ssh.connect(node, known_hosts):
        pass
    async with await ssh.connect(node, known_hosts):  # the recorded key matches
        pass
    before = known_hosts.read_bytes()
    server.regenerate_host_key()
    with pytest.raises(HostKeyMismatch) as info:
        await ssh.connect(node, known_hosts)
    assert "changed" in info.value.message and info.value.hint
    assert known_hosts.read_bytes() == before


async def test_strict_needs_a_recorded_key(sshd_factory, ssh_key, known_hosts):
    server = sshd_factory("127.0.0.2")
    strict = node_for(server, ssh_key, policy="strict")
    with pytest.raises(HostKeyMismatch, match="no recorded host key"):
        await ssh.connect(strict, known_hosts)
    assert not known_hosts.exists()
    async with await ssh.connect(node_for(server, ssh_key), known_hosts):  # accept-new records it
        pass
    async with await ssh.connect(strict, known_hosts) as conn:
        assert (await ssh.run(conn, ["true"])).ok


async def test_nothing_listening_is_host_unreachable(ssh_key, known_hosts):
    port = _free_port("127.0.0.2")

    class Fake:
        host = "127.0.0.2"

    node = node_for(Fake, ssh_key, port=port)
    t0 = time.monotonic()
    with pytest.raises(HostUnreachable, match="refused"):
        await ssh.connect(node, known_hosts, attempts=2, backoff_s=0.05)
    assert time.monotonic() - t0 < 5


async def test_unresolvable_name_is_host_unreachable(ssh_key, known_hosts):
    class Fake:
        host = "no-such-host.invalid"

    with pytest.raises(HostUnreachable):
        await ssh.connect(node_for(Fake, ssh_key, port=22), known_hosts, attempts=1)


async def test_wrong_key_is_auth_failed(sshd_factory, ssh_key, known_hosts, tmp_path):
    server = sshd_factory("127.0.0.2")
    other = make_client_key(tmp_path, "not_authorized")
    with pytest.raises(AuthFailed, match="permission denied"):
        await ssh.connect(node_for(server, other), known_hosts, attempts=3)


async def test_missing_identity_file_is_auth_failed(sshd_factory, ssh_key, known_hosts, tmp_path):
    server = sshd_factory("127.0.0.2")

    class Missing:
        path = tmp_path / "nope"

    with pytest.raises(AuthFailed, match="identity_file"):
        await ssh.connect(node_for(server, Missing), known_hosts)


async def test_run_quotes_argv_and_times_out(sshd_factory, ssh_key, known_hosts):
    server = sshd_factory("127.0.0.2")
    async with await ssh.connect(node_for(server, ssh_key), known_hosts) as conn:
        r = await ssh.run(conn, ["printf", "%s|", "a b; c", "$(id)", "`x`"])
        assert r.ok and r.stdout == "a b; c|$(id)|`x`|"
        r = await ssh.run(conn, "echo oops >&2; exit 7")
        assert r.exit_status == 7 and r.stderr == "oops\n"
        with pytest.raises(BootstrapError, match="exit 7"):
            await ssh.run(conn, "exit 7", check=True)
        with pytest.raises(BootstrapError, match="timed out"):
            await ssh.run(conn, "sleep 5", timeout=0.5)
        r = await ssh.run(conn, ["cat"], stdin="from stdin\n")
        assert r.stdout == "from stdin\n"


async def test_upload_is_content_addressed(sshd_factory, ssh_key, known_hosts, tmp_path):
    server = sshd_factory("127.0.0.2")
    src = tmp_path / "bundle"
    (src / "wheels").mkdir(parents=True)
    (src / "agent.json").write_text('{"name": "n1"}')
    (src / "wheels" / "pkg-1.0-py3-none-any.whl").write_bytes(b"\x00wheel" * 100)
    digest = plan.bundle_hash(ssh.read_tree(src))
    remote = str(tmp_path / "remote" / "bundles" / digest)
    async with await ssh.connect(node_for(server, ssh_key), known_hosts) as conn:
        assert await ssh.upload(conn, src, remote) is True
        assert await ssh.upload(conn, src, remote) is False  # same hash: skipped
        listing = await ssh.run(conn, ["find", remote, "-printf", "%P %m\n"], check=True)
    assert Path(remote, ".complete").read_text().strip() == digest
    assert Path(remote, "wheels", "pkg-1.0-py3-none-any.whl").read_bytes() == b"\x00wheel" * 100
    modes = dict(line.split() for line in listing.stdout.splitlines() if len(line.split()) == 2)
    assert modes["agent.json"] == "600" and modes["wheels"] == "700"
    assert not any(".tmp-" in p for p in modes)

    Path(remote, ".complete").write_text("stale\n")  # an interrupted or different upload is redone
    async with await ssh.connect(node_for(server, ssh_key), known_hosts) as conn:
        assert await ssh.upload(conn, {"agent.json": b"{}"}, remote) is True
    assert Path(remote, "agent.json").read_bytes() == b"{}"


async def test_run_on_hosts_in_parallel(sshd_factory, ssh_key, known_hosts):
    servers = [sshd_factory("127.0.0.2"), sshd_factory("127.0.0.3")]
    nodes = [node_for(s, ssh_key) for s in servers]

    class Dead:
        host = "127.0.0.3"

    nodes.append(node_for(Dead, ssh_key, name="dead", port=_free_port("127.0.0.3")))
    in_flight = peak = 0

    async def probe_host(node):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            async with await ssh.connect(node, known_hosts, attempts=1) as conn:
                await asyncio.sleep(0.2)
                r = await ssh.run(conn, "echo $SSH_CONNECTION", check=True)
                return r.stdout.split()[2]  # the server address the session reached
        finally:
            in_flight -= 1

    t0 = time.monotonic()
    results = await ssh.run_on_hosts(nodes, probe_host, parallel=8)
    assert list(results) == ["node-127.0.0.2", "node-127.0.0.3", "dead"]
    assert results["node-127.0.0.2"] == "127.0.0.2" and results["node-127.0.0.3"] == "127.0.0.3"
    assert isinstance(results["dead"], HostUnreachable)
    assert peak == 3 and time.monotonic() - t0 < 5
    assert len(known_hosts.read_text().splitlines()) == 2


async def test_run_on_hosts_bounds_concurrency():
    class N:
        def __init__(self, i):
            self.name = f"n{i}"

    in_flight = peak = 0

    async def work(node):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        if node.name == "n5":
            raise BootstrapError("boom")
        return node.name

    results = await ssh.run_on_hosts([N(i) for i in range(30)], work, parallel=8)
    assert peak == 8
    assert isinstance(results["n5"], BootstrapError) and results["n6"] == "n6"


async def test_check_node_reads_what_up_needs_without_a_shell(sshd_factory, ssh_key, known_hosts, tmp_path):
    server = sshd_factory("127.0.0.2")
    run, bundle, venv = tmp_path / "c", tmp_path / "c" / "bundles" / "h", tmp_path / "c" / "venv-h"
    node = node_for(server, ssh_key)
    async with await ssh.connect(node, known_hosts) as conn:
        empty = await ssh.check_node(conn, str(run), str(bundle), str(venv))
    assert (empty.running, empty.hashes, empty.bundle, empty.ready) == (False, {}, "", False)
    assert empty.home == os.path.expanduser("~")

    bundle.mkdir(parents=True)
    venv.mkdir()
    (venv / ".ready").touch()
    (bundle / ".complete").write_text("abc\n")
    (run / "agent.json").write_text("{}")
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "agent"])
    try:
        (run / "agent.pid").write_text(f"{fake.pid}\n")
        async with await ssh.connect(node, known_hosts) as conn:
            seen = await ssh.check_node(conn, str(run), str(bundle), str(venv))
        assert (seen.running, seen.bundle, seen.ready) == (True, "abc", True)
        assert seen.differing({"agent.json": b"{}", "controller.key": b"k"}) == ["controller.key"]
    finally:
        fake.kill()
        fake.wait()
    async with await ssh.connect(node, known_hosts) as conn:
        assert not (await ssh.check_node(conn, str(run), str(bundle), str(venv))).running


async def test_strict_hints_run_as_written_accept_the_new_key(sshd_factory, ssh_key, known_hosts):
    """Under ``strict`` the hint is the exact command that records the key; after a change, the one
    that forgets the old key and records the new one. Both are run here as the operator would."""
    import asyncssh

    server = sshd_factory("127.0.0.2")
    strict = node_for(server, ssh_key, policy="strict")
    known_hosts.parent.mkdir(parents=True, exist_ok=True)

    def accept(err: HostKeyMismatch) -> None:
        command = err.hint.split(": ", 1)[1]
        assert "ssh-keyscan -p" in command and "-t ed25519 127.0.0.2" in command
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr

    with pytest.raises(HostKeyMismatch) as unknown:
        await ssh.connect(strict, known_hosts)
    new = asyncssh.import_public_key(server.host_key).get_fingerprint("sha256")
    assert f"the host offers {new} (ssh-ed25519)" in unknown.value.message
    accept(unknown.value)
    async with await ssh.connect(strict, known_hosts):
        pass

    old, fresh = new, asyncssh.import_public_key(server.regenerate_host_key()).get_fingerprint("sha256")
    with pytest.raises(HostKeyMismatch) as changed:
        await ssh.connect(strict, known_hosts)
    assert f"recorded {old} (ssh-ed25519), offered {fresh} (ssh-ed25519)" in changed.value.message
    assert f"ssh-keygen -R '[127.0.0.2]:{server.port}' -f {known_hosts}" in changed.value.hint
    accept(changed.value)
    async with await ssh.connect(strict, known_hosts):
        pass
