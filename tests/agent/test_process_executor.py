"""ProcessExecutor: runs everywhere (no Docker)."""
from __future__ import annotations

import asyncio
import os
import time
import tracemalloc
import uuid

import pytest

from agent.executors.base import Executor, PathRejected, RunRequest, SandboxSpec, parse_cpuset
from agent.executors.process import ProcessExecutor

CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture
async def ex(tmp_path):
    e = ProcessExecutor(str(tmp_path / "sandboxes"), ",".join(map(str, CPUS)))
    await e.create_sandbox(SandboxSpec("s1", "", 64))
    yield e
    await e.close()


def req(cmd, cores=(CPUS[0],), action=None, **kw):
    return RunRequest(action or f"a-{uuid.uuid4().hex[:8]}", "s1", cmd, cores, **kw)


def test_is_an_executor(tmp_path):
    assert isinstance(ProcessExecutor(str(tmp_path), "0"), Executor)


async def test_runs_on_granted_cores(ex):
    for cores in [(c,) for c in CPUS] + [tuple(CPUS)]:
        r = await ex.run(req("grep Cpus_allowed_list /proc/self/status", cores))
        assert parse_cpuset(r.stdout.decode().split(":")[1]) == cores


async def test_concurrent_disjoint_cores(ex):
    if len(CPUS) < 2:
        pytest.skip("needs two cpus")
    cmd = "grep Cpus_allowed_list /proc/self/status; sleep 0.5; grep Cpus_allowed_list /proc/self/status"
    r1, r2 = await asyncio.gather(ex.run(req(cmd, (CPUS[0],))), ex.run(req(cmd, (CPUS[1],))))
    assert {line.split()[-1] for line in r1.stdout.decode().splitlines()} == {str(CPUS[0])}
    assert {line.split()[-1] for line in r2.stdout.decode().splitlines()} == {str(CPUS[1])}


async def test_dop_env_cwd_exit(ex, tmp_path):
    r = await ex.run(req('echo {dop} $TANGRAM_DOP; pwd; exit 4', dop=3))
    assert r.exit_code == 4
    assert r.stdout.decode().split() == ["3", "3", str(tmp_path / "sandboxes" / "s1")]


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in the group after a short settle? Orphans may stay zombies."""
    for _ in range(50):
        if not _group_members(pgid):
            return False
        time.sleep(0.02)
    return True


def _group_members(pgid: int) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


async def test_timeout_kills_tree(ex):
    t0 = time.monotonic()
    r = await ex.run(req("echo $$ > pid; sleep 100 & sleep 100", timeout_s=0.5))
    assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 5
    pgid = int((await ex.get("s1", "pid")).decode())
    assert not _group_alive(pgid)


async def test_leftovers_die_with_the_action(ex):
    t0 = time.monotonic()
    r = await ex.run(req("echo $$ > pid; sleep 100 & echo done"))
    assert r.stdout == b"done\n" and not r.timed_out and time.monotonic() - t0 < 5
    assert not _group_alive(int((await ex.get("s1", "pid")).decode()))


async def test_kill(ex):
    task = asyncio.ensure_future(ex.run(req("sleep 100", action="victim")))
    await asyncio.sleep(0.3)
    assert await ex.kill("victim")
    r = await asyncio.wait_for(task, 5)
    assert r.killed and r.exit_code == 137
    assert not await ex.kill("victim")


async def test_output_flood_capped(ex):
    tracemalloc.start()
    try:
        r = await ex.run(req("yes | head -c 52428800", output_cap=1 << 20, timeout_s=40))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.truncated and len(r.stdout) == 1 << 20 and r.exit_code == 0
    assert peak < 12 << 20


async def test_stdin(ex):
    r = await ex.run(req("wc -c", stdin=b"z" * 200_000))
    assert r.stdout.strip() == b"200000"


async def test_put_get_and_escapes(ex, tmp_path):
    await ex.put("s1", "a/b.txt", b"data")
    assert await ex.get("s1", "a/b.txt") == b"data"
    secret = tmp_path / "secret"
    secret.write_text("no")
    os.symlink(secret, tmp_path / "sandboxes" / "s1" / "leak")
    os.symlink(tmp_path, tmp_path / "sandboxes" / "s1" / "up")
    for bad in ["../secret", "/etc/passwd", "leak", "up/secret"]:
        with pytest.raises(PathRejected):
            await ex.get("s1", bad)
    with pytest.raises(PathRejected):
        await ex.put("s1", "up/evil", b"x")
    assert not (tmp_path / "evil").exists()
    with pytest.raises(Exception, match="larger"):
        await ex.get("s1", "a/b.txt", max_bytes=2)


async def test_destroy_idempotent_and_list(ex):
    await ex.create_sandbox(SandboxSpec("s2", "", 64))
    assert await ex.list_sandboxes() == ["s1", "s2"]
    await ex.destroy_sandbox("s2")
    await ex.destroy_sandbox("s2")
    assert await ex.list_sandboxes() == ["s1"]


async def test_rejects_cores_outside_affinity(ex):
    with pytest.raises(ValueError, match="outside"):
        await ex.run(req("true", (max(CPUS) + 64,)))
