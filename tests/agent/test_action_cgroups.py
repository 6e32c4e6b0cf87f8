"""Action cgroups of the process executor (``agent.executors.cgroups``): nothing an action starts outlives it,
and a restarted agent kills what its killed predecessor left running, before its Hello.

The pure pieces (hierarchy choice, names) run everywhere. The rest uses real processes and real cgroups, in
every hierarchy this machine has mounted and writable (v1 freezer, v1 pids, cgroup2; on a hybrid v1 machine
the cgroup2 mount at /sys/fs/cgroup/unified runs the v2 code, ``cgroup.kill`` included), and skips with the
reason where there is none (not root, nothing mounted).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_link import FakeController, sandbox, spawn, spawners_of, stop_proc, two_cpus

from agent.executors import cgroups as cg
from agent.executors.base import RunRequest, RunResult, SandboxSpec
from agent.executors.fastpath import CgroupMount, parse_mountinfo
from agent.executors.proc_contain import Containment, ContainmentUnavailable
from agent.executors.process import ProcessExecutor, joining_argv
from tangram import protocol as p

CPUS = sorted(os.sched_getaffinity(0))
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"


# ---------------------------------------------------------------- pure


def test_hierarchy_choice():
    mounts = parse_mountinfo(HYBRID)
    assert cg.pick_hierarchy(mounts) == cg.Hierarchy("/sys/fs/cgroup/freezer", v2=False, controller="freezer")
    no_freezer = [m for m in mounts if "freezer" not in m.controllers]
    assert cg.pick_hierarchy(no_freezer) == cg.Hierarchy("/sys/fs/cgroup/pids", v2=False, controller="pids")
    only_cpuset = [m for m in no_freezer if "pids" not in m.controllers]
    assert cg.pick_hierarchy(only_cpuset) == cg.Hierarchy("/sys/fs/cgroup/unified", v2=True)
    assert cg.pick_hierarchy(parse_mountinfo(UNIFIED)) == cg.Hierarchy("/sys/fs/cgroup", v2=True)
    two = [CgroupMount("/", "/mnt/other", frozenset()), CgroupMount("/", "/sys/fs/cgroup", frozenset())]
    assert cg.pick_hierarchy(two).path == "/sys/fs/cgroup"
    assert cg.pick_hierarchy([m for m in mounts if m.controllers == frozenset({"cpuset"})]) is None
    assert cg.pick_hierarchy([]) is None


def test_names():
    h = cg.Hierarchy("/sys/fs/cgroup", v2=True)
    assert cg.node_dir(h, "default", "cpu-01") == "/sys/fs/cgroup/tangram/default/cpu-01"
    for bad in ("", ".", "..", "a/b"):
        with pytest.raises(ValueError, match="cgroup name"):
            cg.node_dir(h, "default", bad)
    name = cg.incarnation_name(4242, 987654, 3)
    assert name == "agent-4242-987654-3" and cg.parse_incarnation(name) == (4242, 987654)
    for other in ("spawner", "a-x", "agent-1-2", "agent-x-1-0", "agent-1-2-3-4"):
        assert cg.parse_incarnation(other) is None
    assert cg.Hierarchy("/x", v2=False, controller="pids").label == "v1 pids (/x)"


def test_joining_argv_moves_the_shell_first():
    argv = joining_argv("/cg/slot-1/tasks", ["/bin/sh", "-c", "echo hi"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3:] == ["/cg/slot-1/tasks", "/bin/sh", "-c", "echo hi"]
    assert argv[2].startswith('echo 0 > "$0"')
    v1 = cg.Hierarchy("/sys/fs/cgroup/freezer", v2=False, controller="freezer")
    v2 = cg.Hierarchy("/x", v2=True)
    assert cg.join_file(v1, "/c/slot-1") == "/c/slot-1/tasks"  # moves one thread: no global lock
    assert cg.join_file(v2, "/c/slot-1") == "/c/slot-1/cgroup.procs"


def test_sandbox_containers_carry_their_node():
    from agent.executors.docker import LABEL_NODE, container_kwargs

    spec = SandboxSpec("s1", "img", 64)
    assert container_kwargs(spec, "c1", "0", "img", node="cpu-01")["labels"][LABEL_NODE] == "cpu-01"
    assert LABEL_NODE not in container_kwargs(spec, "c1", "0", "img")["labels"]


def test_proc_start_names_one_process():
    assert cg.proc_start(os.getpid()) == cg.proc_start(os.getpid()) > 0
    assert cg.proc_start(1 << 30) is None


def test_no_cgroups_where_they_cannot_be_made(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "agent.executors.cgroups")
    assert cg.ActionCgroups.open("c", "n", cg.Hierarchy(str(tmp_path / "not-mounted"), v2=True)) is None
    assert cg.ActionCgroups.open("c", "n", cg.Hierarchy(str(tmp_path), v2=True)) is None  # not cgroupfs
    assert caplog.text.count("actions are not put in cgroups") == 2
    fake = cg.Hierarchy(str(tmp_path), v2=True)
    with pytest.raises(ContainmentUnavailable, match="cgroup|root"):  # cannot contain sandboxes: refused
        ProcessExecutor(str(tmp_path / "sb"), str(CPUS[0]), cgroups=fake)
    ex = ProcessExecutor(str(tmp_path / "sb"), str(CPUS[0]), cgroups=fake, trusted_code_only=True)
    assert ex.cgroups is None and not ex.contained  # runs actions as before (test_process_executor.py)


# ---------------------------------------------------------------- real cgroups


def usable_hierarchies() -> list[cg.Hierarchy]:
    with open("/proc/self/mountinfo") as f:
        mounts = parse_mountinfo(f.read())
    out = []
    for ctrl in ("freezer", "pids"):
        out += [cg.Hierarchy(m.path, v2=False, controller=ctrl) for m in mounts if ctrl in m.controllers][:1]
    out += [cg.Hierarchy(m.path, v2=True) for m in mounts if not m.controllers][:1]
    return out


HIERARCHIES = usable_hierarchies()


@pytest.fixture(params=HIERARCHIES or [None], ids=lambda h: h.label.split(" (")[0] if h else "none")
def hierarchy(request) -> cg.Hierarchy:
    h = request.param
    if h is None:
        pytest.skip("no cgroup hierarchy is mounted")
    if os.geteuid() != 0 or not os.access(h.path, os.W_OK):
        pytest.skip(f"{h.label} is not writable here")
    probe = cg.ActionCgroups.open("test", f"probe-{uuid.uuid4().hex[:6]}", h)
    if probe is None:
        pytest.skip(f"cannot make action cgroups in {h.label}")
    probe.close()
    return h


@pytest.fixture(params=["contained-spawner", "contained-agent", "trusted-spawner", "trusted-agent"])
async def ex(request, tmp_path, hierarchy):
    """Contained sandboxes (``hierarchy``: where actions are killed; the limits in the cpuset, memory and
    pids hierarchies found here), and trusted code only (each action in a cgroup of ``hierarchy``)."""
    mode, how = request.param.split("-")
    kw = {} if mode == "contained" else {"containment": Containment(missing=["(test) trusted code only"]),
                                         "trusted_code_only": True}
    try:
        e = ProcessExecutor(str(tmp_path / "sandboxes"), ",".join(map(str, CPUS)), spawner=how == "spawner",
                            cluster="test", node=f"n-{uuid.uuid4().hex[:6]}", cgroups=hierarchy, **kw)
    except ContainmentUnavailable as exc:
        pytest.skip(f"cannot contain sandboxes here: {exc}")
    assert (e.sbcg if mode == "contained" else e.cgroups) is not None
    await e.create_sandbox(SandboxSpec("s1", "", 64))
    yield e
    await e.close()
    assert not any(os.path.exists(d) for d in all_dirs(e))
    for name in await e.list_sandboxes():
        await e.destroy_sandbox(name)


def all_dirs(e: ProcessExecutor) -> list[str]:
    """The executor's incarnation cgroup in every hierarchy it uses."""
    return list(e.sbcg.dirs.values()) if e.contained else [e.cgroups.dir]


def slots_dir(e: ProcessExecutor) -> str:
    """Where the slots of sandbox s1 are, in the hierarchy that kills them."""
    if e.contained:
        return os.path.join(e.sbcg.dirs[e.sbcg.roles.kill], "sb-s1")
    return e.cgroups.dir


def incarnation(e: ProcessExecutor) -> str:
    return e.sbcg.name if e.contained else e.cgroups.name


def clean(e: ProcessExecutor) -> list[str]:
    """What ``slots_dir`` holds once every action ended with nothing left (no slot of a dirty action): with
    trusted code only, the agent's spawner's cgroup too."""
    return [] if e.contained else [cg.SPAWNER]


# Each sleeper execs in place, so the pid it writes is the pid of the process that has to die.
ESCAPERS = ("setsid sh -c 'echo $$ > p-setsid; exec sleep 1000' & "
            "nohup sh -c 'echo $$ > p-nohup; exec sleep 1000' >/dev/null 2>&1 & "
            "sh -c \"sh -c 'echo \\$\\$ > p-double; exec sleep 1000' &\" & "
            "setsid sh -c 'echo $$ > p-burner; while :; do :; done' >/dev/null 2>&1 & ")
PIDFILES = ("p-setsid", "p-nohup", "p-double", "p-burner")


def req(cmd: str, action: str | None = None, **kw) -> RunRequest:
    return RunRequest(action or f"a-{uuid.uuid4().hex[:8]}", "s1", cmd, (CPUS[0],), **kw)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may stay a zombie for a while: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def subdirs(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir())


def recorded_pids(sb_dir: str, names=PIDFILES) -> list[int]:
    out = []
    for name in names:
        with open(os.path.join(sb_dir, name)) as f:
            out.append(int(f.read()))
    return out


async def wait_files(sb_dir: str, names=PIDFILES, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not all(os.path.getsize(os.path.join(sb_dir, n)) if os.path.exists(os.path.join(sb_dir, n)) else 0
                  for n in names):
        assert time.monotonic() < end, f"the action did not write {names}"
        await asyncio.sleep(0.02)


async def test_clean_actions_reuse_their_cgroups(ex):
    def slots(*results: RunResult) -> list[str]:
        return [line.rsplit("/", 1)[1] for r in results for line in r.stdout.decode().splitlines()
                if incarnation(ex) in line and "/" + cg.SLOT_PREFIX in line]  # (v1: the line of each)

    seq = [await ex.run(req("cat /proc/self/cgroup")) for _ in range(3)]
    assert len(set(slots(*seq))) == 1 and slots(*seq)[0].startswith(cg.SLOT_PREFIX)
    both = await asyncio.gather(*(ex.run(req("cat /proc/self/cgroup; sleep 0.2")) for _ in range(2)))
    assert len(set(slots(*both))) == 2 and set(slots(*seq)) < set(slots(*both))
    assert subdirs(slots_dir(ex)) == sorted({*slots(*both), *clean(ex)})  # kept for the next actions
    assert all(not cg.pids(os.path.join(slots_dir(ex), d)) for d in slots(*both))


async def test_nothing_outlives_an_action_that_exits(ex, tmp_path):
    sb = str(tmp_path / "sandboxes" / "s1")
    wait_all = "for f in " + " ".join(PIDFILES) + "; do while [ ! -s $f ]; do sleep 0.01; done; done; "
    r = await ex.run(req(ESCAPERS + wait_all + "echo ok"))
    assert (r.exit_code, r.stdout) == (0, b"ok\n")
    assert [pid for pid in recorded_pids(sb) if running(pid)] == []
    assert subdirs(slots_dir(ex)) == clean(ex)  # the action's cgroup, with leftovers, is gone


@pytest.mark.parametrize("how", ["kill", "timeout"])
async def test_nothing_outlives_a_killed_action(ex, tmp_path, how):
    sb = str(tmp_path / "sandboxes" / "s1")
    task = asyncio.ensure_future(ex.run(req(ESCAPERS + "sleep 1000", action="victim",
                                            timeout_s=1000 if how == "kill" else 1.0)))
    await wait_files(sb)
    pids = recorded_pids(sb)
    assert all(running(pid) for pid in pids)
    if how == "kill":
        assert await ex.kill("victim")
    r = await asyncio.wait_for(task, 10)
    assert r.exit_code == 137 and (r.killed if how == "kill" else r.timed_out)
    assert [pid for pid in pids if running(pid)] == []
    assert subdirs(slots_dir(ex)) == clean(ex)


@pytest.mark.parametrize("kill_first", [True, False])
async def test_destroying_a_sandbox_under_a_running_action_ends_it_killed(ex, tmp_path, kill_first):
    """The controller sends a Kill and the destroy of a gone client's sandbox back to back, and the destroy
    may stop the sandbox's spawner before it reported the exit: the run ends killed (137), it does not fail
    (it did, with `SpawnerLost` as an internal error and its traceback in the agent's log, in `tangram bench
    chaos`'s client faults)."""
    if not ex.contained:
        pytest.skip("trusted code only: the agent's one spawner is not the sandbox's")
    sb = str(tmp_path / "sandboxes" / "s1")
    task = asyncio.ensure_future(ex.run(req("echo $$ > p-main; exec sleep 1000", action="victim")))
    await wait_files(sb, ("p-main",))
    (pid,) = recorded_pids(sb, ("p-main",))
    if kill_first:
        assert await ex.kill("victim")
    await ex.destroy_sandbox("s1")
    r = await asyncio.wait_for(task, 10)
    assert r.exit_code == 137
    if ex.use_spawner or kill_first:  # (the agent's own spawn, destroyed: its cgroup killed it; no Kill came)
        assert r.killed
    assert not running(pid)


async def test_closing_kills_everything(ex, tmp_path):
    sb = str(tmp_path / "sandboxes" / "s1")
    task = asyncio.ensure_future(ex.run(req(ESCAPERS + "sleep 1000")))
    await wait_files(sb)
    pids = recorded_pids(sb)
    await ex.close()
    assert (await asyncio.wait_for(task, 10)).killed
    assert [pid for pid in pids if running(pid)] == []


def test_reap_kills_dead_incarnations_and_spares_live_ones(hierarchy, tmp_path):
    node = cg.node_dir(hierarchy, "test", f"n-{uuid.uuid4().hex[:6]}")
    dead = os.path.join(node, cg.incarnation_name(1 << 30, 1, 0), "slot-0")  # no such pid: its agent is gone
    odd = os.path.join(node, "left-by-someone", "x")  # not an incarnation name: cleaned too
    holder = subprocess.Popen(["sleep", "1000"])
    live = os.path.join(node, cg.incarnation_name(holder.pid, cg.proc_start(holder.pid), 0), "slot-0")
    procs = []
    try:
        for d in (dead, odd, live):
            os.makedirs(d)
            argv = joining_argv(cg.join_file(hierarchy, d),
                                ["/bin/sh", "-c", "setsid sleep 1000 & exec sleep 1000"])
            procs.append(subprocess.Popen(argv, cwd=str(tmp_path), start_new_session=True))
        end = time.monotonic() + 10
        while sum(len(cg.pids(d)) for d in (dead, odd, live)) < 6:
            assert time.monotonic() < end, "the processes did not start"
            time.sleep(0.02)
        victims = cg.pids(dead) + cg.pids(odd)
        found = cg.reap_node(hierarchy, node)
        assert (found.incarnations, found.cgroups, found.processes, found.skipped) == (2, 2, 4, 1)
        for proc in procs[:2]:
            assert proc.wait(5) == -signal.SIGKILL
        assert [pid for pid in victims if running(pid)] == []
        assert not os.path.exists(os.path.dirname(dead)) and not os.path.exists(os.path.dirname(odd))
        assert len(cg.pids(live)) == 2 and procs[2].poll() is None  # a live agent's actions are left alone
    finally:
        holder.kill()
        holder.wait()
        cg.remove_tree(hierarchy, node)
        for proc in procs:
            proc.wait(5)


def test_kill_tree_empties_nested_cgroups(hierarchy, tmp_path):
    top = cg.node_dir(hierarchy, "test", f"n-{uuid.uuid4().hex[:6]}")
    inner = os.path.join(top, "a", "b")
    os.makedirs(inner)
    argv = joining_argv(cg.join_file(hierarchy, inner),
                        ["/bin/sh", "-c", "sleep 1000 & sleep 1000 & exec sleep 1000"])
    proc = subprocess.Popen(argv, cwd=str(tmp_path), start_new_session=True)
    try:
        end = time.monotonic() + 10
        while len(cg.pids(inner)) < 3:
            assert time.monotonic() < end
            time.sleep(0.02)
        assert cg.remove_tree(hierarchy, top) == 3
        assert not os.path.exists(top)
    finally:
        proc.kill()
        proc.wait(5)


# ---------------------------------------------------------------- a real agent, killed and restarted


def agent_argv(ctl: FakeController, tmp_path, name: str) -> list[str]:
    cpus = two_cpus()
    return [sys.executable, "-m", "agent", "--controller", ctl.addr, "--name", name, "--cluster", "test",
            "--executor", "process", "--cpus", f"{cpus[0]},{cpus[1]}", "--idle-cpus", str(cpus[0]),
            "--workdir", str(tmp_path / "wd"), "--log-file", str(tmp_path / "wd" / "agent.log"),
            "--heartbeat", "0.2"]


@pytest.fixture
async def ctl():
    c = FakeController()
    yield c
    c.destroy()


@pytest.fixture
def agent_hierarchy() -> cg.Hierarchy:
    """The hierarchy a real agent picks here, when it can use it."""
    h = cg.discover()
    if h is None:
        pytest.skip("no cgroup hierarchy is mounted")
    probe = cg.ActionCgroups.open("test", f"probe-{uuid.uuid4().hex[:6]}", h)
    if probe is None:
        pytest.skip(f"cannot make action cgroups in {h.label} (not root?)")
    probe.close()
    return h


def killed_in_log(log: str) -> int:
    m = re.search(r"recovery: 1 earlier agents of this node found, ([0-9]+) processes killed in [12] of", log)
    assert m, log
    return int(m.group(1))


@pytest.mark.parametrize("kill", ["agent", "agent-and-spawner"])
async def test_a_restarted_agent_kills_its_predecessors_actions_before_hello(ctl, tmp_path, agent_hierarchy,
                                                                             kill):
    name = f"crash-{uuid.uuid4().hex[:6]}"
    sb = tmp_path / "wd" / "sandboxes" / "sb1"
    first = subprocess.Popen(agent_argv(ctl, tmp_path, name), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    second = None
    try:
        ident, _ = await ctl.handshake(timeout=15)
        await sandbox(ctl, ident)
        await ctl.send(ident, spawn("long", "echo $$ > p-main; " + ESCAPERS + "sleep 1000", [two_cpus()[1]],
                                    timeout_s=1000), rid=500)  # never answered: its agent dies
        await wait_files(str(sb), ("p-main", *PIDFILES))
        pids = recorded_pids(str(sb), ("p-main", *PIDFILES))
        assert all(running(pid) for pid in pids)
        spawners = spawners_of(first.pid, b"spawner.py") if kill == "agent-and-spawner" else []
        assert spawners or kill == "agent", "the agent has no spawner"
        victims = [first.pid, *spawners]
        for pid in victims:  # stopped first, so neither sees the other die and reacts (on a loaded machine
            os.kill(pid, signal.SIGSTOP)  # the spawner could notice its agent gone before its own SIGKILL)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        first.wait(10)
        second = subprocess.Popen(agent_argv(ctl, tmp_path, name), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        _, env = await ctl.expect(p.Hello, timeout=15)
        left = [pid for pid in pids if running(pid)]  # at the Hello, before any Welcome or core
        assert left == [], f"still running when the new agent said Hello: {left}"
        assert env.msg.sandboxes == ["sb1"] and env.msg.facts["pid"] == second.pid  # the sandbox stays
        assert sb.is_dir()
        killed = killed_in_log((tmp_path / "wd" / "agent.log").read_text())
        # the old spawner, when it outlives its agent, kills the action's process group (sh, nohup, the
        # double fork) on its way out: then only the two setsid ones are left for the new agent
        assert killed >= (len(pids) if kill == "agent-and-spawner" else 2)
        second.send_signal(signal.SIGTERM)
        assert second.wait(15) == 0
        node = cg.node_dir(agent_hierarchy, "test", name)
        assert not os.path.exists(node)  # a clean stop leaves no cgroups behind
    finally:
        stop_proc(first)
        if second is not None:
            stop_proc(second)
        cg.reap_node(agent_hierarchy, cg.node_dir(agent_hierarchy, "test", name))  # what a failed run left


def test_a_zombie_predecessor_does_not_hold_the_pidfile() -> None:
    """A killed agent that its parent has not reaped yet is a zombie: not alive."""
    import subprocess
    import time

    from agent.node import _alive

    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(child.pid)  # exited, not reaped: a zombie
    assert _alive(os.getpid())
    child.wait()
