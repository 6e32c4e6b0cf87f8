"""Controller crash and restart in place: `tangram controller --state` killed with SIGKILL and
started again on the same ports, with a real agent (`python -m agent`, process executor) and
real clients. Counts, not timings: every request gets one final reply, nothing runs twice,
the sandbox survives with its files, and what ran when the controller died is stopped."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

import tangram
from tangram import protocol as p
from tangram.errors import NodeLost
from tangram_cli.state import query_status
from tests.e2e.conftest import start_agent, stop_process

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="real processes on Linux")


class Ctl:
    """`tangram controller` as a subprocess that can be killed and started again on its ports."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.config = tmp / "resolved.json"
        self.config.write_text(json.dumps({"cluster": "rec", "scheduler": {"client_grace_s": 30}}))
        self.ports = {"agents": 0, "submit": 0, "status": 0}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> dict[str, Any]:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-c",
            "from tangram_cli.main import cli; cli()",
            "controller",
            "--config",
            str(self.config),
            "--heartbeat",
            "0.5",
            "--state",
            str(self.tmp / "state.jsonl"),
            "--journal",
            str(self.tmp / "journal"),
            "--ready-file",
            str(ready),
        ]
        for name, port in self.ports.items():
            argv += [f"--{name}-port", str(port)]
        with open(self.tmp / "controller.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.proc.poll() is None, (self.tmp / "controller.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "controller not ready in 20 s"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.ports = {k: info[k] for k in self.ports}
        self.starts += 1
        return info

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def addr(self, name: str) -> str:
        return f"tcp://127.0.0.1:{self.ports[name]}"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@pytest.fixture
def ctl_and_agent(tmp_path: Path) -> Any:
    ctl = Ctl(tmp_path)
    ctl.start()
    work = tmp_path / "agent"
    work.mkdir()
    agent = start_agent(ctl.addr("agents"), str(work), "--executor", "process", "--cpus", "0")
    yield ctl, agent, work
    stop_process(agent)
    ctl.stop()


def _status(ctl: Ctl) -> dict[str, Any]:
    return query_status(ctl.addr("status"), timeout_s=5.0)


async def _registered(ctl: Ctl, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await asyncio.to_thread(_status, ctl)
        if st.get("cluster", {}).get("agents_up", 0) >= 1:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the agent did not register: {st.get('cluster')}")


def _sleepers(marker: str) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    n += 1
            except OSError:
                pass
    return n


async def test_controller_kill9_restart_keeps_sandbox_and_answers_each_request_once(
    ctl_and_agent: Any,
) -> None:
    ctl, _agent, _work = ctl_and_agent
    await _registered(ctl)
    marker = f"4{secrets.randbelow(10**6):06d}"  # a sleep length no one else uses: find its process
    async with tangram.AsyncClient(ctl.addr("submit")) as c:
        sb = await c.open_sandbox()
        await sb.exec("echo kept > f.txt")
        running = asyncio.ensure_future(sb.exec(f"sleep {marker}; echo ran >> ran.txt"))
        queued = asyncio.ensure_future(sb.exec("echo once >> queued.txt"))  # waits for the one core
        await asyncio.sleep(1.5)
        assert _sleepers(f"sleep {marker}") == 1 and not queued.done()
        ctl.kill9()
        ctl.start()
        with pytest.raises(NodeLost):
            await asyncio.wait_for(running, 30)
        await asyncio.wait_for(queued, 30)
        r = await sb.exec("cat f.txt; cat queued.txt; cat ran.txt 2>/dev/null; true")
        assert r.stdout.split() == ["kept", "once"]  # the sandbox survived; the queued exec ran once
        assert c._transport.restarts == 1
        deadline = time.monotonic() + 10
        while _sleepers(f"sleep {marker}") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert _sleepers(f"sleep {marker}") == 0  # stopped, not left running on a free core
        st = await asyncio.to_thread(_status, ctl)
        assert st["cluster"]["counters"]["adopted_sandboxes"] == 1


async def _raw(addr: str, ident: bytes) -> zmq.asyncio.Socket:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


async def _final(sock: zmq.asyncio.Socket, rid: int, kind: Any = (p.Result, p.Error)) -> p.Envelope:
    while True:
        env = p.decode(await asyncio.wait_for(sock.recv_multipart(), 20))
        if env.request_id == rid and isinstance(env.msg, kind):
            return env


async def test_a_resent_request_gets_its_recorded_reply_after_a_restart(ctl_and_agent: Any) -> None:
    ctl, _agent, _work = ctl_and_agent
    await _registered(ctl)
    ident = secrets.token_bytes(16)
    sock = await _raw(ctl.addr("submit"), ident)
    await sock.send_multipart(p.encode(p.Hello("client", "raw", p.PROTOCOL_MAJOR, p.BATCH_MINOR - 1), 9))
    token = bytes.fromhex((await _final(sock, 9, p.Welcome)).msg.session)  # type: ignore[union-attr]
    await sock.send_multipart(p.encode(p.SandboxOpen(), 1, token=token))
    sandbox = (await _final(sock, 1)).msg.body["sandbox"]  # type: ignore[union-attr]
    run = p.Exec(sandbox, "echo $$ >> runs.txt; cat runs.txt", 1, 1)
    await sock.send_multipart(p.encode(run, 2, token=token))
    first = await _final(sock, 2)
    assert isinstance(first.msg, p.Result)
    sock.close(0)
    ctl.kill9()
    ctl.start()
    # the same client identity and session token, as the library keeps them: the restarted
    # controller (same state file, so the same session key) knows the session
    sock = await _raw(ctl.addr("submit"), ident)
    await sock.send_multipart(p.encode(run, 2, token=token))
    again = await _final(sock, 2)
    assert again.msg == first.msg and again.blobs == first.blobs  # the recorded reply, not a second run
    await sock.send_multipart(p.encode(p.Exec(sandbox, "wc -l < runs.txt", 1, 1), 3, token=token))
    count = await _final(sock, 3)
    assert isinstance(count.msg, p.Result), count.msg
    assert count.blobs[0].strip() == b"1"  # ran once, in the adopted sandbox
    sock.close(0)
