"""Bytes held for clients (issue 11, finding 5): valid requests cannot grow the controller without bound.

`tangram controller` runs as a subprocess (its RSS is read from /proc/<pid>/status) with small caps
(`scheduler.max_client_bytes` 32 MiB, `scheduler.max_held_bytes` 48 MiB); the in-test agent of
tests/controller serves it where execs need a node. Files put before a sandbox's first exec and the
stdin of queued execs count against the caps: past the client's cap a request gets `OverCap` naming
the cap, past the controller's `RetryLater`; nothing of a refused request is kept, and the RSS stays
within a bound far below what the requests carried. A request over the protocol's message limit is
refused by the client library itself, and a raw peer that sends one anyway is dropped by libzmq and
counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from support.waiting import until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

from fake_agent import FakeAgent

import tangram
from tangram import protocol as p
from tangram.errors import BadRequest, RetryLater, TangramError
from tangram_cli.state import query_status

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/status")

MIB = 1 << 20
CLIENT_CAP = 32 * MIB
GLOBAL_CAP = 48 * MIB
BLOB = 16 * MIB
CONFIG = {
    "cluster": "caps",
    "scheduler": {
        "client_grace_s": 30,
        "heartbeat_s": 1.0,  # an agent is lost after 3 silent intervals: 16 MiB transfers on a busy host
        "max_client_bytes": CLIENT_CAP,
        "max_held_bytes": GLOBAL_CAP,
    },
}


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """`tangram controller` as a subprocess with small byte caps; yields its ready info."""
    ready = tmp_path / "ready.json"
    config = tmp_path / "resolved.json"
    config.write_text(json.dumps(CONFIG))
    with open(tmp_path / "controller.log", "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from tangram_cli.main import cli; cli()",
                "controller",
                "--bind",
                "127.0.0.1",
                "--config",
                str(config),
                "--ready-file",
                str(ready),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "controller.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "controller not ready in 20 s"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        info["proc"] = proc
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def counters(info: dict[str, Any]) -> dict[str, int]:
    return query_status(info["status_addr"], sections=("cluster",), timeout_s=5.0)["cluster"]["counters"]


def data(i: int) -> bytes:
    return bytes([65 + i % 26]) * BLOB


async def start_agent(info: dict[str, Any], root: Path) -> FakeAgent:
    root.mkdir(exist_ok=True)
    agent = await FakeAgent(info["agents_addr"], "n1", str(root), cpus=(0,)).start()
    deadline = time.monotonic() + 10
    while True:
        st = await asyncio.to_thread(query_status, info["status_addr"], sections=("nodes",), timeout_s=5.0)
        if any(n.get("agent_state") == "up" for n in st["nodes"]):
            return agent
        assert time.monotonic() < deadline, "agent did not register"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- puts kept before the first exec


async def test_puts_before_the_first_exec_stop_at_the_client_cap(controller: dict[str, Any]) -> None:
    pid = controller["pid"]
    async with tangram.AsyncClient(controller["submit_addr"], name="putter") as tg:
        boxes = [await tg.open_sandbox() for _ in range(8)]
        warm = await tg.open_sandbox()
        await warm.put("warm", b"x")
        await warm.close()
        base = rss_mib(pid)
        refused: list[TangramError] = []
        for i, sb in enumerate(boxes):  # 8 x 16 MiB = 128 MiB asked for, before any exec
            try:
                await sb.put("big.bin", data(i), timeout=20)
            except TangramError as exc:
                refused.append(exc)
        grown = rss_mib(pid) - base
        assert len(refused) == 6, refused  # two fit the 32 MiB cap
        for exc in refused:
            assert exc.code is not None and exc.code.value == "OVER_CAP", repr(exc)
            assert not exc.retryable
            assert "32.0 MiB" in exc.message and "scheduler.max_client_bytes" in exc.message
        assert await boxes[1].get("big.bin", timeout=20) == data(1)  # what was kept is intact
        assert grown < 96, f"controller RSS grew {grown:.0f} MiB for 32 MiB kept"
        cnt = await asyncio.to_thread(counters, controller)
        assert cnt["over_cap_client"] == 6 and cnt["held_bytes"] == 2 * BLOB
        await boxes[0].close()  # its kept file goes: room for another
        await boxes[2].put("big.bin", data(2), timeout=20)
        for sb in boxes[1:]:
            await sb.close()
        assert (await asyncio.to_thread(counters, controller))["held_bytes"] == 0


async def test_the_global_cap_answers_retry_later(controller: dict[str, Any]) -> None:
    addr = controller["submit_addr"]
    async with tangram.AsyncClient(addr, name="a") as a, tangram.AsyncClient(addr, name="b") as b:
        sa, sb = await a.open_sandbox(), await b.open_sandbox()
        await sa.put("one", data(0), timeout=20)
        await sa.put("two", data(1), timeout=20)  # a holds 32 MiB of the controller's 48
        await sb.put("one", data(2), timeout=20)  # 48 MiB now
        with pytest.raises(RetryLater) as info:  # retried by the library until its timeout
            await sb.put("two", data(3), timeout=1)
        assert "48.0 MiB" in info.value.message and "scheduler.max_held_bytes" in info.value.message
        put = asyncio.ensure_future(sb.put("two", data(3), timeout=20))
        await asyncio.sleep(0.3)
        await sa.close()  # frees 32 MiB: b's retry gets in
        await put
        assert (await asyncio.to_thread(counters, controller))["over_cap_global"] >= 2


# ---------------------------------------------------------------- stdin of queued execs


async def test_stdin_of_queued_execs_stops_at_the_client_cap(
    controller: dict[str, Any], tmp_path: Path
) -> None:
    pid = controller["pid"]
    agent = await start_agent(controller, tmp_path / "agent")
    try:
        async with tangram.AsyncClient(controller["submit_addr"], name="stdin") as tg:
            sb = await tg.open_sandbox()
            await sb.exec("true", timeout=20)
            # the one core, until the test puts `go` (no timing: a loaded machine only waits longer)
            blocker = asyncio.ensure_future(sb.exec("while [ ! -e go ]; do sleep 0.05; done", timeout=60))
            await asyncio.sleep(0.3)
            base = rss_mib(pid)
            execs = [asyncio.ensure_future(sb.exec("wc -c", stdin=data(i), timeout=60)) for i in range(8)]
            await until(lambda: sum(t.done() for t in execs) >= 6, timeout=20, what="six refusals")
            await asyncio.sleep(0.2)  # a seventh answer would be a wrong one
            done = {t for t in execs if t.done()}
            grown = rss_mib(pid) - base
            refused = [t.exception() for t in done if t.exception() is not None]
            assert len(refused) == 6, refused  # two queued: 32 MiB of stdin held
            assert all(e.code is not None and e.code.value == "OVER_CAP" for e in refused), refused  # type: ignore[union-attr]
            assert grown < 96, f"controller RSS grew {grown:.0f} MiB for 32 MiB queued"
            await sb.put("go", b"")
            await blocker
            ran = [t for t in execs if t not in done]
            assert [(await t).stdout.strip() for t in ran] == [str(BLOB)] * 2
            assert (await sb.exec("wc -c", stdin=data(9), timeout=30)).stdout.strip() == str(BLOB)
            assert (await asyncio.to_thread(counters, controller))["held_bytes"] == 0
    finally:
        await agent.stop()


# ---------------------------------------------------------------- replies kept for resends


async def test_large_replies_kept_for_resends_share_a_budget(
    controller: dict[str, Any], tmp_path: Path
) -> None:
    """Each final reply is kept 5 minutes for a resend; large ones (a file read back) share half of
    `max_held_bytes` (24 MiB here), and older ones past it are kept as a short NODE_LOST instead."""
    pid = controller["pid"]
    agent = await start_agent(controller, tmp_path / "agent")
    try:
        async with tangram.AsyncClient(controller["submit_addr"], name="reader") as tg:
            sb = await tg.open_sandbox()
            await sb.exec(f"head -c {BLOB} /dev/zero > big.bin", timeout=20)
            assert len(await sb.get("big.bin", timeout=20)) == BLOB
            base = rss_mib(pid)
            for _ in range(8):  # 8 x 16 MiB read back, each a distinct buffer from the agent
                assert len(await sb.get("big.bin", timeout=20)) == BLOB
            grown = rss_mib(pid) - base
            assert grown < 64, f"controller RSS grew {grown:.0f} MiB for 24 MiB of kept replies"
            assert (await asyncio.to_thread(counters, controller))["finals_not_kept"] >= 6
    finally:
        await agent.stop()


# ---------------------------------------------------------------- oversized messages


async def test_an_oversized_request_is_refused_by_the_library_and_a_raw_one_is_counted(
    controller: dict[str, Any],
) -> None:
    pid = controller["pid"]
    async with tangram.AsyncClient(controller["submit_addr"], name="big") as tg:
        sb = await tg.open_sandbox()
        await sb.put("small", b"ok")
        base = rss_mib(pid)
        with pytest.raises(BadRequest) as info:  # MessageTooLarge: never sent
            await sb.put("huge", b"\0" * (p.MAX_MESSAGE_BYTES + 1))
        assert type(info.value).__name__ == "MessageTooLarge"
        assert "64 MiB" in info.value.message and "MAX_MESSAGE_BYTES" in info.value.message
        before = await asyncio.to_thread(counters, controller)
        # a peer that sends one anyway (not through the library): libzmq drops its connection
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(controller["submit_addr"])
        try:
            await raw.send_multipart(p.encode(p.Hello("client", "raw", 1, p.BATCH_MINOR - 1), 1))
            welcome = p.decode(await asyncio.wait_for(raw.recv_multipart(), 10))
            token = bytes.fromhex(getattr(welcome.msg, "session", ""))
            frames = (
                p.encode(p.Put(sb.id, "huge"), 2, [b"x"], token=token)
                if token
                else p.encode(p.Put(sb.id, "huge"), 2, [b"x"])
            )
            await raw.send_multipart([*frames[:4], b"\0" * (p.MAX_MESSAGE_BYTES + MIB)])
            deadline = time.monotonic() + 10
            while (await asyncio.to_thread(counters, controller)).get("client_drops", 0) <= before.get(
                "client_drops", 0
            ):
                assert time.monotonic() < deadline, "the dropped connection was not counted"
                await asyncio.sleep(0.1)
        finally:
            with contextlib.suppress(Exception):
                raw.close(0)
            ctx.term()
        assert rss_mib(pid) - base < 40  # libzmq refused it by its size header, before allocating
        assert (await sb.get("small", timeout=10)) == b"ok"  # everyone else is served
        assert (await asyncio.to_thread(counters, controller))["client_disconnects"] >= 1
