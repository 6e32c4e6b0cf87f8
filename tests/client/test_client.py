"""The client library on its own: import footprint, argument checks, connection failures,
and surviving a controller restart on the same port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

import tangram
from tangram.client.aio import AsyncSandbox, parse_mem
from tangram.errors import BadRequest, ControllerUnreachable, UnitError
from tangram_cli.controller.config import ControllerConfig
from tangram_cli.controller.daemon import Controller, Options

HEAVY = ("click", "asyncssh", "docker", "rich", "numpy", "pydantic", "yaml", "tangram_cli", "tangram.core")


def test_import_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, tangram, tangram.client, tangram.client.aio, tangram.client.sync, tangram.client.transport;"
        "tangram.AsyncClient; tangram.Client;"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_names() -> None:
    from tangram.client.aio import AsyncClient
    from tangram.client.sync import Client

    assert tangram.AsyncClient is AsyncClient and tangram.Client is Client
    assert tangram.ActionTimeout.retryable and not tangram.NoCapacity.retryable
    assert issubclass(tangram.ActionTimeout, TimeoutError)  # `except TimeoutError` catches it too


@pytest.mark.parametrize(
    ("text", "mib"),
    [(None, 0), (512, 512), ("4GiB", 4096), ("512MiB", 512), ("2GB", 1907), ("1.5GiB", 1536)],
)
def test_parse_mem(text, mib) -> None:  # tangram.units rules (tests/test_units.py has the table)
    assert parse_mem(text) == mib


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "4XB", True, -5, "2g", 1.5, 10**8, "65TiB"])
def test_parse_mem_rejects(bad) -> None:
    with pytest.raises(UnitError) as info:  # a BadRequest
        parse_mem(bad)
    assert isinstance(info.value, BadRequest) and repr(bad) in str(info.value)


async def test_argument_checks_happen_before_sending() -> None:
    client = tangram.AsyncClient("tcp://127.0.0.1:9")  # never connected
    sb = AsyncSandbox(client, "sb-1")
    for kwargs in (
        {"cpus": 0},
        {"cpus": (3, 2)},
        {"cpus": (1, 2, 3)},
        {"cpus": "2"},
        {"timeout": -1},
        {"timeout": 0},
        {"total_timeout": 0},
    ):
        with pytest.raises(BadRequest):
            await sb.exec("true", **kwargs)
    for cmd in ([], ["ls", 1], b"ls", 42):
        with pytest.raises(BadRequest, match="cmd"):
            await sb.exec(cmd)
    with pytest.raises(UnitError):
        client.sandbox(mem="2 gigs")  # refused before anything is sent
    with pytest.raises(BadRequest):
        await client.call("svc", {"x": object()})
    with pytest.raises(BadRequest):
        await client.call("svc", {}, gpus=[])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_controller_is_reported() -> None:
    t0 = time.monotonic()
    with pytest.raises(ControllerUnreachable) as info:
        await tangram.AsyncClient(f"tcp://127.0.0.1:{_free_port()}", connect_timeout=0.5).connect()
    assert info.value.retryable and time.monotonic() - t0 < 3


def test_sync_unreachable_and_env_address(monkeypatch) -> None:
    monkeypatch.setenv("TANGRAM_ADDR", f"tcp://127.0.0.1:{_free_port()}")
    with pytest.raises(ControllerUnreachable):
        tangram.Client.from_env(connect_timeout=0.3).connect()


async def test_client_survives_a_controller_restart_on_the_same_port() -> None:
    port = _free_port()
    c1 = Controller(ControllerConfig(heartbeat_s=0.2), Options(submit_port=port))
    c1.start()
    client = tangram.AsyncClient(f"tcp://127.0.0.1:{port}", heartbeat_s=0.2)
    await client.connect()
    epoch = client.controller_epoch
    await client.open_sandbox()
    await c1.stop()
    await asyncio.sleep(0.3)
    c2 = Controller(ControllerConfig(heartbeat_s=0.2), Options(submit_port=port))
    c2.start()
    try:
        sb = await asyncio.wait_for(client.open_sandbox(), 10)  # libzmq reconnected by itself
        assert sb.id.startswith("sb-")
        for _ in range(50):
            if client.controller_epoch != epoch:
                break
            await asyncio.sleep(0.1)
        assert client.controller_epoch == c2.epoch != epoch  # the client noticed the new controller
        await sb.close()
    finally:
        await client.close()
        await c2.stop()


async def test_a_final_that_crossed_the_welcome_is_not_resent() -> None:
    """After a restart the controller's Welcome and the recorded answer to a request can arrive
    together: the transport reads what waits before it resends, so that request is answered
    once and not sent again; a request still pending is resent once."""
    from support.fake_controller import FakeController

    from tangram import protocol as p
    from tangram.client.transport import Transport

    ctl = FakeController()
    transport = Transport(ctl.addr, "crossing", heartbeat_s=5.0)
    try:
        start = asyncio.ensure_future(transport.start())
        hello = await ctl.recv()
        await ctl.send(ctl.welcome(1), hello.request_id)
        await start
        answered = transport.request(p.Cancel(target_request_id=1))
        waiting = transport.request(p.Cancel(target_request_id=2))
        seen = {(await ctl.recv()).request_id, (await ctl.recv()).request_id}
        assert seen == {answered.request_id, waiting.request_id}
        # a restarted controller: its Welcome, then at once the recorded answer of one request
        await ctl.send(ctl.welcome(2))
        await ctl.send(p.Result({}), answered.request_id)
        assert (await asyncio.wait_for(answered.final, 5)).request_id == answered.request_id
        resent = []
        with pytest.raises(TimeoutError):
            while True:
                resent.append((await ctl.request(0.5)).request_id)
        assert resent == [waiting.request_id] and transport.resent == 1 and transport.stray_replies == 0
    finally:
        await transport.close()
        ctl.close()
