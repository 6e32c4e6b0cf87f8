"""Fixtures: an in-process controller on 127.0.0.1 random ports, fake agents, raw DEALERs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_agent import FakeAgent

from tangram import protocol as p
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options

CONFIG: dict[str, Any] = {
    "cluster": "test",
    "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2},
    "services": [
        {
            "name": "echo",
            "runtime": "emulated",
            "model": "x:y",
            "gpu_mem_mib": 1000,
            "chunk_sizes": [1, 2],
            "load_s": 0.01,
            "t_ori": 1.0,
        }
    ],
    "apis": [{"name": "search", "mode": "concurrency", "limit": 2}],
}

Starts = Callable[..., Awaitable[Controller]]  # what the `controllers` fixture and its wrappers return


@pytest.fixture
async def controllers() -> AsyncIterator[Starts]:
    """`await controllers(raw=CONFIG, **options)`: an in-process controller, started, from the raw
    config `raw` and `Options(bind="127.0.0.1", **options)` (random ports unless given). All are
    stopped at teardown, last made first; stopping one the test already stopped is harmless."""
    made: list[Controller] = []

    async def make(raw: dict[str, Any] = CONFIG, **options: Any) -> Controller:
        c = Controller(parse_config(raw), Options(bind="127.0.0.1", **options))
        c.start()
        made.append(c)
        return c

    yield make
    for c in reversed(made):
        await c.stop()


@pytest.fixture
def metered(controllers: Starts) -> Starts:
    """`await metered(**config)`: a controller on CONFIG with these top-level keys replaced and its
    metrics endpoint on a free port."""
    return lambda **extra: controllers({**CONFIG, **extra}, metrics_port=0)


@pytest.fixture
def make_controller(controllers: Starts) -> Starts:
    """`await make_controller(**scheduler)`: a controller on CONFIG with these scheduler settings."""
    return lambda **scheduler: controllers({**CONFIG, "scheduler": {**CONFIG["scheduler"], **scheduler}})


@pytest.fixture
async def controller(make_controller: Callable[..., Any]) -> Controller:
    return await make_controller()


@pytest.fixture
async def make_agent(tmp_path: Any) -> AsyncIterator[Callable[..., Any]]:
    agents: list[FakeAgent] = []

    async def make(c: Controller, name: str = "n1", **kw: Any) -> FakeAgent:
        root = tmp_path / f"agent-{name}"
        root.mkdir(exist_ok=True)
        a = FakeAgent(c.agents_addr, name, str(root), **kw)
        await a.start()
        agents.append(a)
        for _ in range(100):  # the driver has handled NodeJoined
            if c.core.cpu.nodes.get(name) or c.core.gpu.nodes.get(name):
                break
            await asyncio.sleep(0.01)
        return a

    yield make
    for a in agents:
        await a.stop()


@pytest.fixture
async def agent(controller: Controller, make_agent: Callable[..., Any]) -> FakeAgent:
    return await make_agent(controller, "n1", cpus=(0, 1), gpus=2, gpu_mem_mib=4000)


# What a session's client sends (the submit socket's requests): a RawClient says Hello first.
SESSION_REQUESTS = (p.SandboxOpen, p.SandboxClose, p.Put, p.Get, p.Exec, p.Call, p.Lease, p.Release, p.Cancel)
HELLO_RID = 1 << 62


class RawClient:
    """A bare DEALER for requests the client library would never send.

    Like the library it says `Hello` before its first submit request and carries the session
    token of the `Welcome` on every later frame (`token`; set it to resume a session, None: no
    session yet)."""

    def __init__(self, addr: str, minor: int = p.PROTOCOL_MINOR) -> None:
        self.minor = minor  # what its Hello says: below BATCH_MINOR it is sent no batches
        self.batches_in = 0  # BATCH messages received
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.token: bytes | None = None
        self.waiting: collections.deque[p.Envelope] = collections.deque()  # the rest of a batch

    async def hello(self, name: str = "raw") -> p.Envelope:
        await self.send(p.Hello("client", name, p.PROTOCOL_MAJOR, self.minor), HELLO_RID)
        return await self.final(HELLO_RID)

    async def send(self, msg: p.Message, rid: int, blobs: list[bytes] = ()) -> None:  # type: ignore[assignment]
        if self.token is None and isinstance(msg, SESSION_REQUESTS):
            await self.hello()
        await self.sock.send_multipart(p.encode(msg, rid, blobs, token=self.token or b""))

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def recv(self, timeout: float = 5.0) -> p.Envelope:
        while True:
            if not self.waiting:
                frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
                self.batches_in += p.is_batch(frames)
                items = p.decode_all(frames)  # it says minor >= BATCH_MINOR: finals may come in a batch
                self.waiting.extend(e for e in items if isinstance(e, p.Envelope))
                continue
            env = self.waiting.popleft()
            if isinstance(env.msg, p.Welcome) and env.msg.session:
                self.token = bytes.fromhex(env.msg.session)
            if not isinstance(env.msg, p.Heartbeat):
                return env

    async def final(self, rid: int, timeout: float = 10.0) -> p.Envelope:
        while True:
            env = await self.recv(timeout)
            if env.request_id == rid and not isinstance(env.msg, p.Accepted):
                return env

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw_client() -> Any:
    made: list[RawClient] = []

    def make(addr: str, minor: int = p.PROTOCOL_MINOR) -> RawClient:
        r = RawClient(addr, minor)
        made.append(r)
        return r

    yield make
    for r in made:
        with contextlib.suppress(Exception):
            r.close()


@pytest.fixture
def controller_thread(tmp_path: Any) -> Any:
    """A controller and a fake agent on their own event loop thread (for sync-client tests)."""
    import threading

    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    stop = asyncio.Event()

    async def main() -> None:
        c = Controller(parse_config(CONFIG), Options())
        c.start()
        a = FakeAgent(c.agents_addr, "n1", str(tmp_path), gpus=2, gpu_mem_mib=4000)
        await a.start()
        ready["addr"] = c.submit_addr
        ready["event"].set()
        await stop.wait()
        await a.stop()
        await c.stop()

    import threading as _t

    ready["event"] = _t.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert ready["event"].wait(10)
    yield ready["addr"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    loop.close()
