"""CURVE "Ironhouse" with real sockets on 127.0.0.1 (docs/security.md, docs/operations.md 3.5).

An in-process controller started with ``--certs`` (keys from tangram_cli/keys.py), the fake agent of
tests/controller or a real ``python -m agent`` subprocess given its keys, and clients with right,
unknown, wrong-role and no keys. Only a key on a socket's allow-list gets service.
"""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
import zmq.auth

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

from fake_agent import FakeAgent

import tangram
from tangram import certs as tc
from tangram.errors import ControllerUnreachable
from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.curve import probe
from tangram_cli.controller.daemon import Controller, Options
from tangram_cli.controller.state import check_bind

CONFIG: dict[str, Any] = {"cluster": "sec", "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2}}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_HOME", str(h))
    for var in ("TANGRAM_ADDR", "TANGRAM_CERTS", "TANGRAM_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    return h


@pytest.fixture
def certs(home: Path) -> Path:
    return keys.ensure_cluster_keys("sec", ["n1", "n2"])


@pytest.fixture
async def controller(certs: Path) -> AsyncIterator[Controller]:
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs)))
    async with c:  # runs the fail-closed self-test
        yield c


def agent_keys(certs: Path, node: str) -> tc.CurveKeys:
    public, secret = tc.keypair(str(certs / f"{keys.agent_role(node)}.key_secret"))
    return tc.CurveKeys(public, secret, tc.public_key(str(certs / "controller.key")))


def random_keys(server: bytes) -> tc.CurveKeys:
    public, secret = zmq.curve_keypair()
    return tc.CurveKeys(public, secret, server)


async def handshake(addr: str, curve: tc.CurveKeys | None, timeout_s: float = 3.0) -> str:
    """accepted / refused / not answered for one connection with these keys (None: NULL)."""
    from zmq.utils.monitor import parse_monitor_message

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    mon = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        sock.connect(addr)
        if not await mon.poll(int(timeout_s * 1000)):
            return "not answered"
        event = parse_monitor_message(await mon.recv_multipart())["event"]
        return "accepted" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


# ---------------------------------------------------------------- keys on disk


def test_keys_modes_allow_lists_and_idempotence(certs: Path) -> None:
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    for role in ("controller", "client", "status", "agent-n1", "agent-n2"):
        assert stat.S_IMODE((certs / f"{role}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((certs / f"{role}.key").stat().st_mode) == 0o644
        pub, sec = zmq.auth.load_certificate(str(certs / f"{role}.key_secret"))  # zmq's own format
        assert sec is not None
        assert zmq.curve_public(sec) == pub
    assert sorted(p.name for p in (certs / "agents").iterdir()) == ["agent-n1.key", "agent-n2.key"]
    assert sorted(p.name for p in (certs / "clients").iterdir()) == ["client.key"]
    assert sorted(p.name for p in (certs / "status").iterdir()) == ["status.key"]
    for sub in ("agents", "clients", "status"):
        assert all(b"secret-key" not in p.read_bytes() for p in (certs / sub).iterdir())
    before = {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()}
    again = keys.ensure_cluster_keys("sec", ["n1", "n2"])
    assert again == certs
    assert {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()} == before
    shipped = keys.agent_files(certs, "n1")
    assert set(shipped) == {"agent.key_secret", "controller.key"}
    assert b"secret-key" not in shipped["controller.key"]


def test_bind_rules() -> None:
    with pytest.raises(ValueError, match="plain TCP"):
        check_bind("10.1.2.3", curve=False)
    check_bind("10.1.2.3", curve=True)
    check_bind("127.0.0.1", curve=False)
    for bad in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            check_bind(bad, curve=True)


def test_controller_refuses_non_loopback_without_certs() -> None:
    with pytest.raises(ValueError, match="--certs"):
        Controller(parse_config(CONFIG), Options(bind="10.1.2.3"))


# ---------------------------------------------------------------- end to end


async def test_right_keys_work_end_to_end(controller: Controller, certs: Path, tmp_path: Path) -> None:
    agent = FakeAgent(controller.agents_addr, "n1", str(tmp_path), curve=agent_keys(certs, "n1"))
    await agent.start()
    try:
        async with (
            tangram.AsyncClient(controller.submit_addr, certs=str(certs), connect_timeout=5) as tg,
            tg.sandbox() as env,
        ):
            r = await env.exec("echo curve-ok", cpus=1, timeout=20)
        assert r.exit_code == 0
        assert r.stdout.strip() == "curve-ok"
        records = await asyncio.to_thread(
            st.query_status, controller.status_addr, sections=("nodes",), timeout_s=5.0, certs=str(certs)
        )
        assert [n["node"] for n in records["nodes"]] == ["n1"]
    finally:
        await agent.stop()


async def test_tangram_certs_env_is_used(
    controller: Controller, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANGRAM_CERTS", str(certs))
    async with tangram.AsyncClient(controller.submit_addr, connect_timeout=5) as tg:
        assert tg.controller_epoch == controller.epoch


async def test_unknown_client_key_gets_no_service(controller: Controller) -> None:
    bad = random_keys(controller.curve.public)  # type: ignore[union-attr]
    client = tangram.AsyncClient(controller.submit_addr, certs=bad, connect_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ControllerUnreachable) as info:
        await client.connect()
    assert time.monotonic() - t0 < 5
    assert "allow-list" in (info.value.hint or "")
    assert await handshake(controller.submit_addr, bad) == "refused"


async def test_null_client_gets_no_service(controller: Controller) -> None:
    client = tangram.AsyncClient(controller.submit_addr, connect_timeout=1.0)  # no keys anywhere
    with pytest.raises(ControllerUnreachable):
        await client.connect()
    for addr in (controller.agents_addr, controller.submit_addr, controller.status_addr):
        assert await handshake(addr, None) == "refused"
    with pytest.raises(ControllerUnreachable):
        await asyncio.to_thread(st.query_status, controller.status_addr, timeout_s=1.0)


async def test_each_socket_takes_only_its_roles(controller: Controller, certs: Path) -> None:
    client = tc.load_dir(str(certs), "client")
    status = tc.load_dir(str(certs), "status")
    agent = agent_keys(certs, "n1")
    c = controller
    expect = {
        (c.agents_addr, "agent"): "accepted",
        (c.agents_addr, "client"): "refused",
        (c.agents_addr, "status"): "refused",
        (c.submit_addr, "agent"): "refused",
        (c.submit_addr, "client"): "accepted",
        (c.submit_addr, "status"): "refused",
        (c.status_addr, "agent"): "refused",
        (c.status_addr, "client"): "accepted",
        (c.status_addr, "status"): "accepted",
    }
    by_role = {"agent": agent, "client": client, "status": status}
    got = {k: await handshake(k[0], by_role[k[1]]) for k in expect}
    assert got == expect


async def test_client_key_on_agents_socket_cannot_register(
    controller: Controller, certs: Path, tmp_path: Path
) -> None:
    impostor = FakeAgent(controller.agents_addr, "n1", str(tmp_path), curve=tc.load_dir(str(certs)))
    with pytest.raises(TimeoutError):
        await impostor.start()  # waits 5 s for a Welcome that never comes
    await impostor.stop()
    assert "n1" not in controller.agents.agents


async def test_node_key_cannot_speak_as_another_node(
    controller: Controller, certs: Path, tmp_path: Path
) -> None:
    liar = FakeAgent(controller.agents_addr, "n2", str(tmp_path), curve=agent_keys(certs, "n1"))
    with pytest.raises(TimeoutError):
        await liar.start()  # ZAP lets n1's key in, but its Hello as n2 is dropped
    await liar.stop()
    assert "n2" not in controller.agents.agents
    assert controller.agents.counters["impostor_frames"] >= 1


async def test_revoked_client_key_is_refused_on_reconnect(controller: Controller, certs: Path) -> None:
    async with tangram.AsyncClient(controller.submit_addr, certs=str(certs), connect_timeout=5):
        pass
    (certs / "clients" / "client.key").unlink()
    client = tangram.AsyncClient(controller.submit_addr, certs=str(certs), connect_timeout=1.0)
    with pytest.raises(ControllerUnreachable):
        await client.connect()


async def test_self_test_fails_closed_when_any_key_gets_in(certs: Path) -> None:
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs)))
    c.start()
    try:
        c.curve.allow["submit"].callback = lambda _domain, _key: True  # type: ignore[union-attr,method-assign]
        with pytest.raises(RuntimeError, match="submit socket: a unknown-key client was accepted"):
            await c.check_security()
        assert await probe(c.ctx, c.agents_addr, c.curve.public) == "refused"  # type: ignore[union-attr]
    finally:
        await c.stop()


# ---------------------------------------------------------------- a real agent process


def _agent_config(tmp: Path, addr: str, curve: dict[str, str]) -> Path:
    work = tmp / "agent"
    work.mkdir(exist_ok=True)
    cfg = {
        "controller": addr,
        "name": "n1",
        "cluster": "sec",
        "executor": "process",
        "workdir": str(work),
        "cpus": [0],
        "idle_cpus": [0],
        "heartbeat_s": 0.5,
        "curve": curve,
    }
    path = tmp / "agent.json"
    path.write_text(json.dumps(cfg))
    return path


async def _wait_node(c: Controller, name: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        a = c.agents.agents.get(name)
        if a is not None and a.live and c.core.cpu.nodes.get(name):
            return True
        await asyncio.sleep(0.05)
    return False


def _run_agent(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "agent", "--config", str(cfg)], stdout=fh, stderr=fh)


async def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 5)


async def test_real_agent_with_its_keys(controller: Controller, certs: Path, tmp_path: Path) -> None:
    ship = tmp_path / "node"
    ship.mkdir()
    for name, data in keys.agent_files(certs, "n1").items():  # what `up` ships over SFTP
        (ship / name).write_bytes(data)
    cfg = _agent_config(
        tmp_path,
        controller.agents_addr,
        {"controller_public": str(ship / "controller.key"), "secret": str(ship / "agent.key_secret")},
    )
    proc = _run_agent(cfg, tmp_path / "agent.log")
    try:
        ok = await _wait_node(controller, "n1", 20)
        assert ok, (tmp_path / "agent.log").read_text(errors="replace")[-3000:]
        async with (
            tangram.AsyncClient(controller.submit_addr, certs=str(certs), connect_timeout=5) as tg,
            tg.sandbox() as env,
        ):
            r = await env.exec("echo real-agent", cpus=1, timeout=30)
        assert r.stdout.strip() == "real-agent"
        assert r.node == "n1"
    finally:
        await _stop(proc)


async def test_real_agent_with_a_client_key_never_registers(
    controller: Controller, certs: Path, tmp_path: Path
) -> None:
    cfg = _agent_config(
        tmp_path,
        controller.agents_addr,
        {"controller_public": str(certs / "controller.key"), "secret": str(certs / "client.key_secret")},
    )
    proc = _run_agent(cfg, tmp_path / "agent.log")
    try:
        assert not await _wait_node(controller, "n1", 3)
        assert proc.poll() is None  # it keeps trying; the controller keeps refusing
    finally:
        await _stop(proc)


# ---------------------------------------------------------------- the CLI


def test_env_prints_certs(home: Path, certs: Path) -> None:
    from click.testing import CliRunner

    from tangram_cli.main import cli

    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # tangram controller"])
    try:
        with st.locked("sec"):
            st.write(
                st.ClusterState(name="sec", controller_pid=fake.pid, ports={"submit": 2}, certs=str(certs))
            )
        out = CliRunner().invoke(cli, ["env", "-c", "sec"], catch_exceptions=False).stdout
        assert "export TANGRAM_ADDR=tcp://127.0.0.1:2" in out
        assert f"export TANGRAM_CERTS={certs}" in out
        assert tc.client_keys("tcp://127.0.0.1:2", None) == tc.load_dir(str(certs))  # found via state.json
    finally:
        fake.kill()
        fake.wait(5)


def test_agent_config_curve_checks(certs: Path) -> None:
    from agent.config import AgentConfig
    from tangram.errors import ConfigError

    good = {"controller_public": str(certs / "controller.key"), "secret": str(certs / "agent-n1.key_secret")}
    cfg = AgentConfig.from_dict({"controller": "tcp://10.1.2.3:7700", "name": "n1", "curve": good})
    assert cfg.curve_keys().public == agent_keys(certs, "n1").public  # remote controller allowed with CURVE
    with pytest.raises(ConfigError, match="missing secret"):
        AgentConfig.from_dict({"controller": "tcp://127.0.0.1:7700", "curve": {"controller_public": "x"}})
    with pytest.raises(ConfigError, match="no secret key"):
        AgentConfig.from_dict(
            {"controller": "tcp://127.0.0.1:7700", "curve": {**good, "secret": str(certs / "agent-n1.key")}}
        )
    with pytest.raises(ConfigError, match="loopback"):
        AgentConfig.from_dict({"controller": "tcp://10.1.2.3:7700", "name": "n1"})
