"""The Docker fast path's per-sandbox spawner (agent/executors/nsspawner.py) against a real dockerd."""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
from test_executors import NOBODY, _host_sleepers, cpus_seen, req

from agent.executors.base import ExecutorError, SandboxSpec
from agent.executors.docker import DockerExecutor

pytestmark = pytest.mark.docker


@pytest.fixture
async def ex(docker_client, busybox_image):
    if os.geteuid() != 0:
        pytest.skip("the fast path needs root")
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs cpus 0 and 1")
    e = DockerExecutor(docker_client, f"t{uuid.uuid4().hex[:8]}", "0-1", busybox_image, mode="auto")
    yield e
    await e.close()
    for name in await e.list_sandboxes():
        await e.destroy_sandbox(name)


async def make(ex, busybox_image, test_labels, user=NOBODY, name="s1"):
    await ex.create_sandbox(SandboxSpec(name, busybox_image, 64, dict(test_labels), pids_limit=64, user=user))
    sb = ex._sandboxes[name]
    assert sb.spawner is not None and sb.spawner.alive, "the spawner did not start"
    return sb


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def gone(pid: int, within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_root_in_a_plain_image_runs_without_any_capability(ex, busybox_image, test_labels):
    # busybox has no util-linux setpriv, so nsenter could not drop the bounding set: the spawner does
    # (root only when asked for: a sandbox without a user runs as the agent's sandbox_user)
    await make(ex, busybox_image, test_labels, user="0:0")
    r = await ex.run(req("grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Cpus_allowed_list)' "
                         "/proc/self/status; id -u", (1,)))
    fields = dict(line.split(":", 1) for line in r.stdout.decode().splitlines() if ":" in line)
    assert {k: v.strip() for k, v in fields.items() if k.startswith("Cap")} == dict.fromkeys(
        ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"], "0000000000000000")
    assert fields["NoNewPrivs"].strip() == "1" and cpus_seen(r.stdout) == (1,)
    assert r.stdout.split()[-1] == b"0"


async def test_sandbox_code_cannot_take_other_cores(ex, busybox_image, test_labels):
    await make(ex, busybox_image, test_labels, user=None)
    cmd = ("taskset -p 3 $$ >/dev/null 2>&1; sh -c 'grep Cpus_allowed_list /proc/self/status'; "
           "echo 0-1 > /sys/fs/cgroup/cpuset/cpuset.cpus 2>/dev/null && echo WROTE; "
           "echo 0-1 > /sys/fs/cgroup/cpuset.cpus 2>/dev/null && echo WROTE; true")
    r = await ex.run(req(cmd, (0,)))
    assert cpus_seen(r.stdout) == (0,) and b"WROTE" not in r.stdout, r.stdout


async def test_the_spawner_is_invisible_inside(ex, busybox_image, test_labels):
    sb = await make(ex, busybox_image, test_labels)
    r = await ex.run(req("cat /proc/[0-9]*/cmdline | tr '\\\\0' ' '; echo; echo $PPID"))
    assert b"nsspawner" not in r.stdout and b"python" not in r.stdout
    assert r.stdout.split()[-1] == b"0"  # the action's parent is outside the sandbox's pid namespace
    with open(f"/proc/{sb.spawner.pid}/cgroup") as f:  # but it sits in the container's cgroups
        assert all(sb.cid in line for line in f.read().splitlines() if line.split(":")[1])
    with open(f"/proc/{sb.spawner.pid}/status") as f:  # with nothing sandbox code does not have
        status = dict(line.split(":", 1) for line in f.read().splitlines())
    assert status["Uid"].split()[:2] == ["65534", "65534"] and status["NoNewPrivs"].strip() == "1"
    assert {status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {"0" * 16}


async def test_the_sandbox_survives_a_dead_spawner(ex, busybox_image, test_labels):
    sb = await make(ex, busybox_image, test_labels)
    first = sb.spawner.pid
    task = asyncio.ensure_future(ex.run(req("echo $$ > pid; sleep 100", timeout_s=30)))
    await asyncio.sleep(0.5)
    os.kill(first, signal.SIGKILL)
    with pytest.raises(ExecutorError, match="spawner"):
        await asyncio.wait_for(task, 10)
    assert _host_sleepers(sb.cid, b"100") == []  # the orphaned action was killed with its cgroup
    r = await ex.run(req("echo again"))  # a new spawner serves the next action
    assert r.stdout == b"again\n" and sb.spawner.alive and sb.spawner.pid != first
    assert await gone(first)


async def test_destroy_and_external_stop_end_the_spawner(ex, busybox_image, test_labels, docker_client):
    sb1 = await make(ex, busybox_image, test_labels, name="s1")
    sb2 = await make(ex, busybox_image, test_labels, name="s2")
    pid1, pid2 = sb1.spawner.pid, sb2.spawner.pid
    memcg = next(d for d in sb1.cg.others if "/memory" in d)
    await ex.destroy_sandbox("s1")
    assert await gone(pid1) and not os.path.exists(memcg)  # nothing of ours kept the cgroup alive
    await asyncio.to_thread(docker_client.containers.get(f"tangram-{ex.cluster}-s2").kill)
    assert await gone(pid2)  # the container's init went away: so did its spawner


async def test_an_action_gets_only_its_stdio(ex, busybox_image, test_labels):
    await make(ex, busybox_image, test_labels)
    r = await ex.run(req("echo $(ls /proc/self/fd)", stdin=b"x"))
    assert r.stdout.split() == [b"0", b"1", b"2", b"3"], r  # 3: ls's own


async def test_slots_are_reused_and_left_empty(ex, busybox_image, test_labels):
    sb = await make(ex, busybox_image, test_labels)
    cmd = "sleep 0.3; grep Cpus_allowed_list /proc/self/status"
    for _ in range(2):
        r1, r2 = await asyncio.gather(ex.run(req(cmd, (0,))), ex.run(req(cmd, (1,))))
        assert (cpus_seen(r1.stdout), cpus_seen(r2.stdout)) == ((0,), (1,))
    slots = sorted(d for d in os.listdir(sb.cg.cpuset) if d.startswith("tangram-"))
    assert slots == ["tangram-slot-0", "tangram-slot-1"]
    for slot in slots:
        with open(os.path.join(sb.cg.cpuset, slot, "cpuset.cpus")) as f:
            assert f.read().strip() == ""  # a free slot never stands in the way of the container's cpuset
        with open(os.path.join(sb.cg.cpuset, slot, "cgroup.procs")) as f:
            assert f.read().strip() == ""


async def test_an_action_running_when_its_sandbox_is_destroyed_reads_as_killed(ex, busybox_image, test_labels):
    """The controller sends Kill and DestroySandbox when a sandbox closes; the destroy may come
    first and close the spawner before it reports the exit: a killed action, not an error."""
    sb = await make(ex, busybox_image, test_labels)
    task = asyncio.ensure_future(ex.run(req("sleep 100", timeout_s=30)))
    for _ in range(250):
        if sb.active:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    await ex.destroy_sandbox("s1")
    r = await asyncio.wait_for(task, 10)
    assert r.killed and r.exit_code == 137, r
    assert _host_sleepers(sb.cid, b"100") == []


async def test_a_slot_removed_and_made_again_gets_its_files_sent_again(ex, busybox_image, test_labels,
                                                                      monkeypatch):
    """The spawner keeps each slot's join file; a slot that could not be given back is removed, and its name
    comes back for the next new slot: that one's file is sent again, so the action lands in it, on its cores
    (a file kept for the removed cgroup would fail the spawn)."""
    from agent.executors import fastpath

    sb = await make(ex, busybox_image, test_labels)
    cmd = "grep Cpus_allowed_list /proc/self/status; cat /proc/self/cgroup"
    r = await ex.run(req(cmd, (0,)))
    assert cpus_seen(r.stdout) == (0,) and "tangram-slot-0" in r.stdout.decode()
    assert list(sb.spawner._kept) == [os.path.join(sb.cg.cpuset, "tangram-slot-0")]
    real = fastpath.SlotPool.give_back
    refused: list[str] = []

    def refuse_once(self, sub):
        if not refused:
            refused.append(sub)
            self.names.discard(os.path.basename(sub))  # as when its cpuset cannot be emptied
            return False
        return real(self, sub)

    monkeypatch.setattr(fastpath.SlotPool, "give_back", refuse_once)
    r = await ex.run(req(cmd, (1,)))
    assert r.exit_code == 0 and cpus_seen(r.stdout) == (1,)
    assert refused and not os.path.exists(refused[0])  # removed, and forgotten by the spawner
    assert list(sb.spawner._kept) == []
    r = await ex.run(req(cmd, (0,)))  # a new slot under the same name
    assert r.exit_code == 0, r
    assert cpus_seen(r.stdout) == (0,) and "tangram-slot-0" in r.stdout.decode()
    assert list(sb.spawner._kept) == [os.path.join(sb.cg.cpuset, "tangram-slot-0")]
