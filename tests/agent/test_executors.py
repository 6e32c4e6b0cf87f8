"""DockerExecutor against a real dockerd, on both exec paths (fastpath = nsenter + cgroup writes; docker exec)."""
from __future__ import annotations

import asyncio
import os
import time
import tracemalloc
import uuid

import pytest

from agent.executors import fastpath
from agent.executors.base import PathRejected, RunRequest, SandboxSpec, parse_cpuset
from agent.executors.docker import DockerExecutor

pytestmark = pytest.mark.docker

NOBODY = "65534:65534"
MODES = ["fastpath", "nsenter", "docker"]  # nsenter: the fast path without a spawner (its fallback)


def _need_two_cpus():
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs cpus 0 and 1")


def _need_root():
    if os.geteuid() != 0:
        pytest.skip("the fast path needs root")


@pytest.fixture(params=MODES)
def mode(request):
    if request.param in ("fastpath", "nsenter"):
        _need_root()
    return request.param


def make_executor(docker_client, image, mode, idle="0-1", cluster=None):
    """``mode`` as in MODES: nsenter is mode=fastpath with the spawner switched off."""
    return DockerExecutor(docker_client, cluster or f"t{uuid.uuid4().hex[:8]}", idle, image,
                          mode="fastpath" if mode == "nsenter" else mode, spawner=mode != "nsenter")


@pytest.fixture
async def executor(docker_client, busybox_image, mode):
    _need_two_cpus()
    ex = make_executor(docker_client, busybox_image, mode)
    made: list[str] = []
    orig = ex.create_sandbox

    async def create(spec):
        made.append(spec.sandbox)
        await orig(spec)

    ex.create_sandbox = create  # type: ignore[method-assign]
    yield ex
    await ex.close()
    for name in made:
        await ex.destroy_sandbox(name)


@pytest.fixture
def spec(busybox_image, test_labels):
    def make(name="s1", mem_mib=64, user=NOBODY, image=busybox_image, pids_limit=128):
        return SandboxSpec(name, image, mem_mib, dict(test_labels), pids_limit=pids_limit, user=user)

    return make


def req(cmd, cores=(0,), action=None, sandbox="s1", **kw):
    return RunRequest(action or f"a-{uuid.uuid4().hex[:8]}", sandbox, cmd, cores, **kw)


def cpus_seen(stdout: bytes) -> tuple[int, ...]:
    for line in stdout.decode().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpuset(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list in {stdout!r}")


def container_of(ex, docker_client, name="s1"):
    return docker_client.containers.get(f"tangram-{ex.cluster}-{name}")


def cgroup_cpus(container) -> tuple[int, ...]:
    container.reload()
    cg = fastpath.discover(container.attrs["State"]["Pid"])
    assert cg is not None
    return parse_cpuset(fastpath.read_cpuset(cg.cpuset))


async def test_cpuset_is_exactly_the_grant_then_idle(executor, spec, docker_client):
    await executor.create_sandbox(spec())
    container = container_of(executor, docker_client)
    for cores in [(0,), (1,), (0, 1)]:
        r = await executor.run(req("grep Cpus_allowed_list /proc/self/status", cores))
        assert r.exit_code == 0, r
        assert cpus_seen(r.stdout) == cores
        assert r.cores == cores
        assert cgroup_cpus(container) == (0, 1)  # back on the idle set
        idle = await asyncio.to_thread(container.exec_run, ["grep", "Cpus_allowed_list", "/proc/self/status"])
        assert cpus_seen(idle.output) == (0, 1)


async def test_idle_set_is_restored_when_narrower(docker_client, busybox_image, spec, mode):
    _need_two_cpus()
    ex = make_executor(docker_client, busybox_image, mode, idle="1")
    await ex.create_sandbox(spec())
    try:
        container = container_of(ex, docker_client)
        assert cgroup_cpus(container) == (1,)
        r = await ex.run(req("grep Cpus_allowed_list /proc/self/status", (0,)))
        assert cpus_seen(r.stdout) == (0,)
        assert cgroup_cpus(container) == (1,)
    finally:
        await ex.destroy_sandbox("s1")


async def test_concurrent_disjoint_actions_never_share_a_core(executor, spec, docker_client):
    await executor.create_sandbox(spec("s1"))
    await executor.create_sandbox(spec("s2"))
    c1, c2 = container_of(executor, docker_client, "s1"), container_of(executor, docker_client, "s2")
    cmd = "grep Cpus_allowed_list /proc/self/status; sleep 1.5; grep Cpus_allowed_list /proc/self/status"
    t0 = time.monotonic()
    runs = asyncio.gather(executor.run(req(cmd, (0,), sandbox="s1")), executor.run(req(cmd, (1,), sandbox="s2")))
    task = asyncio.ensure_future(runs)
    await asyncio.sleep(0.7)
    during = (cgroup_cpus(c1), cgroup_cpus(c2))
    r1, r2 = await task
    assert time.monotonic() - t0 < 3.0  # they really overlapped
    assert during == ((0,), (1,))
    out1 = [line for line in r1.stdout.decode().splitlines() if line.startswith("Cpus")]
    out2 = [line for line in r2.stdout.decode().splitlines() if line.startswith("Cpus")]
    assert out1 == ["Cpus_allowed_list:\t0"] * 2
    assert out2 == ["Cpus_allowed_list:\t1"] * 2


@pytest.mark.parametrize("fast", ["fastpath", "nsenter"])
async def test_same_sandbox_concurrent_fastpath_gets_own_cores(docker_client, busybox_image, spec, fast):
    _need_root()
    _need_two_cpus()
    ex = make_executor(docker_client, busybox_image, fast)
    await ex.create_sandbox(spec())
    try:
        cmd = "sleep 0.5; grep Cpus_allowed_list /proc/self/status"
        r1, r2 = await asyncio.gather(ex.run(req(cmd, (0,))), ex.run(req(cmd, (1,))))
        assert (cpus_seen(r1.stdout), cpus_seen(r2.stdout)) == ((0,), (1,))
    finally:
        await ex.destroy_sandbox("s1")


async def test_dop_expansion_and_env(executor, spec):
    await executor.create_sandbox(spec())
    r = await executor.run(req('echo "{dop} $TANGRAM_DOP $X"', (0, 1), dop=2, env={"X": "y"}))
    assert r.stdout == b"2 2 y\n"


async def test_nonzero_exit_and_stderr(executor, spec):
    await executor.create_sandbox(spec())
    r = await executor.run(req("echo oops >&2; exit 3"))
    assert (r.exit_code, r.stderr, r.timed_out, r.killed) == (3, b"oops\n", False, False)


async def test_stdin(executor, spec):
    await executor.create_sandbox(spec())
    r = await executor.run(req("wc -c", stdin=b"x" * 100_000))
    assert r.stdout.strip() == b"100000"


def _host_sleepers(cid: str, arg: bytes) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                if cid not in f.read():
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", arg]:
                    found.append(int(pid))
        except OSError:
            continue
    return found


async def test_timeout_kills_the_whole_tree(executor, spec, docker_client):
    await executor.create_sandbox(spec())
    container = container_of(executor, docker_client)
    t0 = time.monotonic()
    r = await executor.run(req("sleep 100 & sleep 100", timeout_s=1.0))
    assert r.timed_out and r.exit_code == 137 and not r.killed
    assert time.monotonic() - t0 < 8
    await asyncio.sleep(0.2)
    ps = await asyncio.to_thread(container.exec_run, ["ps"])
    assert b"sleep 100" not in ps.output, ps.output
    if os.geteuid() == 0:
        assert _host_sleepers(container.id, b"100") == []
    r = await executor.run(req("echo alive"))  # the sandbox survives
    assert r.stdout == b"alive\n"


@pytest.mark.parametrize("fast", ["fastpath", "nsenter"])
async def test_timeout_kills_setsid_daemons_on_fastpath(docker_client, busybox_image, spec, fast):
    _need_root()
    ex = make_executor(docker_client, busybox_image, fast)
    await ex.create_sandbox(spec())
    try:
        container = container_of(ex, docker_client)
        r = await ex.run(req("setsid sleep 101 & trap '' TERM; sleep 102", timeout_s=0.5))
        assert r.timed_out
        assert _host_sleepers(container.id, b"101") == _host_sleepers(container.id, b"102") == []
        r = await ex.run(req("setsid sleep 103 & echo done"))  # leftovers die with a normal end too
        assert r.stdout == b"done\n" and _host_sleepers(container.id, b"103") == []
    finally:
        await ex.destroy_sandbox("s1")


async def test_kill_action(executor, spec):
    await executor.create_sandbox(spec())
    task = asyncio.ensure_future(executor.run(req("sleep 100", action="victim", timeout_s=30)))
    await asyncio.sleep(0.5)
    assert await executor.kill("victim")
    r = await asyncio.wait_for(task, 10)
    assert r.killed and r.exit_code == 137 and not r.timed_out
    assert not await executor.kill("victim")


async def test_output_flood_is_capped(executor, spec):
    await executor.create_sandbox(spec())
    tracemalloc.start()
    try:
        r = await executor.run(req("yes | head -c 52428800", output_cap=1 << 20, timeout_s=40))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.exit_code == 0
    assert r.truncated and len(r.stdout) == 1 << 20 and r.stdout[:4] == b"y\ny\n"
    assert peak < 12 << 20, f"agent buffered {peak} bytes"


async def test_oom_gives_137(executor, spec):
    await executor.create_sandbox(spec(mem_mib=64))
    r = await executor.run(req("dd if=/dev/zero of=/dev/null bs=200M count=1", timeout_s=30))
    assert r.exit_code == 137, r
    assert not r.timed_out


async def test_network_is_only_loopback(executor, spec):
    await executor.create_sandbox(spec())
    r = await executor.run(req("cat /proc/net/dev"))
    names = {line.split(":")[0].strip() for line in r.stdout.decode().splitlines()[2:]}
    assert names == {"lo"}


async def test_hardening_seen_inside(executor, spec):
    await executor.create_sandbox(spec())
    r = await executor.run(req("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; id -u"))
    assert r.stdout.decode().split() == ["CapEff:", "0000000000000000", "NoNewPrivs:", "1", "65534"]


async def test_hostroot_python_as_root_drops_privileges(executor, spec, hostroot_image):
    await executor.create_sandbox(spec(image=hostroot_image, user=None, mem_mib=256))
    r = await executor.run(req(
        "python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status",
        (1,), timeout_s=30))
    assert r.exit_code == 0, r
    assert r.stdout.decode().split() == ["[1]", "CapEff:", "0000000000000000", "NoNewPrivs:", "1"]


async def test_put_get_round_trip_and_escapes(executor, spec):
    await executor.create_sandbox(spec())
    await executor.put("s1", "dir/sub/a.bin", bytes(range(256)) * 10)
    assert await executor.get("s1", "/work/dir/sub/a.bin") == bytes(range(256)) * 10
    r = await executor.run(req("cat dir/sub/a.bin | wc -c; ln -s /etc/passwd leak; ln -s /etc linkdir"))
    assert r.stdout.split()[0] == b"2560"
    for bad in ["../etc/passwd", "/etc/passwd", "dir/../../x"]:
        with pytest.raises(PathRejected):
            await executor.get("s1", bad)
        with pytest.raises(PathRejected):
            await executor.put("s1", bad, b"x")
    for link in ["leak", "linkdir/passwd"]:
        with pytest.raises(PathRejected):
            await executor.get("s1", link)
    with pytest.raises(PathRejected):
        await executor.put("s1", "linkdir/evil", b"x")
    with pytest.raises(Exception, match="larger"):
        await executor.get("s1", "dir/sub/a.bin", max_bytes=100)


async def test_destroy_is_idempotent_and_list_finds_labelled(executor, spec):
    await executor.create_sandbox(spec("s1"))
    await executor.create_sandbox(spec("s2"))
    assert await executor.list_sandboxes() == ["s1", "s2"]
    await executor.destroy_sandbox("s1")
    await executor.destroy_sandbox("s1")
    await executor.destroy_sandbox("never")
    assert await executor.list_sandboxes() == ["s2"]


async def test_adopts_existing_sandbox_after_restart(executor, spec, docker_client, busybox_image):
    await executor.create_sandbox(spec())
    fresh = DockerExecutor(docker_client, executor.cluster, "0-1", busybox_image, mode=executor.mode,
                           spawner=executor.use_spawner)
    assert await fresh.list_sandboxes() == ["s1"]
    r = await fresh.run(req("grep Cpus_allowed_list /proc/self/status; id -u", (1,)))
    assert cpus_seen(r.stdout) == (1,) and r.stdout.split()[-1] == b"65534"


async def test_quick_actions_keep_all_their_output(executor, spec):
    """Most of the output of a short action is still in the pipe when its exit is reported."""
    await executor.create_sandbox(spec())
    for i in range(15):
        r = await executor.run(req(f"echo out{i}; echo err{i} >&2", (i % 2,), stdin=b"x" if i % 3 else None))
        assert (r.exit_code, r.stdout, r.stderr) == (0, f"out{i}\n".encode(), f"err{i}\n".encode())
