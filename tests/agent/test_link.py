"""The agent link against a test "controller" (a real ROUTER on 127.0.0.1, random port).

In-process tests run ``agent.link.Agent`` with the process executor on the event loop of the test;
the end-to-end tests run ``python -m agent`` as a real subprocess. Every receive has a timeout.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from support import waiting

from agent.config import AgentConfig
from agent.executors.base import parse_cpuset
from agent.executors.process import ProcessExecutor
from agent.link import EXIT_OK, EXIT_REJECTED, Agent, build_facts, build_gpu_host
from agent.probe import probe
from tangram import protocol as p

RECV_S = 5.0
HB = 0.2


def two_cpus() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable cpus")
    return cpus[:2]


class FakeController:
    """The controller's agents ROUTER, driven by the test."""

    def __init__(self, port: int = 0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.port = port
        self.bind()
        self.rid = 100
        self.waiting: collections.deque[tuple[bytes, p.Envelope]] = collections.deque()
        self.batches_in = 0

    def bind(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        for _ in range(50):
            try:
                sock.bind(f"tcp://127.0.0.1:{self.port}")
                break
            except zmq.ZMQError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"cannot bind port {self.port}")
        self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def rebind(self) -> None:
        self.close()
        self.bind()

    @property
    def addr(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def recv_raw(self, timeout: float = RECV_S) -> list[bytes]:
        assert self.sock is not None
        if not await self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"nothing from the agent within {timeout} s")
        return list(await self.sock.recv_multipart())

    async def recv(self, timeout: float = RECV_S, skip_heartbeats: bool = True) -> tuple[bytes, p.Envelope]:
        end = time.monotonic() + timeout
        while True:
            if not self.waiting:  # the agent batches its replies (it was welcomed with minor >= 5)
                frames = await self.recv_raw(max(0.01, end - time.monotonic()))
                self.batches_in += p.is_batch(frames[1:])
                self.waiting.extend((frames[0], e) for e in p.decode_all(frames[1:]) if isinstance(e, p.Envelope))
                continue
            ident, env = self.waiting.popleft()
            if skip_heartbeats and isinstance(env.msg, p.Heartbeat):
                continue
            return ident, env

    async def expect(self, cls: type, timeout: float = RECV_S) -> tuple[bytes, p.Envelope]:
        ident, env = await self.recv(timeout)
        assert isinstance(env.msg, cls), f"expected {cls.__name__}, got {env.msg!r}"
        return ident, env

    async def send(self, ident: bytes, msg: p.Message, rid: int = 0, blobs: tuple[bytes, ...] = ()) -> None:
        assert self.sock is not None
        await self.sock.send_multipart([ident, *p.encode(msg, rid, list(blobs))])

    async def handshake(self, heartbeat_s: float = 1.0, epoch: int = 7, agent_epoch: int = 1,
                        timeout: float = RECV_S, minor: int = p.PROTOCOL_MINOR) -> tuple[bytes, p.Hello]:
        ident, env = await self.expect(p.Hello, timeout)
        await self.send(ident, p.Welcome(p.PROTOCOL_MAJOR, minor, epoch, agent_epoch, heartbeat_s))
        return ident, env.msg  # type: ignore[return-value]

    async def request(self, ident: bytes, msg: p.Message, blobs: tuple[bytes, ...] = (),
                      timeout: float = RECV_S) -> p.Envelope:
        self.rid += 1
        rid = self.rid
        await self.send(ident, msg, rid, blobs)
        _, env = await self.recv(timeout)
        assert env.request_id == rid, f"reply to {env.request_id}, expected {rid}: {env.msg!r}"
        return env

    async def heartbeats(self, ident: bytes, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(zmq.ZMQError):
                await self.send(ident, p.Heartbeat())
            await asyncio.sleep(HB / 2)

    def destroy(self) -> None:
        self.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
async def ctl():
    c = FakeController()
    yield c
    c.destroy()


def make_cfg(ctl: FakeController, tmp_path, **kw: Any) -> AgentConfig:
    cpus = two_cpus()
    values: dict[str, Any] = dict(controller=ctl.addr, name=f"n-{uuid.uuid4().hex[:6]}", executor="process",
                                  cpus=cpus, idle_cpus=cpus[:1], workdir=str(tmp_path / "agent"),
                                  heartbeat_s=HB, hello_timeout_s=2.0, backoff_min_s=0.05, backoff_max_s=0.2,
                                  stop_grace_s=0.5)
    values.update(kw)
    return AgentConfig.from_dict(values)


class Running:
    """An in-process agent and its task."""

    def __init__(self, agent: Agent, task: asyncio.Task[int]) -> None:
        self.agent, self.task = agent, task

    async def stopped(self, timeout: float = RECV_S) -> int:
        return await asyncio.wait_for(self.task, timeout)


@pytest.fixture
async def start(tmp_path):
    started: list[Running] = []

    async def go(cfg: AgentConfig) -> Running:
        machine = probe(check_docker=False, check_gpus=False)
        cpus, idle = cfg.resolve_cpus(machine.online)
        ex = ProcessExecutor(os.path.join(cfg.workdir, "sandboxes"), ",".join(map(str, idle)))
        gpu_host, gpus = build_gpu_host(cfg, machine) if cfg.emulated_gpus else (None, [])
        facts = build_facts(cfg, machine, cpus, idle, "process", gpus)
        agent = Agent(cfg, ex, facts=facts, gpu_host=gpu_host, cpus=cpus)
        run = Running(agent, asyncio.create_task(agent.run()))
        started.append(run)
        return run

    yield go
    for run in started:
        run.agent.stop("test over")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run.task, 10)
        await run.agent.close()


async def welcomed(ctl: FakeController, start, tmp_path, heartbeat_s: float = 1.0, minor: int = p.PROTOCOL_MINOR,
                   **kw: Any) -> tuple[Running, bytes, p.Hello]:
    run = await start(make_cfg(ctl, tmp_path, **kw))
    ident, hello = await ctl.handshake(heartbeat_s=heartbeat_s, minor=minor)
    return run, ident, hello


async def sandbox(ctl: FakeController, ident: bytes, name: str = "sb1") -> None:
    env = await ctl.request(ident, p.CreateSandbox(name, "", 64))
    assert isinstance(env.msg, p.Result), env.msg


def spawn(action: str, cmd: str, cores: list[int], timeout_s: float = 10.0, sandbox: str = "sb1",
          **kw: Any) -> p.Spawn:
    return p.Spawn(action, sandbox, cmd, cores, len(cores), {}, timeout_s, **kw)


async def until(cond, timeout: float = RECV_S) -> None:
    await waiting.until(cond, timeout)


def cpus_seen(stdout: bytes) -> tuple[int, ...]:
    for line in stdout.decode().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpuset(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list in {stdout!r}")


# ---------------------------------------------------------------- handshake and liveness


async def test_hello_carries_the_contract_facts(ctl, start, tmp_path):
    run, ident, hello = await welcomed(ctl, start, tmp_path)
    cpus = two_cpus()
    assert ident == run.agent.cfg.name.encode()
    assert (hello.role, hello.name, hello.major) == ("agent", run.agent.cfg.name, p.PROTOCOL_MAJOR)
    f = hello.facts
    assert f["cpus"] == cpus and f["idle_cpus"] == cpus[:1]
    assert all(set(n) <= set(cpus) for n in f["numa"]) and sorted(c for n in f["numa"] for c in n) == cpus
    assert f["mem_mib"] > 0 and f["gpus"] == 0 and f["gpu_uuids"] == [] and f["gpu_mem_mib"] == 0
    assert f["executor"] == "process" and isinstance(f["docker"], bool)
    assert f["cgroup"] in ("v1", "v2", "none") and f["pid"] == os.getpid() and f["version"]
    assert f["hostname"]
    assert hello.sandboxes == []


async def test_heartbeats_both_ways(ctl, start, tmp_path):
    run, ident, _ = await welcomed(ctl, start, tmp_path, heartbeat_s=HB)
    stop = asyncio.Event()
    beat = asyncio.create_task(ctl.heartbeats(ident, stop))
    try:
        got = 0
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            _, env = await ctl.recv(timeout=1.0, skip_heartbeats=False)
            assert isinstance(env.msg, p.Heartbeat), env.msg  # nothing else: no re-Hello while we beat
            assert env.request_id == 0 and "running" in env.msg.load
            got += 1
        assert got >= 4  # every 0.2 s for 1.5 s
        assert run.agent.sessions == 1
    finally:
        stop.set()
        await beat


async def test_silent_controller_gets_a_new_hello(ctl, start, tmp_path):
    run, ident, _ = await welcomed(ctl, start, tmp_path, heartbeat_s=HB)
    t0 = time.monotonic()
    _, env = await ctl.expect(p.Hello, timeout=3.0)  # no heartbeats from us: lost after 3 x 0.2 s
    assert time.monotonic() - t0 >= 2 * HB
    assert run.agent.sessions == 1


async def test_reconnect_after_controller_rebinds_the_same_port(ctl, start, tmp_path):
    run, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    port = ctl.port
    ctl.rebind()
    assert ctl.port == port
    ident2, hello = await ctl.handshake(epoch=8, agent_epoch=2, timeout=5.0)
    assert ident2 == ident and hello.sandboxes == ["sb1"]  # the sandbox survived and is reported
    env = await ctl.request(ident2, spawn("after", "echo again", [two_cpus()[1]], epoch=8, agent_epoch=2))
    assert env.msg.body["exit_code"] == 0 and env.blobs[0] == b"again\n"
    assert env.msg.body["epoch"] == 8 and env.msg.body["agent_epoch"] == 2
    assert run.agent.sessions == 2


async def test_fatal_reject_exits_3(ctl, start, tmp_path):
    run = await start(make_cfg(ctl, tmp_path))
    ident, _ = await ctl.expect(p.Hello)
    await ctl.send(ident, p.Reject("agent speaks 1, controller 2: run tangram up"))
    assert await run.stopped() == EXIT_REJECTED


async def test_retryable_reject_says_hello_again(ctl, start, tmp_path):
    run = await start(make_cfg(ctl, tmp_path))
    ident, _ = await ctl.expect(p.Hello)
    await ctl.send(ident, p.Reject("duplicate live name"))
    await ctl.handshake()
    await until(lambda: run.agent.sessions == 1)
    assert not run.task.done()


async def test_no_welcome_means_hello_again(ctl, start, tmp_path):
    await start(make_cfg(ctl, tmp_path, hello_timeout_s=0.3))
    await ctl.expect(p.Hello)
    await ctl.expect(p.Hello, timeout=3.0)


# ---------------------------------------------------------------- requests


async def test_spawn_reports_exit_code_output_and_cores(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    core = two_cpus()[1]
    cmd = "grep Cpus_allowed_list /proc/self/status; echo dop=$TANGRAM_DOP/{dop}; echo oops >&2; exit 3"
    env = await ctl.request(ident, spawn("a1", cmd, [core], attempt=2, epoch=7, agent_epoch=1))
    assert isinstance(env.msg, p.Result), env.msg
    body = env.msg.body
    assert body["exit_code"] == 3 and body["cores"] == [core]
    assert not body["truncated"] and not body["timed_out"] and not body["killed"]
    assert body["run_s"] >= 0 and body["setup_s"] >= 0
    assert (body["action"], body["attempt"], body["epoch"], body["agent_epoch"]) == ("a1", 2, 7, 1)
    stdout, stderr = env.blobs
    assert cpus_seen(stdout) == (core,)
    assert b"dop=1/1" in stdout and stderr == b"oops\n"


async def test_spawn_both_cores_and_stdin_and_files(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    cpus = two_cpus()
    env = await ctl.request(ident, p.PutFile("sb1", "dir/in.txt"), blobs=(b"hello file",))
    assert isinstance(env.msg, p.Result)
    cmd = "grep Cpus_allowed_list /proc/self/status; cat dir/in.txt; cat > out.txt; echo {dop}"
    env = await ctl.request(ident, spawn("a2", cmd, cpus), blobs=(b"from stdin",))
    assert env.msg.body["exit_code"] == 0, env.blobs
    assert cpus_seen(env.blobs[0]) == tuple(cpus) and b"hello file2\n" in env.blobs[0]
    env = await ctl.request(ident, p.GetFile("sb1", "out.txt"))
    assert env.msg.body == {"size": 10} and env.blobs == (b"from stdin",)


async def test_kill_answers_ack_then_killed_result(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    await ctl.send(ident, spawn("slow", "sleep 30", [two_cpus()[1]]), rid=500)
    await asyncio.sleep(0.3)
    await ctl.send(ident, p.Kill("slow"), rid=501)
    replies = {}
    for _ in range(2):
        _, env = await ctl.recv()
        replies[env.request_id] = env
    assert isinstance(replies[501].msg, p.Ack)
    body = replies[500].msg.body
    assert body["killed"] and body["exit_code"] == 137 and not body["timed_out"]
    env = await ctl.request(ident, p.Kill("not-running"))  # nothing to kill: still answered
    assert isinstance(env.msg, p.Ack)


async def test_a_batch_of_requests_is_answered_in_one_batch(ctl, start, tmp_path):
    """Protocol 1.5: the replies of one loop iteration go back as one BATCH, each exactly once;
    a bad item is answered alone and the others stand."""
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    kills = [p.encode(p.Kill(f"not-running-{i}"), 600 + i) for i in range(8)]
    bad = p.encode_trusted(p.Kill("x", attempt=-1), 700)  # a negative attempt: only a trusted encoder writes it
    (message,) = p.pack([*kills, bad])
    await ctl.sock.send_multipart([ident, *message])
    got: dict[int, list[p.Message]] = {}
    while len(got) < 9:
        _, env = await ctl.recv()
        got.setdefault(env.request_id, []).append(env.msg)
    assert sorted(got) == [*range(600, 608), 700] and all(len(v) == 1 for v in got.values())
    assert all(isinstance(got[600 + i][0], p.Ack) for i in range(8))
    assert isinstance(got[700][0], p.Error) and got[700][0].code == "BAD_REQUEST"
    assert ctl.batches_in >= 1


async def test_kill_right_behind_its_spawn_still_kills(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    t0 = time.monotonic()
    await ctl.send(ident, spawn("racy", "sleep 30", [two_cpus()[1]]), rid=510)
    await ctl.send(ident, p.Kill("racy", attempt=1), rid=511)
    got = {}
    for _ in range(2):
        _, env = await ctl.recv()
        got[env.request_id] = env.msg
    assert isinstance(got[511], p.Ack) and got[510].body["killed"] and time.monotonic() - t0 < 5


async def test_timeout_kills_and_flags(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    t0 = time.monotonic()
    env = await ctl.request(ident, spawn("t", "sleep 30", [two_cpus()[1]], timeout_s=0.5))
    assert env.msg.body["timed_out"] and env.msg.body["exit_code"] == 137
    assert time.monotonic() - t0 < 5


async def test_errors_are_typed_and_the_agent_keeps_serving(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    # garbage body with a readable request id
    await ctl.sock.send_multipart([ident, p.TAG, bytes([p.Spawn.TYPE]), (42).to_bytes(8, "big"), b"\xc1junk"])
    _, env = await ctl.recv()
    assert env.request_id == 42 and isinstance(env.msg, p.Error) and env.msg.code == "BAD_REQUEST"
    # schema error: a map missing required fields
    body = msgpack.packb({"action": "x"})
    await ctl.sock.send_multipart([ident, p.TAG, bytes([p.Spawn.TYPE]), (43).to_bytes(8, "big"), body])
    _, env = await ctl.recv()
    assert env.request_id == 43 and env.msg.code == "BAD_REQUEST"
    # too few frames, no request id to read: answered with id 0
    await ctl.sock.send_multipart([ident, b"hello?"])
    _, env = await ctl.recv()
    assert env.request_id == 0 and env.msg.code == "BAD_REQUEST"
    # a client message is not an agent request
    env = await ctl.request(ident, p.SandboxClose("sb1"))
    assert env.msg.code == "BAD_REQUEST"
    # unknown sandbox, cores not handed out, path escape, bad sandbox name
    env = await ctl.request(ident, spawn("a", "true", [two_cpus()[1]], sandbox="nope"))
    assert env.msg.code == "SANDBOX_LOST", env.msg
    await sandbox(ctl, ident)
    env = await ctl.request(ident, spawn("a", "true", [4000]))
    assert env.msg.code == "BAD_REQUEST" and "hands out" in env.msg.message
    env = await ctl.request(ident, p.GetFile("sb1", "/etc/passwd"))
    assert env.msg.code == "BAD_REQUEST"
    env = await ctl.request(ident, p.CreateSandbox("Upper:Case", "", 64))
    assert env.msg.code == "BAD_REQUEST"
    env = await ctl.request(ident, spawn("a", "true", [two_cpus()[1]], epoch=6))
    assert env.msg.code == "BAD_REQUEST" and "stale" in env.msg.message
    env = await ctl.request(ident, p.Load("svc", [0]))
    assert env.msg.code == "BAD_REQUEST" and "no GPUs" in env.msg.message
    # and still serving
    env = await ctl.request(ident, spawn("ok", "echo fine", [two_cpus()[1]]))
    assert env.msg.body["exit_code"] == 0 and env.blobs[0] == b"fine\n"
    env = await ctl.request(ident, p.DestroySandbox("sb1"))
    assert isinstance(env.msg, p.Result)
    env = await ctl.request(ident, p.DestroySandbox("sb1"))  # idempotent
    assert isinstance(env.msg, p.Result)


async def test_resent_spawn_joins_the_running_attempt(ctl, start, tmp_path):
    _, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    marker = tmp_path / "agent" / "sandboxes" / "sb1" / "count"
    msg = spawn("once", "echo x >> count; sleep 0.5", [two_cpus()[1]])
    await ctl.send(ident, msg, rid=600)
    await asyncio.sleep(0.1)
    await ctl.send(ident, msg, rid=601)
    got = {}
    for _ in range(2):
        _, env = await ctl.recv()
        got[env.request_id] = env.msg
    assert got[600] == got[601] and got[600].body["exit_code"] == 0
    assert marker.read_text() == "x\n"  # ran once


async def test_orphan_timer_kills_running_actions_and_result_is_delivered_later(ctl, start, tmp_path):
    run, ident, _ = await welcomed(ctl, start, tmp_path, heartbeat_s=HB, orphan_timeout_s=0.6,
                                   backoff_min_s=0.5,
                                   backoff_max_s=1.0, hello_timeout_s=0.5)
    await sandbox(ctl, ident)
    await ctl.send(ident, spawn("orphan", "sleep 30", [two_cpus()[1]]), rid=700)
    await until(lambda: "orphan" in run.agent._running)
    ctl.close()  # cut off: no heartbeats, no route
    await asyncio.sleep(1.5)
    assert not run.agent._running, "orphan timer did not kill the action"
    ctl.bind()
    while True:  # answer every Hello (a reconnect may race the bind) until the buffered result arrives
        ident2, env = await ctl.recv()
        if not isinstance(env.msg, p.Hello):
            break
        await ctl.send(ident2, p.Welcome(p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, 7, 2, HB))
    assert env.request_id == 700 and env.msg.body["killed"]


async def test_shutdown_in_process_destroys_sandboxes_when_down(ctl, start, tmp_path):
    run, ident, _ = await welcomed(ctl, start, tmp_path)
    await sandbox(ctl, ident)
    await ctl.send(ident, spawn("long", "sleep 30", [two_cpus()[1]]), rid=800)
    await asyncio.sleep(0.2)
    await ctl.send(ident, p.Shutdown("down"), rid=801)
    got = {}
    for _ in range(2):
        _, env = await ctl.recv()
        got[env.request_id] = env.msg
    assert isinstance(got[801], p.Bye)
    assert isinstance(got[800], p.Error) and got[800].code == "NODE_LOST"
    assert await run.stopped() == EXIT_OK
    assert not (tmp_path / "agent" / "sandboxes" / "sb1").exists()


# ---------------------------------------------------------------- GPU services (emulated)


async def test_gpu_prepare_load_invoke_evict(ctl, start, tmp_path):
    pytest.importorskip("agent.gpu.host", reason="the GPU host is not in this tree yet")
    _, ident, hello = await welcomed(ctl, start, tmp_path, emulated_gpus=2, gpu_mem_mib=4096)
    f = hello.facts
    assert f["gpus"] == 2 and f["gpu_mem_mib"] == 4096 and len(f["gpu_uuids"]) == 2
    spec = {"runtime": "emulated", "model": "agent.gpu.demo_services:reward", "gpu_mem_mib": 1024}
    env = await ctl.request(ident, p.Prepare("rm", spec))
    assert isinstance(env.msg, p.Result), env.msg
    env = await ctl.request(ident, p.Load("rm", [0, 1]))
    assert env.msg.body["bytes"] > 0 and env.msg.body["seconds"] >= 0 and env.msg.body["restored"]
    payload = msgpack.packb({"response": "a b c", "reference": "a b c"})
    env = await ctl.request(ident, p.Invoke("call1", "rm", [0, 1], 10.0, epoch=7), blobs=(payload,))
    assert isinstance(env.msg, p.Result), env.msg
    assert env.msg.body["run_s"] >= 0 and env.msg.body["action"] == "call1"
    assert msgpack.unpackb(env.blobs[0])["score"] == 1.0
    env = await ctl.request(ident, p.Evict("rm", [0, 1]))
    assert isinstance(env.msg, p.Result)
    env = await ctl.request(ident, p.Load("rm", [0, 2]))
    assert env.msg.code == "BAD_REQUEST"  # not consecutive
    env = await ctl.request(ident, p.Invoke("call2", "nope", [0], 1.0), blobs=(payload,))
    assert env.msg.code == "BAD_REQUEST"  # never prepared
    env = await ctl.request(ident, p.Invoke("call3", "rm", [0], 1.0), blobs=(b"\xc1",))
    assert env.msg.code == "BAD_REQUEST"  # payload not msgpack
    env = await ctl.request(ident, p.Prepare("bad", {"runtime": "emulated"}))
    assert env.msg.code == "BAD_REQUEST"


async def test_gpu_service_error_is_remote_error_with_traceback(ctl, start, tmp_path):
    pytest.importorskip("agent.gpu.host", reason="the GPU host is not in this tree yet")
    _, ident, _ = await welcomed(ctl, start, tmp_path, emulated_gpus=1, gpu_mem_mib=2048)
    spec = {"runtime": "emulated", "model": "json:loads", "gpu_mem_mib": 10}  # raises on a dict payload
    assert isinstance((await ctl.request(ident, p.Prepare("bad-fn", spec))).msg, p.Result)
    env = await ctl.request(ident, p.Invoke("c", "bad-fn", [0], 5.0), blobs=(msgpack.packb({"x": 1}),))
    assert env.msg.code == "REMOTE_ERROR" and "Traceback" in env.msg.detail


async def test_configured_services_are_prepared_at_start(ctl, start, tmp_path):
    pytest.importorskip("agent.gpu.host", reason="the GPU host is not in this tree yet")
    svc = {"name": "rm", "runtime": "emulated", "model": "agent.gpu.demo_services:reward", "gpu_mem_mib": 64}
    _, ident, hello = await welcomed(ctl, start, tmp_path, emulated_gpus=1, gpu_mem_mib=1024, services=[svc])
    assert hello.facts["services"] == ["rm"]
    payload = msgpack.packb({"response": "a", "reference": "a"})
    env = await ctl.request(ident, p.Invoke("c", "rm", [0], 5.0), blobs=(payload,))  # no Prepare needed
    assert msgpack.unpackb(env.blobs[0])["score"] == 1.0


# ---------------------------------------------------------------- the real process


def agent_proc(ctl: FakeController, tmp_path, *extra: str) -> subprocess.Popen[bytes]:
    cpus = two_cpus()
    argv = [sys.executable, "-m", "agent", "--controller", ctl.addr, "--name", "e2e", "--executor", "process",
            "--cpus", f"{cpus[0]},{cpus[1]}", "--idle-cpus", str(cpus[0]), "--workdir", str(tmp_path / "wd"),
            "--log-file", str(tmp_path / "wd" / "agent.log"), "--heartbeat", str(HB), *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    end = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < end, "agent did not exit"
        await asyncio.sleep(0.05)
    return proc.returncode


async def test_e2e_process_spawn_then_shutdown(ctl, tmp_path):
    proc = agent_proc(ctl, tmp_path)
    try:
        ident, hello = await ctl.handshake(timeout=15)
        assert hello.facts["pid"] == proc.pid and hello.facts["executor"] == "process"
        pidfile = tmp_path / "wd" / "agent.pid"
        assert pidfile.read_text().strip() == str(proc.pid)
        await sandbox(ctl, ident, "e2e-sb")
        core = two_cpus()[1]
        env = await ctl.request(ident, spawn("e1", "grep Cpus_allowed_list /proc/self/status", [core],
                                             sandbox="e2e-sb"))
        assert env.msg.body["exit_code"] == 0 and cpus_seen(env.blobs[0]) == (core,)
        await ctl.send(ident, p.Shutdown("upgrade"), rid=900)
        _, env = await ctl.expect(p.Bye)
        assert env.request_id == 900
        assert await wait_exit(proc) == 0
        assert not pidfile.exists()
        assert (tmp_path / "wd" / "sandboxes" / "e2e-sb").is_dir()  # left running: not "down"
        log = (tmp_path / "wd" / "agent.log").read_text()
        assert "welcomed by" in log and "shutdown requested" in log
    finally:
        stop_proc(proc)


async def test_e2e_sigterm_says_bye_and_exits_cleanly(ctl, tmp_path):
    proc = agent_proc(ctl, tmp_path)
    try:
        ident, _ = await ctl.handshake(timeout=15)
        await sandbox(ctl, ident, "keep")
        proc.send_signal(signal.SIGTERM)
        _, env = await ctl.expect(p.Bye)
        assert env.request_id == 0
        assert await wait_exit(proc) == 0
        assert not (tmp_path / "wd" / "agent.pid").exists()
        assert (tmp_path / "wd" / "sandboxes" / "keep").is_dir()
    finally:
        stop_proc(proc)


async def test_e2e_reject_exits_nonzero(ctl, tmp_path):
    proc = agent_proc(ctl, tmp_path)
    try:
        ident, _ = await ctl.expect(p.Hello, timeout=15)
        await ctl.send(ident, p.Reject("bad facts: no cpus"))
        assert await wait_exit(proc) == EXIT_REJECTED
        assert "rejected by the controller: bad facts" in (tmp_path / "wd" / "agent.log").read_text()
    finally:
        stop_proc(proc)


async def test_e2e_reconnects_after_controller_restart(ctl, tmp_path):
    proc = agent_proc(ctl, tmp_path)
    try:
        ident, _ = await ctl.handshake(timeout=15)
        # a Heartbeat proves the Welcome arrived (closing with linger 0 could drop it, and then the
        # agent would be retrying its Hello instead of noticing a lost controller)
        _, env = await ctl.recv(timeout=10, skip_heartbeats=False)
        assert isinstance(env.msg, p.Heartbeat)
        ctl.rebind()
        ident2, hello = await ctl.handshake(timeout=20)  # ~3 heartbeats of silence, then a new Hello
        assert ident2 == ident == b"e2e" and hello.facts["pid"] == proc.pid
        await sandbox(ctl, ident2, "after")
    finally:
        stop_proc(proc)


async def test_e2e_tangram_agent_with_emulated_gpus(ctl, tmp_path):
    pytest.importorskip("agent.gpu.host", reason="the GPU host is not in this tree yet")
    cpus = two_cpus()
    argv = [sys.executable, "-c", "from tangram_cli.main import cli; cli()",
            "agent", "--controller", ctl.addr,
            "--name", "gpu-e2e", "--executor", "process", "--cpus", str(cpus[1]), "--idle-cpus", str(cpus[0]),
            "--emulated-gpus", "2", "--gpu-memory", "16GiB", "--workdir", str(tmp_path / "wd")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ident, hello = await ctl.handshake(timeout=15)
        f = hello.facts
        assert (f["gpus"], f["gpu_mem_mib"], f["cpus"], f["idle_cpus"]) == (2, 16384, [cpus[1]], [cpus[0]])
        assert f["gpu_uuids"] == ["EMU-gpu-e2e-0", "EMU-gpu-e2e-1"]
        spec = {"runtime": "emulated", "model": "agent.gpu.demo_services:reward", "gpu_mem_mib": 12288}
        assert isinstance((await ctl.request(ident, p.Prepare("rm", spec))).msg, p.Result)
        payload = msgpack.packb({"response": "x"})
        env = await ctl.request(ident, p.Invoke("c1", "rm", [1], 10.0), blobs=(payload,))
        assert isinstance(env.msg, p.Result), env.msg
        assert 0 <= msgpack.unpackb(env.blobs[0])["score"] <= 1
        env = await ctl.request(ident, p.Load("rm", [0, 1]))
        assert env.msg.code == "RETRY_LATER"  # GPU 1 already holds 12 of its 16 GiB: evict first
        assert isinstance((await ctl.request(ident, p.Evict("rm", [1]))).msg, p.Result)
        env = await ctl.request(ident, p.Load("rm", [0, 1]))
        assert env.msg.body["restored"] and env.msg.body["bytes"] == 12288 << 20
        proc.send_signal(signal.SIGTERM)
        _, env = await ctl.expect(p.Bye)
        assert await wait_exit(proc) == 0
    finally:
        stop_proc(proc)


def test_e2e_bad_config_exits_2(tmp_path):
    cfg = tmp_path / "agent.json"
    cfg.write_text('{"controller": "tcp://127.0.0.1:1", "cpus": "3-1"}')
    argv = [sys.executable, "-m", "agent", "--config", str(cfg)]
    res = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    assert res.returncode == 2 and b"cpus" in res.stderr


def spawners_of(agent_pid: int, script: bytes) -> list[int]:
    """The pids of the agent's spawner processes whose command line names ``script`` (contained process
    sandboxes: one per sandbox, perhaps also a spare; Docker fast path: one per container)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if ppid == agent_pid and script in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out
