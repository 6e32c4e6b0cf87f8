"""Client sessions (issue 11, finding 1): a copied routing identity gets nothing of its victim.

Real sockets throughout: an in-process controller, the in-test agent of tests/controller, the
client library as the victim, a TCP proxy in front of the victim (to cut or freeze its link), and
the attacker as a second *process* given the victim's routing identity (as if it had leaked), with
or without the victim's CURVE key. The attacker tries every request on the victim's sandbox and
lease and records every frame it receives: it must get no reply of the victim's and change
nothing, while the victim keeps working, and a victim whose link broke gets its session back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

from fake_agent import FakeAgent
from support.waiting import until as wait_until

import tangram
from tangram import certs as tc
from tangram_cli import keys
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options
from tangram_cli.render.status import renderable, to_json

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"the-victims-secret-7f3a"
CONFIG: dict[str, Any] = {
    "cluster": "sess",
    "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2},
    "apis": [{"name": "search", "mode": "concurrency", "limit": 1}],
}

# The attacker: a separate process with the victim's routing identity. It sends the requests it is
# given (JSON) over a DEALER, then reports every frame it receives (JSON lines on stdout). It
# reconnects when it hears nothing, as a persistent attacker would.
ATTACKER = r"""
import json, sys, time
import zmq
from tangram import protocol as p
from tangram.certs import CurveKeys

args = json.loads(sys.argv[1])
ctx = zmq.Context()
def connect():
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, bytes.fromhex(args["ident"]))
    s.setsockopt(zmq.LINGER, 0)
    if args.get("curve"):
        c = args["curve"]
        CurveKeys(c["public"].encode(), c["secret"].encode(), c["server"].encode()).apply(s)
    s.connect(args["addr"])
    return s
token = bytes.fromhex(args.get("token", ""))
reqs = [
    (1, p.Hello("client", "mallory", p.PROTOCOL_MAJOR, p.BATCH_MINOR - 1), []),
    (2, p.Exec(args["sandbox"], "cat secret.txt", 1, 1), []),
    (3, p.Get(args["sandbox"], "secret.txt"), []),
    (4, p.Put(args["sandbox"], "secret.txt"), [b"overwritten"]),
    (5, p.Release(args["lease"]), []),
    (6, p.SandboxClose(args["sandbox"]), []),
    (0, p.Heartbeat(), []),
]
got = []
sock = connect()
deadline = time.monotonic() + args["seconds"]
tries = 0
while time.monotonic() < deadline:
    for rid, msg, blobs in reqs:
        sock.send_multipart(p.encode(msg, rid, blobs, token=token) if token else p.encode(msg, rid, blobs))
    tries += 1
    quiet_until = time.monotonic() + 1.0
    while time.monotonic() < min(quiet_until, deadline):
        if sock.poll(50):
            env = p.decode(sock.recv_multipart())
            m = env.msg
            got.append({"type": m.NAME, "rid": env.request_id, "code": getattr(m, "code", ""),
                        "session": getattr(m, "session", ""),
                        "blobs": [b.decode("latin-1") for b in env.blobs]})
            quiet_until = time.monotonic() + 1.0
    if got and args.get("once"):
        break
    if not got:  # no route yet (the victim's connection still held it): a new connection
        sock.close(0)
        sock = connect()
print(json.dumps({"got": got, "tries": tries}))
sock.close(0)
ctx.term()
"""


def attack(addr: str, ident: bytes, sandbox: str, lease: str, seconds: float, **extra: Any) -> dict[str, Any]:
    args = {
        "addr": addr,
        "ident": ident.hex(),
        "sandbox": sandbox,
        "lease": lease,
        "seconds": seconds,
        **extra,
    }
    out = subprocess.run(
        [sys.executable, "-c", ATTACKER, json.dumps(args)],
        capture_output=True,
        timeout=seconds + 30,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def assert_nothing_of_the_victims(report: dict[str, Any]) -> None:
    for frame in report["got"]:
        assert frame["type"] in ("ERROR", "REJECT"), frame  # never a RESULT, ACCEPTED or WELCOME
        assert frame["type"] == "REJECT" or frame["code"] == "AUTH", frame
        assert not frame["session"] and not any(SECRET.decode() in b for b in frame["blobs"]), frame


class Proxy:
    """A TCP proxy in front of the controller: `cut()` closes every link (the peers see it),
    `freeze()` stops forwarding without closing (a half-open link), `refuse` drops new links."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.links: list[tuple[socket.socket, socket.socket]] = []
        self.every: list[socket.socket] = []  # closed at the end, frozen ones included
        self.frozen: set[int] = set()
        self.refuse = False
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            if self.refuse:
                down.close()
                continue
            up = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.links.append((down, up))
                self.every += [down, up]
            threading.Thread(target=self._pump, args=(down, up), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self.closed:
                if id(a) in self.frozen:
                    time.sleep(0.05)
                    continue
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for s in ready:
                    if id(a) in self.frozen:
                        break
                    data = s.recv(1 << 16)
                    if not data:
                        raise OSError
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):
            for s in (a, b):
                s.close()

    def cut(self) -> None:
        with self.lock:
            links, self.links = self.links, []
        for pair in links:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def freeze(self) -> None:
        with self.lock:
            links, self.links = self.links, []
        self.frozen.update(id(a) for a, _ in links)

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()
        time.sleep(0.2)  # the pumps see `closed`
        for s in self.every:
            s.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Any]:
    made: list[Any] = []

    async def make(certs: Path | None = None) -> tuple[Controller, FakeAgent]:
        c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs) if certs else None))
        c.start()
        await c.check_security()
        agent_keys = None
        if certs is not None:
            public, secret = tc.keypair(str(certs / f"{keys.agent_role('n1')}.key_secret"))
            agent_keys = tc.CurveKeys(public, secret, tc.public_key(str(certs / "controller.key")))
        root = tmp_path / "agent"
        root.mkdir(exist_ok=True)
        a = FakeAgent(c.agents_addr, "n1", str(root), cpus=(0, 1), curve=agent_keys)
        await a.start()
        made.append((c, a))
        for _ in range(200):
            if c.core.cpu.nodes.get("n1"):
                break
            await asyncio.sleep(0.01)
        return c, a

    yield make
    for c, a in made:
        await a.stop()
        await c.stop()


@pytest.fixture
def proxies() -> Any:
    made: list[Proxy] = []

    def make(port: int) -> Proxy:
        px = Proxy(port)
        made.append(px)
        return px

    yield make
    for px in made:
        px.close()


async def victim_with_work(addr: str, **kw: Any) -> tuple[tangram.AsyncClient, Any, Any]:
    """A client with a placed sandbox holding SECRET and a held lease."""
    tg = await tangram.AsyncClient(addr, name="victim", heartbeat_s=0.2, **kw).connect()
    sb = await tg.open_sandbox()
    await sb.put("secret.txt", SECRET)
    assert (await sb.exec("cat secret.txt", timeout=10)).stdout_bytes == SECRET  # placed on n1
    lease = await tg.api("search", timeout=10).acquire()
    return tg, sb, lease


async def assert_victim_untouched(c: Controller, tg: tangram.AsyncClient, sb: Any, lease: Any) -> None:
    assert (await sb.exec("cat secret.txt", timeout=10)).stdout_bytes == SECRET  # not overwritten
    assert await sb.get("secret.txt", timeout=10) == SECRET
    assert not c.registry.sandboxes[sb.id].closed  # not closed
    assert c.core.snapshot().apis[0]["in_flight"] == 1  # the lease is still the victim's
    await lease.release()
    await sb.close()


# ---------------------------------------------------------------- a live victim


async def test_a_copied_identity_gets_nothing_while_the_victim_is_connected(cluster: Any) -> None:
    c, _agent = await cluster()
    tg, sb, lease = await victim_with_work(c.submit_addr)
    try:
        ident = tg._transport.identity
        report = await asyncio.to_thread(attack, c.submit_addr, ident, sb.id, lease.lease, 3.0)
        assert_nothing_of_the_victims(report)  # its connection never gets the identity's route
        r = await sb.exec("echo still mine", timeout=10)  # the victim's next exec does not time out
        assert r.stdout == "still mine\n"
        await assert_victim_untouched(c, tg, sb, lease)
    finally:
        await tg.close()


# ---------------------------------------------------------------- a victim whose link dropped


async def test_a_copied_identity_gets_nothing_while_the_victim_is_away_and_the_victim_comes_back(
    cluster: Any, proxies: Any
) -> None:
    c, _agent = await cluster()
    px = proxies(c.submit_port)
    tg, sb, lease = await victim_with_work(px.addr)
    try:
        ident = tg._transport.identity
        running = asyncio.ensure_future(sb.exec("sleep 1; cat secret.txt", timeout=30))
        await asyncio.sleep(0.3)
        px.refuse = True  # the victim's link drops and cannot come back for now
        px.cut()
        await wait_until(lambda: c.gateway.counters.get("client_drops", 1) >= 1)
        await asyncio.sleep(0.3)
        # the attacker takes the free route: without a token, then with a made-up one
        for token in ("", "00" * 24):  # protocol.TOKEN_BYTES
            report = await asyncio.to_thread(
                attack, c.submit_addr, ident, sb.id, lease.lease, 4.0, token=token, once=True
            )
            assert report["got"], "the attacker's frames should arrive (it holds the route)"
            assert_nothing_of_the_victims(report)
            assert any(f["code"] == "AUTH" for f in report["got"])  # refused, typed
        assert c.gateway.counters.get("auth_refused", 0) >= 10
        assert not running.done()  # the exec's reply waits for the victim, not for whoever connects
        # the attacker is gone; the victim's link comes back: same session, same sandbox
        px.refuse = False
        r = await asyncio.wait_for(running, 20)
        assert r.stdout_bytes == SECRET
        await assert_victim_untouched(c, tg, sb, lease)
    finally:
        running.cancel()
        await tg.close()


async def test_a_half_open_link_comes_back_to_the_same_session(cluster: Any, proxies: Any) -> None:
    """The victim's link stops carrying anything without closing: the controller's ZMTP heartbeats
    drop the stale route and the client library reconnects; nothing is lost or run twice."""
    c, _agent = await cluster()
    px = proxies(c.submit_port)
    async with tangram.AsyncClient(px.addr, name="victim", heartbeat_s=0.2) as tg:
        sb = await tg.open_sandbox()
        await sb.put("kept.txt", b"kept")
        assert (await sb.exec("cat kept.txt", timeout=10)).stdout == "kept"
        px.freeze()
        r = await asyncio.wait_for(sb.exec("echo x >> runs; cat kept.txt", timeout=30), 30)
        assert r.stdout == "kept"
        assert (await sb.exec("wc -l < runs", timeout=10)).stdout.strip() == "1"  # ran once
        assert tg._transport.reconnects >= 1
        rows = c._records(["clients"], 10)["clients"]
        assert [r["name"] for r in rows] == ["victim"]  # one session, the same one


# ---------------------------------------------------------------- CURVE: bound to the key


async def test_curve_session_is_bound_to_its_key(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path / "home"))
    for var in ("TANGRAM_ADDR", "TANGRAM_CERTS", "TANGRAM_CLUSTER"):
        monkeypatch.delenv(var, raising=False)
    certs = keys.ensure_cluster_keys("sess", ["n1"])
    import zmq

    public, secret = zmq.curve_keypair()  # another allowed client key: certs/clients/mallory.key
    (certs / "clients" / "mallory.key").write_text(f'metadata\ncurve\n    public-key = "{public.decode()}"\n')
    server = tc.public_key(str(certs / "controller.key"))
    victim_pub, victim_sec = tc.keypair(str(certs / "client.key_secret"))
    c, _agent = await cluster(certs)
    px = proxies_ = Proxy(c.submit_port)
    try:
        tg, sb, lease = await victim_with_work(px.addr, certs=str(certs))
        try:
            ident, token = tg._transport.identity, getattr(tg._transport, "token", b"")
            px.refuse = True
            px.cut()
            await wait_until(lambda: c.gateway.counters.get("client_drops", 1) >= 1)
            await asyncio.sleep(0.3)
            cases = [
                # the victim's own (shared default) key and identity, no token
                {"public": victim_pub.decode(), "secret": victim_sec.decode(), "server": server.decode()},
                # another allowed key with the victim's identity *and* its token (both leaked)
                {"public": public.decode(), "secret": secret.decode(), "server": server.decode()},
            ]
            for curve, tok in zip(cases, ("", token.hex()), strict=True):
                report = await asyncio.to_thread(
                    attack, c.submit_addr, ident, sb.id, lease.lease, 4.0, curve=curve, token=tok, once=True
                )
                assert report["got"], "the attacker's frames should arrive (it holds the route)"
                assert_nothing_of_the_victims(report)
            px.refuse = False
            rows = c._records(["clients"], 10)["clients"]
            assert rows[0].get("owner") == "client"  # the key's name (curve.name_of)
            await assert_victim_untouched(c, tg, sb, lease)
        finally:
            await tg.close()
    finally:
        proxies_.close()


# ---------------------------------------------------------------- status: names only


async def test_status_names_clients_and_never_shows_an_identity_or_a_token(cluster: Any) -> None:
    c, _agent = await cluster()
    async with tangram.AsyncClient(c.submit_addr, name="worker-7", heartbeat_s=0.2) as tg:
        sb = await tg.open_sandbox()
        blocker = asyncio.ensure_future(sb.exec("sleep 1", cpus=2, timeout=10))
        queued = asyncio.ensure_future(sb.exec("true", cpus=2, timeout=10))  # a queue row too
        await wait_until(lambda: c.core.snapshot().queued >= 1)
        ident, token = tg._transport.identity, getattr(tg._transport, "token", b"") or bytes(24)
        records = await asyncio.to_thread(_status, c.status_addr)
        text = json.dumps(records)
        from rich.console import Console

        console = Console(width=400, record=True)
        console.print(renderable(records, wide=True))
        rendered = console.export_text()
        shown = text + rendered + json.dumps(to_json(records))
        for secret in (ident.hex(), token.hex(), ident.hex()[:12], token.hex()[:12]):
            assert secret not in shown
        rows = records["clients"]
        assert [r["name"] for r in rows] == ["worker-7"] and len(rows[0]["client"]) == 6
        assert records["queue"][0]["client"] == rows[0]["client"] == records["actions"][0]["client"]
        assert records["queue"][0].get("owner") == "worker-7"  # named, with the tag to tell rows apart
        assert f"worker-7 ({rows[0]['client']})" in rendered
        await blocker
        await queued


def _status(addr: str) -> dict[str, Any]:
    from tangram_cli.state import query_status

    return query_status(addr, timeout_s=5.0)
