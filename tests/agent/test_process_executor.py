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


@pytest.fixture(params=["spawner", "agent"])
async def ex(tmp_path, request):
    """Both ways to start an action: through the spawner, and from the agent itself (its fallback).
    Contained sandboxes where this host can contain them (root, cgroups), else trusted code only."""
    cpus = ",".join(map(str, CPUS))
    e = ProcessExecutor(str(tmp_path / "sandboxes"), cpus, spawner=request.param == "spawner",
                        trusted_code_only=True)
    await e.create_sandbox(SandboxSpec("s1", "", 64))
    yield e
    await e.close()
    for name in await e.list_sandboxes():
        await e.destroy_sandbox(name)
    if request.param == "spawner":
        assert e._spawner_failures == 0, "the spawner did not start"
        assert all(sb.failures == 0 for sb in e._sandboxes.values()), "a sandbox's spawner did not start"


def spawner_pid(e: ProcessExecutor, sandbox: str = "s1") -> int:
    """The spawner that starts the sandbox's actions (its own when contained, else the agent's)."""
    sp = e._sandboxes[sandbox].spawner if e.contained else e._spawner
    assert sp is not None
    return sp.pid


def req(cmd, cores=(CPUS[0],), action=None, **kw):
    return RunRequest(action or f"a-{uuid.uuid4().hex[:8]}", "s1", cmd, cores, **kw)


def test_is_an_executor(tmp_path):
    ex = ProcessExecutor(str(tmp_path), "0", cgroups=False, trusted_code_only=True)  # (never closed)
    assert isinstance(ex, Executor) and not ex.contained


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
    assert r.stdout.decode().split() == ["3", "3", os.path.join(ex.root, "s1")]
    assert os.path.realpath(tmp_path / "sandboxes" / "s1") == os.path.join(ex.root, "s1")  # (maybe a link)


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


# ---------------------------------------------------------------- the spawn primitive (agent.executors.spawn)

NESTED = ("grep Cpus_allowed_list /proc/self/status; "
          "sh -c 'grep Cpus_allowed_list /proc/self/status; (grep Cpus_allowed_list /proc/self/status)'; "
          "(sleep 0.05; grep Cpus_allowed_list /proc/self/status) & wait")


async def test_children_and_grandchildren_are_pinned(ex):
    for cores in [(c,) for c in CPUS]:
        r = await ex.run(req(NESTED, cores))
        seen = [parse_cpuset(line.split(":")[1]) for line in r.stdout.decode().splitlines()]
        assert seen == [cores] * 4, r


async def test_the_spawning_thread_gets_its_affinity_back(ex):
    before = os.sched_getaffinity(0)
    await asyncio.gather(*(ex.run(req("true", (c,))) for c in CPUS))
    assert os.sched_getaffinity(0) == before


async def test_no_thread_per_child(ex):
    import threading

    before = threading.active_count()
    task = asyncio.gather(*(ex.run(req("sleep 0.3")) for _ in range(4)))
    await asyncio.sleep(0.15)
    assert threading.active_count() == before
    assert [r.exit_code for r in await task] == [0] * 4


async def test_without_pidfds_a_thread_waits(ex, monkeypatch):
    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    r = await ex.run(req("echo hi; exit 3"))
    assert (r.exit_code, r.stdout) == (3, b"hi\n")
    r = await ex.run(req("sleep 100 & sleep 100", timeout_s=0.3))
    assert r.timed_out and r.exit_code == 137


async def test_kill_takes_the_grandchildren(ex):
    task = asyncio.ensure_future(ex.run(req("echo $$ > pid; sh -c 'sleep 100 & sleep 100' & sleep 100",
                                            action="tree")))
    await asyncio.sleep(0.3)
    pgid = int((await ex.get("s1", "pid")).decode())
    assert _group_members(pgid)
    assert await ex.kill("tree")
    r = await asyncio.wait_for(task, 5)
    assert r.killed and r.exit_code == 137
    assert not _group_alive(pgid)


async def test_stdin_not_read_and_both_streams_capped(ex):
    r = await ex.run(req("true", stdin=b"x" * (1 << 20)))  # EPIPE on the agent side is not an error
    assert r.exit_code == 0
    r = await ex.run(req("head -c 5000 /dev/zero; head -c 7000 /dev/zero >&2", output_cap=1000))
    assert r.truncated and len(r.stdout) == len(r.stderr) == 1000


async def test_signal_exit_and_missing_sandbox(ex):
    r = await ex.run(req("kill -TERM $$"))
    assert r.exit_code == 128 + 15 and not r.killed
    with pytest.raises(Exception, match="no sandbox"):
        await ex.run(RunRequest("a-x", "nope", "true", (CPUS[0],)))
    assert not ex._actions


def _status_field(text: str, key: str) -> int:
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith(key + ":")), 16)


@pytest.fixture(params=["libc", "popen"])
def spawn_path(request, monkeypatch):
    """How the agent spawns (the spawner itself, or actions without it): libc posix_spawn, or Popen."""
    from agent.executors import spawn

    if request.param == "popen":
        monkeypatch.setattr(spawn, "_libc", None)
    return request.param


async def test_child_starts_clean(ex, spawn_path):
    """A session leader, SIGPIPE at its default, nothing blocked, no descriptor of ours inherited."""
    r = await ex.run(req("cut -d' ' -f1,6 /proc/$$/stat; cat /proc/self/status; echo $(ls /proc/self/fd)"))
    lines = r.stdout.decode().splitlines()
    pid, sid = lines[0].split()
    assert pid == sid
    status = "\n".join(lines[1:])
    assert not _status_field(status, "SigIgn") & (1 << (13 - 1))  # SIGPIPE
    assert _status_field(status, "SigBlk") == 0
    assert sorted(int(x) for x in lines[-1].split()) == [0, 1, 2, 3], lines[-1]  # 3: ls's own


async def test_spawn_paths_behave_alike(ex, spawn_path, tmp_path):
    r = await ex.run(req("pwd; echo $TANGRAM_DOP; grep Cpus_allowed_list /proc/self/status; exit 5",
                         (CPUS[-1],), dop=2))
    lines = r.stdout.decode().splitlines()
    assert r.exit_code == 5 and lines[:2] == [os.path.join(ex.root, "s1"), "2"]
    assert parse_cpuset(lines[2].split(":")[1]) == (CPUS[-1],)
    from agent.executors.spawn import spawn_pinned

    with pytest.raises(OSError):
        spawn_pinned(["/nonexistent/sh"], env={}, cwd=str(tmp_path), cores=None, fds=(0, 1, 2))
    with pytest.raises(OSError):
        spawn_pinned(["/bin/sh", "-c", "true"], env={}, cwd=str(tmp_path / "gone"), cores=(CPUS[0],),
                     fds=(0, 1, 2))
    assert os.sched_getaffinity(0) == set(CPUS)


async def test_spawner_death_is_survived(tmp_path):
    import signal

    from agent.executors.base import ExecutorError

    e = ProcessExecutor(str(tmp_path / "sandboxes"), ",".join(map(str, CPUS)), trusted_code_only=True)
    await e.create_sandbox(SandboxSpec("s1", "", 64))
    try:
        await e.run(req("true"))
        first = spawner_pid(e)
        task = asyncio.ensure_future(e.run(req("echo $$ > pid; sleep 100")))
        await asyncio.sleep(0.3)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(ExecutorError, match="spawner"):
            await asyncio.wait_for(task, 5)
        r = await e.run(req("echo again"))  # a new spawner
        assert r.stdout == b"again\n" and spawner_pid(e) != first
    finally:
        await e.close()
        await e.destroy_sandbox("s1")


async def test_closing_the_executor_ends_spawner_and_actions(tmp_path):
    e = ProcessExecutor(str(tmp_path / "sandboxes"), ",".join(map(str, CPUS)), trusted_code_only=True)
    await e.create_sandbox(SandboxSpec("s1", "", 64))
    task = asyncio.ensure_future(e.run(req("echo $$ > pid; sleep 100", action="long")))
    await asyncio.sleep(0.3)
    spawner, pgid = spawner_pid(e), int((await e.get("s1", "pid")).decode())
    await e.close()
    r = await asyncio.wait_for(task, 5)
    await e.destroy_sandbox("s1")
    assert r.killed and not _group_alive(pgid)
    with pytest.raises(ProcessLookupError):
        os.kill(spawner, 0)  # gone, and reaped


async def test_quick_actions_keep_all_their_output(ex):
    """Most of the output of a short action is still in the pipe when its exit is reported."""
    for i in range(30):
        stdin = b"x" if i % 3 else None
        r = await ex.run(req(f"echo out{i}; echo err{i} >&2", (CPUS[i % len(CPUS)],), stdin=stdin))
        assert (r.exit_code, r.stdout, r.stderr) == (0, f"out{i}\n".encode(), f"err{i}\n".encode())


async def test_spawner_reports_a_missing_program_as_a_shell_would(tmp_path):
    from agent.executors.spawn import ChildIO
    from agent.executors.spawner import Spawner, plain_config

    sp = await Spawner.start(plain_config())
    try:
        io = ChildIO(1000, None)
        job = sp.spawn(["/nonexistent/prog"], {}, io.child_fds, cwd=str(tmp_path), cores=[CPUS[0]])
        io.start()
        assert await asyncio.wait_for(job.exit, 5) == 127
        await io.wait_eof(5)
        assert b"/nonexistent/prog" in io.err.value()
        io.close()
        io = ChildIO(1000, None)
        job = sp.spawn(["/bin/true"], {}, io.child_fds, cwd=str(tmp_path / "gone"), cores=[CPUS[0]])
        io.start()
        with pytest.raises(Exception, match="could not start"):
            await asyncio.wait_for(job.exit, 5)
        io.close()
        assert sp.alive
    finally:
        await sp.close()


async def test_spawner_ignores_slot_keys_it_cannot_use(tmp_path):
    """``slot`` keys that are not strings, or that it never kept, change nothing: the spawner serves on."""
    import json

    from agent.executors.spawn import ChildIO
    from agent.executors.spawner import Spawner, plain_config

    sp = await Spawner.start(plain_config())
    try:
        for junk in ({"op": "forget", "slot": [1]}, {"op": "forget", "slot": {"a": 1}},
                     {"op": "forget", "slot": "never-kept"}):
            sp._send(json.dumps(junk).encode(), ())
        io = ChildIO(1000, None)
        job = sp.spawn(["/bin/sh", "-c", "echo ran"], {}, io.child_fds, slot=["not", "a", "key"],  # type: ignore[arg-type]
                       cwd=str(tmp_path), cores=[CPUS[0]])
        io.start()
        assert await asyncio.wait_for(job.exit, 5) == 0
        await io.wait_eof(5)
        assert io.out.value() == b"ran\n"
        io.close()
        assert sp.alive and not sp._kept  # only stdio went: nothing is kept for it
    finally:
        await sp.close()
