"""Authentication of the local default and of every client (issue 11, findings 2 and 6), with real sockets.

- The local default (`tangram up`, no inventory) runs CURVE: a rogue agent (a DEALER with an agent
  Hello claiming 64 cores, with no key or a random key) is never registered and never gets work; a
  rogue client (no key, an unknown key, a revoked key) gets no Welcome; a process of another local
  user (`nobody`, speaking ZMTP by hand) gets neither. The client library of the user who ran `up`
  connects with no configuration.
- Per-client keys: `tangram keys add/list/revoke`; the controller names a connection's key
  (`ServerAuth.name_of`); a revoked key cannot reconnect.
- A refused key is reported within seconds: `KeyRefused` (a `ControllerUnreachable`) on the
  client, an ERROR line in the agent's log, both with a hint naming the allow-list directory.
- The bind check refuses every spelling of "every interface" and of non-loopback without keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from click.testing import CliRunner

import tangram
from tangram import certs as tc
from tangram import protocol as p
from tangram.errors import ControllerUnreachable
from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options
from tangram_cli.controller.state import bind_host, check_bind
from tangram_cli.main import cli

CLI = [sys.executable, "-c", "from tangram_cli.main import cli; cli()"]
CONFIG: dict[str, Any] = {
    "cluster": "auth",
    "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2},
    "apis": [{"name": "search", "mode": "concurrency", "limit": 2}],
}
ROGUE_CORES = 64


# ---------------------------------------------------------------- helpers


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "TANGRAM_HOME": str(home), "NO_COLOR": "1"}
    for var in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER", "TANGRAM_CERTS"):
        env.pop(var, None)
    return env


def tangram_cli(*args: str, home: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=_env(home), timeout=timeout, check=False
    )


def agent_hello(name: str) -> list[bytes]:
    """An agent's Hello claiming ``ROGUE_CORES`` cores (what the rogue of finding 2 sent)."""
    cores = list(range(ROGUE_CORES))
    facts = {
        "cpus": cores,
        "idle_cpus": [],
        "numa": [cores],
        "mem_mib": 512 * 1024,
        "gpus": 0,
        "gpu_mem_mib": 0,
        "executor": "process",
        "docker": False,
        "cgroup": "v2",
        "hostname": "rogue",
        "pid": os.getpid(),
        "version": "test",
    }
    return p.encode(p.Hello("agent", name, p.PROTOCOL_MAJOR, p.BATCH_MINOR - 1, facts), 0)


def client_hello() -> list[bytes]:
    return p.encode(p.Hello("client", "rogue", p.PROTOCOL_MAJOR, p.BATCH_MINOR - 1), 1)


class Rogue:
    """A raw DEALER that says Hello (with ``curve`` keys or none) and records what comes back."""

    def __init__(self, addr: str, hello: list[bytes], curve: tc.CurveKeys | None, ident: bytes) -> None:
        from zmq.utils.monitor import parse_monitor_message

        self._parse = parse_monitor_message
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        if curve is not None:
            curve.apply(self.sock)
        self.mon = self.sock.get_monitor_socket(tc.handshake_events())
        self.sock.connect(addr)
        self.hello = hello
        self.received: list[str] = []  # message names
        self.handshake = "not answered"
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Rogue:
        await self.sock.send_multipart(self.hello)
        self._task = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        """Record every message; once welcomed, heartbeat like a live agent so work would come."""
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        while True:
            events = dict(await poller.poll(100))
            if self.mon in events:
                ev = self._parse(await self.mon.recv_multipart())["event"]
                self.handshake = "accepted" if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
            if self.sock in events:
                env = p.decode(await self.sock.recv_multipart())
                self.received.append(type(env.msg).__name__)
            if "Welcome" in self.received:
                await self.sock.send_multipart(p.encode(p.Heartbeat(), 0))

    def work(self) -> list[str]:
        return [m for m in self.received if m not in ("Welcome", "Heartbeat", "Bye", "Reject")]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.sock.disable_monitor()
        self.mon.close(0)
        self.sock.close(0)
        self.ctx.term()


def random_keys(server: bytes) -> tc.CurveKeys:
    public, secret = zmq.curve_keypair()
    return tc.CurveKeys(public, secret, server)


async def workload(addr: str, certs: str | None = None) -> str:
    """What a rollout job of finding 2 did: a secret file, a token in the environment, a command."""
    async with (
        tangram.AsyncClient(addr, certs=certs, connect_timeout=10) as tg,
        tg.sandbox(mem="64MiB") as sb,
    ):
        await sb.put("api_key.txt", b"sk-secret")
        r = await sb.exec(
            "cat api_key.txt; echo; echo $HF_TOKEN", cpus=1, env={"HF_TOKEN": "hf_x"}, timeout=30
        )
        assert r.exit_code == 0, r.stderr
        return r.stdout


# ---------------------------------------------------------------- the local default (`tangram up`)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`tangram up` (no inventory, process executor) in a private TANGRAM_HOME; `tangram down` after."""
    home = tmp_path_factory.mktemp("auth") / "home"
    up = tangram_cli("up", "--executor", "process", "--gpus", "1", "--gpu-mem", "16GiB", home=home)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((home / "clusters" / "local" / "state.json").read_text())
        yield {"home": home, "up": up, "state": state}
    finally:
        down = tangram_cli("down", home=home)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture
def local_env(local_cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This process sees the local cluster's TANGRAM_HOME (as the user who ran `up`)."""
    monkeypatch.setenv("TANGRAM_HOME", str(local_cluster["home"]))
    for var in ("TANGRAM_ADDR", "TANGRAM_CERTS", "TANGRAM_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    return local_cluster


def _addr(state: dict[str, Any], role: str) -> str:
    return f"tcp://127.0.0.1:{state['ports'][role]}"


def test_local_default_runs_curve_with_private_keys(local_cluster: dict[str, Any]) -> None:
    up, state, home = local_cluster["up"], local_cluster["state"], local_cluster["home"]
    lines = [ln for ln in up.stdout.splitlines() if ln.startswith("security:")]
    assert len(lines) == 1, up.stdout
    assert lines[0].startswith("security: CURVE"), up.stdout
    certs = Path(state["certs"])
    assert certs == home / "clusters" / "local" / "certs"
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    assert stat.S_IMODE(certs.parent.stat().st_mode) == 0o700
    for secret in certs.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert (certs / "agents" / "agent-local.key").is_file()
    agent_cfg = json.loads((home / "clusters" / "local" / "agent" / "agent.json").read_text())
    assert agent_cfg["curve"]["secret"] == str(certs / "agent-local.key_secret")


def test_same_user_client_needs_no_configuration(local_cluster: dict[str, Any]) -> None:
    """`tangram up`, then `python -c 'import tangram ...'`: no address, no keys, no prompt (and the
    cluster runs CURVE: the client found the cluster's keys by itself)."""
    assert local_cluster["state"]["certs"]
    code = (
        "import tangram\n"
        "with tangram.Client() as tg, tg.sandbox() as sb:\n"
        "    print(sb.exec('echo no-config', cpus=1, timeout=30).stdout.strip())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(local_cluster["home"]),
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "no-config"
    status = tangram_cli("status", "-o", "json", home=local_cluster["home"])
    assert status.returncode == 0, status.stderr
    assert [n["node"] for n in json.loads(status.stdout)["records"]["nodes"]] == ["local"]


@pytest.mark.parametrize("keyed", ["no key", "random key"])
async def test_rogue_agent_on_local_default_is_never_registered(
    local_env: dict[str, Any], keyed: str
) -> None:
    state = local_env["state"]
    server = tc.public_key(str(Path(state["certs"]) / "controller.key"))
    curve = random_keys(server) if keyed == "random key" else None
    name = f"rogue-{keyed.replace(' ', '-')}"
    rogue = await Rogue(_addr(state, "agents"), agent_hello(name), curve, name.encode()).start()
    try:
        await asyncio.sleep(1.0)
        assert rogue.handshake == "refused"
        assert rogue.received == [], f"the rogue agent got {rogue.received}"
        # the same user's job (the cluster's keys, found by itself) runs, and none of it reaches the rogue
        out = await asyncio.wait_for(workload(state["address"]), 60)
        assert out.split() == ["sk-secret", "hf_x"]
        await asyncio.sleep(0.5)
        assert rogue.received == [], f"the rogue agent got {rogue.received}"
        records = await asyncio.to_thread(
            st.query_status, _addr(state, "status"), sections=("nodes",), timeout_s=5.0
        )
        assert [n["node"] for n in records["nodes"]] == ["local"]
    finally:
        await rogue.close()


@pytest.mark.parametrize("keyed", ["no key", "random key"])
async def test_rogue_client_on_local_default_gets_no_welcome(
    local_env: dict[str, Any], keyed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = local_env["state"]
    server = tc.public_key(str(Path(state["certs"]) / "controller.key"))
    curve = random_keys(server) if keyed == "random key" else None
    rogue = await Rogue(state["address"], client_hello(), curve, os.urandom(16)).start()
    try:
        await asyncio.sleep(1.5)
        assert rogue.handshake == "refused"
        assert rogue.received == []
    finally:
        await rogue.close()
    # and the client library says why, at once, naming the allow-list and `tangram keys add`
    if curve is None:  # a client that finds no keys: another TANGRAM_HOME, no TANGRAM_CERTS
        monkeypatch.setenv("TANGRAM_HOME", str(tmp_path / "elsewhere"))
    t0 = time.monotonic()
    with pytest.raises(tc.KeyRefused) as info:
        await tangram.AsyncClient(state["address"], certs=curve, connect_timeout=10).connect()
    assert time.monotonic() - t0 < 3
    assert isinstance(info.value, ControllerUnreachable)
    if curve is not None:
        assert "certs/clients/" in (info.value.hint or "")
        assert "tangram keys add" in (info.value.hint or "")
    else:
        assert "requires CURVE keys" in info.value.message


NOBODY_SCRIPT = r"""
# A ZeroMQ DEALER by hand (ZMTP 3.0, NULL mechanism): stdlib only, so it runs as any user.
import json, os, socket, struct, sys, time
host, port, frames_hex, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    open(secret, "rb").read()
    readable = True
except OSError:
    readable = False
def prop(name, value):
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
def frame(body, flags):
    if len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body
def parse(buf):
    pos, commands, messages = 64, [], 0
    while pos + 2 <= len(buf):
        flags = buf[pos]
        if flags & 0x02:
            if pos + 9 > len(buf):
                break
            size, hdr = struct.unpack(">Q", buf[pos + 1:pos + 9])[0], 9
        else:
            size, hdr = buf[pos + 1], 2
        if pos + hdr + size > len(buf):
            break
        body = buf[pos + hdr:pos + hdr + size]
        pos += hdr + size
        if flags & 0x04:
            commands.append(body[1:1 + body[0]].decode(errors="replace"))
        elif not flags & 0x01:
            messages += 1
    return commands, messages
s = socket.create_connection((host, port), timeout=5)
s.settimeout(0.1)
state = {"buf": b"", "closed": False}
def read_until(done, seconds):
    end = time.time() + seconds
    while not state["closed"] and not done() and time.time() < end:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            state["closed"] = True
        state["buf"] += chunk
greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
s.sendall(greeting)
read_until(lambda: len(state["buf"]) >= 64, 3)
mechanism = state["buf"][12:32].rstrip(b"\0").decode(errors="replace")
if len(state["buf"]) >= 64 and mechanism == "NULL":
    ready = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"nobody-rogue")
    s.sendall(frame(ready, 0x04))
    read_until(lambda: "READY" in parse(state["buf"])[0], 3)
    frames = [bytes.fromhex(h) for h in frames_hex.split(",")]
    s.sendall(b"".join(frame(f, 0x01 if i < len(frames) - 1 else 0x00) for i, f in enumerate(frames)))
read_until(lambda: parse(state["buf"])[1] > 0, 3)
commands, messages = parse(state["buf"])
print(json.dumps({"uid": os.getuid(), "mechanism": mechanism, "commands": commands, "messages": messages,
                  "closed": state["closed"], "secret_readable": readable}))
"""


def _as_nobody() -> list[str] | None:
    if os.geteuid() != 0:
        return None
    tool = shutil.which("setpriv")
    if tool:
        return [tool, "--reuid=65534", "--regid=65534", "--clear-groups"]
    tool = shutil.which("runuser")
    return [tool, "-u", "nobody", "--"] if tool else None


@pytest.mark.parametrize("role", ["agents", "submit"])
def test_another_local_user_cannot_connect(local_cluster: dict[str, Any], role: str) -> None:
    """A process of user `nobody` speaks ZMTP (NULL) by hand: no Welcome, no READY, and it cannot
    read the cluster's keys."""
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("needs root and setpriv or runuser to run a process as another user")
    state = local_cluster["state"]
    frames = agent_hello("nobody-rogue") if role == "agents" else client_hello()
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    secret = str(Path(state["certs"]) / "client.key_secret")
    argv = [*prefix, python, "-I", "-S", "-c", NOBODY_SCRIPT, "127.0.0.1", str(state["ports"][role])]
    argv += [",".join(f.hex() for f in frames), secret]
    run = subprocess.run(argv, capture_output=True, text=True, cwd="/", timeout=30, check=False)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["uid"] == 65534
    assert got["secret_readable"] is False
    assert got["mechanism"] != "NULL", got  # the controller speaks CURVE (or closed before saying so)
    assert got["messages"] == 0, got
    assert "READY" not in got["commands"], got
    assert got["closed"], got


def test_insecure_local_default_is_explicit(tmp_path: Path) -> None:
    dry = tangram_cli("up", "--dry-run", home=tmp_path / "h")
    assert "CURVE keys" in dry.stdout
    dry = tangram_cli("up", "--dry-run", "--insecure", home=tmp_path / "h")
    assert "plain TCP (--insecure)" in dry.stdout


# ---------------------------------------------------------------- `tangram keys` on the local cluster


async def test_keys_add_list_revoke_on_local_default(local_env: dict[str, Any], tmp_path: Path) -> None:
    home, state = local_env["home"], local_env["state"]
    out_dir = tmp_path / "alice-certs"
    added = tangram_cli("keys", "add", "alice", "--out", str(out_dir), home=home)
    assert added.returncode == 0, added.stderr
    assert f"export TANGRAM_CERTS={out_dir}" in added.stdout
    assert stat.S_IMODE(out_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((out_dir / "client.key_secret").stat().st_mode) == 0o600
    assert (Path(state["certs"]) / "clients" / "alice.key").is_file()
    bob = tangram_cli("keys", "add", "bob", "-o", "json", home=home)
    assert bob.returncode == 0, bob.stderr
    bob_dir = Path(json.loads(bob.stdout)["certs"])
    assert bob_dir == Path(state["certs"]) / "users" / "bob"
    again = tangram_cli("keys", "add", "alice", home=home)
    assert again.returncode == 2
    assert "exists already" in again.stderr

    listed = json.loads(tangram_cli("keys", "list", "-o", "json", home=home).stdout)
    by_name = {(k["role"], k["name"]): k for k in listed["keys"]}
    assert {("client", "client"), ("client", "alice"), ("client", "bob"), ("status", "status")} <= set(
        by_name
    )
    assert ("agent", "agent-local") in by_name
    alice_pub = tc.load_dir(str(out_dir)).public
    assert by_name[("client", "alice")]["fingerprint"] == tc.fingerprint(alice_pub)
    table = tangram_cli("keys", "list", home=home).stdout
    assert "alice" in table
    assert by_name[("client", "alice")]["fingerprint"] in table

    # alice's key works, through TANGRAM_CERTS in a fresh process and certs= in code
    assert (await workload(state["address"], certs=str(out_dir))).split() == ["sk-secret", "hf_x"]
    env = {**_env(home), "TANGRAM_CERTS": str(out_dir), "TANGRAM_ADDR": state["address"]}
    code = (
        "import tangram\n"
        "with tangram.Client() as tg, tg.sandbox() as sb:\n"
        "    print(sb.exec('echo alice', cpus=1, timeout=30).stdout.strip())\n"
    )
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert run.stdout.strip() == "alice", run.stderr

    # revoked: refused at the next connect, with the typed error
    revoked = tangram_cli("keys", "revoke", "alice", home=home)
    assert revoked.returncode == 0, revoked.stderr
    assert not (Path(state["certs"]) / "clients" / "alice.key").exists()
    with pytest.raises(tc.KeyRefused, match="refused this client's CURVE key"):
        await tangram.AsyncClient(state["address"], certs=str(out_dir), connect_timeout=10).connect()
    gone = tangram_cli("keys", "revoke", "alice", home=home)
    assert gone.returncode == 2
    assert "no client key named 'alice'" in gone.stderr
    assert tangram_cli("keys", "revoke", "bob", home=home).returncode == 0
    assert not await asyncio.to_thread(bob_dir.exists)
    # the default key still works
    assert (await workload(state["address"])).split() == ["sk-secret", "hf_x"]


def test_keys_need_a_curve_cluster(tmp_path: Path) -> None:
    out = tangram_cli("keys", "list", home=tmp_path / "h")
    assert out.returncode == 2
    assert "has no CURVE keys" in out.stderr


# ---------------------------------------------------------------- an in-process CURVE controller


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_HOME", str(h))
    for var in ("TANGRAM_ADDR", "TANGRAM_CERTS", "TANGRAM_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    return h


@pytest.fixture
def certs(home: Path) -> Path:
    return keys.ensure_cluster_keys("auth", ["n1"])


@pytest.fixture
async def controller(certs: Path) -> AsyncIterator[Controller]:
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs)))
    async with c:
        yield c


async def test_name_of_maps_user_ids_to_key_names(
    controller: Controller, certs: Path, tmp_path: Path
) -> None:
    auth = controller.curve
    assert auth is not None
    info, where = keys.add_client("auth", "carol", tmp_path / "carol")
    assert auth.name_of(info.public) == "carol"
    assert auth.name_of(info.public.encode()) == "carol"
    assert auth.name_of(tc.load_dir(str(certs)).public.decode()) == "client"
    assert auth.name_of(tc.load_dir(str(certs), "status").public.decode()) == "status"
    assert auth.name_of(tc.keypair(str(certs / "agent-n1.key_secret"))[0].decode()) == "agent-n1"
    assert auth.name_of(zmq.curve_keypair()[0].decode()) is None
    assert auth.name_of("") is None
    async with tangram.AsyncClient(controller.submit_addr, certs=str(where), connect_timeout=5) as tg:
        assert tg.controller_epoch == controller.epoch
    keys.revoke_client("auth", "carol")
    assert auth.name_of(info.public) is None  # the allow-list re-read its directory


async def test_name_of_a_live_connections_user_id(certs: Path, tmp_path: Path) -> None:
    """The User-Id a CURVE ROUTER sees on a frame is what name_of takes (the gateway's lookup)."""
    from tangram_cli.controller.curve import ServerAuth
    from tangram_cli.controller.state import make_router

    _info, where = keys.add_client("auth", "erin", tmp_path / "erin")
    ctx = zmq.asyncio.Context()
    auth = ServerAuth(ctx, str(certs))
    auth.start()
    router, port = make_router(ctx, "127.0.0.1", 0, lambda s: auth.secure(s, "submit"))
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    tc.load_dir(str(where)).apply(dealer)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        await dealer.send(b"hi")
        frames = await asyncio.wait_for(router.recv_multipart(copy=False), 5)
        assert auth.name_of(frames[-1].get("User-Id")) == "erin"
    finally:
        dealer.close(0)
        router.close(0)
        await auth.aclose()
        ctx.term()


async def test_revoked_key_cannot_reconnect_but_live_connection_stays(
    controller: Controller, tmp_path: Path
) -> None:
    _info, where = keys.add_client("auth", "dave", tmp_path / "dave")
    async with tangram.AsyncClient(controller.submit_addr, certs=str(where), connect_timeout=5) as tg:
        keys.revoke_client("auth", "dave")
        async with tg.api("search", timeout=5):  # the session that is up stays up
            pass
    t0 = time.monotonic()
    with pytest.raises(tc.KeyRefused) as info:
        await tangram.AsyncClient(controller.submit_addr, certs=str(where), connect_timeout=10).connect()
    assert time.monotonic() - t0 < 3
    assert "certs/clients/" in (info.value.hint or "")
    assert "tangram keys add" in (info.value.hint or "")


async def test_wrong_controller_key_is_reported(controller: Controller, certs: Path) -> None:
    mine = tc.load_dir(str(certs))
    pinned_elsewhere = tc.CurveKeys(mine.public, mine.secret, zmq.curve_keypair()[0])
    t0 = time.monotonic()
    with pytest.raises(tc.KeyRefused, match="failed 3 times in a row") as info:
        await tangram.AsyncClient(
            controller.submit_addr, certs=pinned_elsewhere, connect_timeout=10
        ).connect()
    assert time.monotonic() - t0 < 5
    assert "controller.key" in (info.value.hint or "")


async def test_curve_client_against_plain_controller_is_told(certs: Path) -> None:
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1"))
    async with c:
        # a mechanism mismatch, or (when the controller closes first) failures without detail
        with pytest.raises(tc.KeyRefused, match="runs plain TCP"):
            await tangram.AsyncClient(c.submit_addr, certs=str(certs), connect_timeout=10).connect()


def _agent_json(tmp: Path, addr: str, curve: dict[str, str] | None) -> Path:
    work = tmp / "agent"
    work.mkdir(exist_ok=True)
    cfg: dict[str, Any] = {
        "controller": addr,
        "name": "n1",
        "cluster": "auth",
        "executor": "process",
        "workdir": str(work),
        "cpus": [0],
        "idle_cpus": [0],
        "heartbeat_s": 0.5,
        "hello_timeout_s": 2.0,
    }
    if curve is not None:
        cfg["curve"] = curve
    path = tmp / "agent.json"
    path.write_text(json.dumps(cfg))
    return path


def _start_agent(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "agent", "--config", str(cfg)], stdout=fh, stderr=fh)


@pytest.mark.parametrize("keyed", ["random key", "no key"])
async def test_refused_agent_says_so_in_its_log(
    controller: Controller, certs: Path, tmp_path: Path, keyed: str
) -> None:
    curve = None
    if keyed == "random key":
        public, secret = zmq.curve_keypair()
        (tmp_path / "stranger.key_secret").write_text(keys._cert_text(public, secret))
        curve = {
            "controller_public": str(certs / "controller.key"),
            "secret": str(tmp_path / "stranger.key_secret"),
        }
    cfg = _agent_json(tmp_path, controller.agents_addr, curve)
    log = tmp_path / "agent.log"
    proc = _start_agent(cfg, log)
    want = "refused agent n1's CURVE key" if curve else "requires CURVE keys and this agent has none"
    # (without keys libzmq reports a mechanism mismatch, or, when the controller closes first, a
    # handshake failure without detail: both name the missing keys)
    try:
        deadline = time.monotonic() + 15
        text = ""
        while time.monotonic() < deadline and want not in text:
            await asyncio.sleep(0.2)
            text = log.read_text(errors="replace")
        assert want in text, text[-3000:]
        line = next(ln for ln in text.splitlines() if want in ln)
        assert " ERROR " in line
        if curve:
            assert "certs/agents/ (agent-n1.key)" in line
        assert "n1" not in controller.agents.agents
        assert proc.poll() is None  # it keeps trying: the operator may still add its key
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------- bind checks


@pytest.mark.parametrize("bind", ["::ffff:0.0.0.0", "::", "0.0.0.0", "*", "[::]", "[::ffff:0.0.0.0]", "0"])
@pytest.mark.parametrize("curve", [False, True])
def test_wildcards_are_refused_in_every_spelling(bind: str, curve: bool) -> None:
    with pytest.raises(ValueError, match="every interface"):
        check_bind(bind, curve=curve)


@pytest.mark.parametrize(
    "bind", ["10.1.2.3", "::ffff:10.1.2.3", "[::ffff:10.1.2.3]", "2001:db8::1", "[2001:db8::1]"]
)
def test_non_loopback_needs_keys(bind: str) -> None:
    with pytest.raises(ValueError, match="plain TCP is only allowed on loopback"):
        check_bind(bind, curve=False)
    check_bind(bind, curve=True)


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "::ffff:127.0.0.1", "localhost"])
def test_loopback_is_fine_without_keys(bind: str) -> None:
    check_bind(bind, curve=False)


def test_host_names_are_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo
    table = {
        "node-a.example": ["10.0.0.10"],
        "every.example": ["0.0.0.0"],
        "mixed.example": ["127.0.0.1", "192.168.1.5"],
        "mapped.example": ["::ffff:10.0.0.11"],
        "loop.example": ["127.0.0.1", "::1"],
    }

    def fake(host: Any, *args: Any, **kw: Any) -> Any:
        if host in table:
            fam = {True: socket.AF_INET6, False: socket.AF_INET}
            return [(fam[":" in a], socket.SOCK_STREAM, 6, "", (a, 0)) for a in table[host]]
        if host == "no-such-host.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    for name in ("node-a.example", "mixed.example", "mapped.example"):
        with pytest.raises(ValueError, match="plain TCP is only allowed on loopback"):
            check_bind(name, curve=False)
        check_bind(name, curve=True)
    for curve in (False, True):
        with pytest.raises(ValueError, match="every interface"):
            check_bind("every.example", curve=curve)
        with pytest.raises(ValueError, match="neither an IP address nor a host name"):
            check_bind("no-such-host.invalid", curve=curve)
    check_bind("loop.example", curve=False)
    assert bind_host("loop.example") == "127.0.0.1"
    assert bind_host("localhost") == "127.0.0.1"
    assert bind_host("[::1]") == "[::1]"


@pytest.mark.parametrize("bind", ["::ffff:0.0.0.0", "*", "[::]", "0.0.0.0", "::ffff:10.1.2.3"])
@pytest.mark.parametrize("with_keys", [False, True])
def test_controller_refuses_the_bind(bind: str, with_keys: bool, tmp_path: Path, home: Path) -> None:
    """`tangram controller --bind ...` (with --certs too: a CURVE controller binds one interface)."""
    certs = str(keys.ensure_cluster_keys("auth")) if with_keys else None
    if with_keys and bind == "::ffff:10.1.2.3":
        return  # an interface address: allowed with keys (binding it here would fail: no such interface)
    with pytest.raises(ValueError, match="refusing to bind"):
        Controller(parse_config(CONFIG), Options(bind=bind, certs=certs))
    argv = ["controller", "--bind", bind, "--ready-file", str(tmp_path / "r")]
    result = CliRunner().invoke(cli, argv + (["--certs", certs] if certs else []))
    assert result.exit_code == 2, result.output
    assert "refusing to bind" in result.output
    assert not (tmp_path / "r").exists()


async def test_a_loopback_host_name_binds_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, *a, **k: (
            [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
            if host == "ctl.example"
            else real(host, *a, **k)
        ),
    )
    c = Controller(parse_config(CONFIG), Options(bind="ctl.example"))
    try:
        assert c.agents_sock.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://127.0.0.1:")
    finally:
        await c.stop()


async def test_key_revoked_while_connected_fails_requests_after_reconnect(
    certs: Path, tmp_path: Path
) -> None:
    """Connections that are up stay up; once the link drops, the reconnect is refused and the
    client's requests fail with KeyRefused instead of waiting forever."""
    _info, where = keys.add_client("auth", "frank", tmp_path / "frank")
    c1 = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs)))
    await c1.__aenter__()
    ports = {"agents_port": c1.agents_port, "submit_port": c1.submit_port, "status_port": c1.status_port}
    tg = tangram.AsyncClient(c1.submit_addr, certs=str(where), connect_timeout=5)
    await tg.connect()
    try:
        keys.revoke_client("auth", "frank")
        async with tg.api("search", timeout=5):  # still up
            pass
        await c1.__aexit__(None, None, None)  # the link drops; a controller comes back on the same ports
        c2 = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs), **ports))
        async with c2:
            for _ in range(100):  # the reconnect is refused within a second or so
                if tg._transport.refused is not None:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(tc.KeyRefused, match="refused this client's CURVE key"):
                async with tg.api("search", timeout=5):
                    pass
    finally:
        await tg.close()
