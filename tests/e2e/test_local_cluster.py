"""End to end on one machine: client library -> controller -> real agent (process executor)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

import tangram
from tangram import protocol as p
from tangram.errors import ActionTimeout, NoCapacity

from .conftest import cpus_for_test, start_agent, stop_process

CPU_FLAGS = ("--executor", "process", "--cpus", cpus_for_test())
TWO_CORES = cpus_for_test() == "0-1"
ALLOWED = "grep Cpus_allowed_list /proc/self/status | cut -f2"


def parse_cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


async def test_exec_output_and_pinned_cores(cluster) -> None:
    c = await cluster(*CPU_FLAGS)
    async with tangram.AsyncClient(c.submit_addr, name="e2e") as tg, tg.sandbox() as env:
        await env.put("hello.py", b"print('hi from', __name__)")
        r = await env.exec(f"python3 hello.py; {ALLOWED}", cpus=1, timeout=30)
        assert r.exit_code == 0 and r.stdout.splitlines()[0] == "hi from __main__"
        assert parse_cpulist(r.stdout.splitlines()[1]) == set(r.cores) and r.node == "n1"
        assert 0 < r.run_s < 10 and r.overhead_s < 5
        r = await env.exec("echo data > out.bin")
        assert await env.get("out.bin") == b"data\n"
        r = await env.exec("exit 7")
        assert r.exit_code == 7


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores")
async def test_elastic_dop_and_disjoint_cores(cluster) -> None:
    c = await cluster(*CPU_FLAGS)
    async with tangram.AsyncClient(c.submit_addr) as tg:
        async with tg.sandbox() as env:
            r = await env.exec(
                f"echo {{dop}} $TANGRAM_DOP; {ALLOWED}", cpus=(1, 2), elastic="linear", duration_hint=1.0
            )
            lines = r.stdout.split("\n")
            assert lines[0] == "2 2" and parse_cpulist(lines[1]) == {0, 1} == set(r.cores)
        envs = [await tg.open_sandbox() for _ in range(2)]
        results = await asyncio.gather(*(e.exec(f"{ALLOWED}; sleep 0.5", cpus=1) for e in envs))
        seen = [parse_cpulist(r.stdout) for r in results]
        assert seen[0] == set(results[0].cores) and seen[1] == set(results[1].cores)
        assert not seen[0] & seen[1]  # ran together, on different cores
        for e in envs:
            await e.close()


async def test_timeout_kills_and_the_cores_return(cluster) -> None:
    c = await cluster(*CPU_FLAGS)
    n = len(cpus_for_test().split("-"))
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        t0 = time.monotonic()
        with pytest.raises(ActionTimeout):
            await env.exec("sleep 60", cpus=n, timeout=1)
        assert time.monotonic() - t0 < 8
        r = await env.exec("echo next", cpus=n, timeout=20)
        assert r.stdout == "next\n"
        with pytest.raises(NoCapacity):
            await env.exec("true", cpus=99)


async def test_resent_request_runs_once(cluster) -> None:
    import secrets

    import zmq
    import zmq.asyncio

    c = await cluster(*CPU_FLAGS)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(c.submit_addr)

    async def final(rid: int) -> p.Envelope:
        while True:
            env = p.decode(await asyncio.wait_for(sock.recv_multipart(), 20))
            if env.request_id == rid and isinstance(env.msg, (p.Result, p.Error)):
                return env

    try:
        await sock.send_multipart(p.encode(p.Hello("client", "raw", p.PROTOCOL_MAJOR, p.BATCH_MINOR - 1), 8))
        while not isinstance((welcome := p.decode(await sock.recv_multipart())).msg, p.Welcome):
            pass
        token = bytes.fromhex(welcome.msg.session)  # every request of the session carries it
        await sock.send_multipart(p.encode(p.SandboxOpen(), 1, token=token))
        sandbox = (await final(1)).msg.body["sandbox"]
        msg = p.Exec(sandbox, "echo run >> marker; sleep 0.3; wc -l < marker", 1, 1)
        for _ in range(3):  # the same request id three times while it runs
            await sock.send_multipart(p.encode(msg, 9, token=token))
        first = await final(9)
        await sock.send_multipart(p.encode(msg, 9, token=token))  # and once after it finished
        again = await final(9)
        assert first.blobs[0].strip() == b"1" and again.blobs == first.blobs
        await sock.send_multipart(p.encode(p.Exec(sandbox, "wc -l < marker", 1, 1), 10, token=token))
        assert (await final(10)).blobs[0].strip() == b"1"
        await sock.send_multipart(p.encode(p.SandboxClose(sandbox), 11, token=token))
        await final(11)
    finally:
        sock.close(0)
        ctx.term()


async def test_gpu_call_with_emulated_gpus(cluster) -> None:
    c = await cluster(*CPU_FLAGS, "--emulated-gpus", "2", "--gpu-memory", "4GiB")
    async with tangram.AsyncClient(c.submit_addr) as tg:
        r1 = await tg.call("reward", {"response": "the cat sat", "reference": "the cat"}, gpus=1, timeout=30)
        assert 0 < r1.value["score"] <= 1 and r1.loaded and r1.node == "n1"
        r2 = await tg.call("reward", {"response": "the cat sat", "reference": "the cat"}, gpus=1, timeout=30)
        assert r2.value == r1.value and not r2.loaded


def test_controller_cli_process_and_journal(controller_process, tmp_path) -> None:
    info = controller_process
    agent = start_agent(info["agents_addr"], str(tmp_path), *CPU_FLAGS)
    try:
        with tangram.Client(info["submit_addr"], connect_timeout=10) as tg:
            deadline = time.monotonic() + 20
            while True:
                try:
                    with tg.sandbox() as env:
                        r = env.exec("echo via-cli", timeout=20)
                    break
                except NoCapacity:  # the agent has not registered yet
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            assert r.stdout == "via-cli\n"
    finally:
        stop_process(agent)
    proc = info["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    with open(info["journal"], encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    assert records[0]["journal"] == "tangram"
    kinds = {r["event"]["type"] for r in records[1:]}
    assert {
        "ServiceDefined",
        "ApiDefined",
        "NodeJoined",
        "SandboxOpened",
        "ActionSubmitted",
        "ActionFinished",
    } <= kinds
    assert any(c["type"] == "Spawn" for r in records[1:] for c in r["commands"])
    assert not os.path.exists(tmp_path / "ready.json")
    _ = p
