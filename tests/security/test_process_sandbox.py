"""Containment of the process executor (issue 11): real processes through the real executor.

What a sandbox's code must not do, tried for real: read another sandbox's files, write root's files, run as
root or keep a capability, take more memory than the sandbox's ``mem``, leave a process behind (``setsid``
burners that also try to leave their cgroups and their cores), or stop the spawner of another sandbox. And
what the agent must not do for it: follow a link out of the sandbox, or write a file the sandbox does not own.
Then the refusal: an agent that cannot contain sandboxes (run here as an unprivileged user) does not start the
process executor without ``--trusted-code-only``.

These need root and the cgroups (cpuset, memory, pids and a kill hierarchy) and skip with the reason where
the host has none. The cgroup v2 file writes are checked against a directory tree that mimics cgroupfs
(``MimicFs``), and on this host's real cgroup2 mount where it has one (hybrid: no controllers there, so the
kill and tracking path and ``cgroup.subtree_control`` with whatever controller it offers);
docs/agent.md ("Process sandboxes") says what ran where.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from typing import ClassVar

import pytest

from agent.executors import cgroups as cg
from agent.executors import spawner as spawner_mod
from agent.executors import users
from agent.executors.base import PathRejected, RunRequest, SandboxSpec
from agent.executors.fastpath import parse_mountinfo
from agent.executors.proc_cgroups import (
    SLOT_SHAPES,
    CgroupFs,
    Roles,
    SandboxCgroups,
    enable_controllers,
    parse_oom_kills,
    pick_roles,
)
from agent.executors.proc_contain import Containment, ContainmentUnavailable
from agent.executors.process import ProcessExecutor, dropping_argv
from tangram.units import format_cpulist

CPUS = sorted(os.sched_getaffinity(0))
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="containment needs root (a uid per sandbox, cgroups)")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- helpers


def executor(tmp_path, **kw) -> ProcessExecutor:
    try:
        return ProcessExecutor(
            str(tmp_path / "sandboxes"),
            ",".join(map(str, CPUS)),
            cluster="sec",
            node=f"n-{uuid.uuid4().hex[:6]}",
            **kw,
        )
    except ContainmentUnavailable as exc:
        pytest.skip(f"this host cannot contain sandboxes: {exc}")


@pytest.fixture(params=["spawner", "agent"])
async def ex(tmp_path, request):
    """Both ways an action starts: the sandbox's spawner, and the agent itself (its fallback)."""
    if not ROOT:
        pytest.skip("containment needs root (a uid per sandbox, cgroups)")
    e = executor(tmp_path, spawner=request.param == "spawner")
    assert e.contained
    yield e
    await close_all(e)


async def close_all(e: ProcessExecutor) -> None:
    uids = [sb.uid for sb in e._sandboxes.values()]
    await e.close()
    for name in await e.list_sandboxes():
        await e.destroy_sandbox(name)
    assert [p for u in uids for p in procs_of(u)] == []


def req(sandbox: str, cmd: str, cores=(CPUS[-1],), action=None, **kw) -> RunRequest:
    return RunRequest(action or f"a-{uuid.uuid4().hex[:8]}", sandbox, cmd, tuple(cores), **kw)


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def procs_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                text = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            out.append(int(pid))
    return out


def status_field(text: str, key: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(key + ":"))


def world_runnable(path: str) -> bool:
    """Can any user run ``path`` (every directory above it searchable by others)?"""
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    d = os.path.dirname(path)
    while True:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
        if d == "/":
            return True
        d = os.path.dirname(d)


def python_for_sandboxes() -> str:
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if os.path.exists(cand) and world_runnable(cand):
            return cand
    pytest.skip("no Python that a sandbox user may run")


async def sandbox(e: ProcessExecutor, name: str, mem_mib: int = 256, **kw) -> None:
    await e.create_sandbox(SandboxSpec(name, "", mem_mib, **kw))


# Leaves a burner behind that also tries to leave its cgroups (every hierarchy's root) and its cores.
BURNER = (
    "setsid sh -c '"
    "echo $$ > burner.pid; "
    "for f in /sys/fs/cgroup/*/cgroup.procs /sys/fs/cgroup/*/tasks /sys/fs/cgroup/cgroup.procs; do "
    'echo $$ > "$f" 2>/dev/null; done; '
    "taskset -acp 0-4095 $$ >/dev/null 2>&1; "
    'exec sh -c "while :; do :; done"\' </dev/null >/dev/null 2>&1 & '
    "while [ ! -s burner.pid ]; do sleep 0.01; done; sleep 0.2; "
    'echo "$(grep Cpus_allowed_list /proc/$(cat burner.pid)/status)"; '
)


async def burner_pid(e: ProcessExecutor, name: str) -> int:
    end = time.monotonic() + 10
    while True:
        try:
            text = (await e.get(name, "burner.pid")).decode().strip()
            if text:
                return int(text)
        except PathRejected:
            pass
        assert time.monotonic() < end, "the burner did not start"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- one sandbox against another, and the host


@needs_root
async def test_a_sandbox_cannot_read_another_sandboxs_files(ex):
    await sandbox(ex, "alice")
    await sandbox(ex, "bob")
    await ex.put("bob", "secret.txt", b"bob's secret")
    r = await ex.run(req("bob", "echo mine > own.txt; chmod 644 own.txt; echo notes > /tmp/$$.bob; pwd"))
    bob_dir = r.stdout.decode().strip()
    assert r.exit_code == 0 and bob_dir.endswith("/bob")
    tries = [
        f"cat {bob_dir}/secret.txt",
        "cat ../bob/secret.txt",
        f"cat {bob_dir}/own.txt",
        "ls ../bob",
        f"ls {bob_dir}",
        "ls ..",
        f"cp {bob_dir}/secret.txt .",
    ]
    for cmd in tries:
        r = await ex.run(req("alice", cmd))
        assert r.exit_code != 0 and b"secret" not in r.stdout and b"mine" not in r.stdout, (cmd, r)
    r = await ex.run(req("alice", "cat /tmp/*.bob"))  # what bob left in /tmp is private too (umask 077)
    assert b"notes" not in r.stdout


@needs_root
async def test_actions_cannot_write_root_files(ex):
    await sandbox(ex, "s1")
    mark = f"tangram-test-{uuid.uuid4().hex[:8]}"
    hostdir = tempfile.mkdtemp(prefix="tangram-host-", dir="/var/tmp")  # root's, 0755: readable by all
    try:
        os.chmod(hostdir, 0o755)
        with open(os.path.join(hostdir, "config"), "w") as f:
            f.write("original")
        cmds = [
            f"touch /etc/{mark}",
            f"mkdir /usr/{mark}",
            f"touch {hostdir}/{mark}",
            f"echo evil > {hostdir}/config",
            f"rm -f {hostdir}/config",
            f"chmod 777 {hostdir}",
            f"cat {hostdir}/config",
        ]
        results = [await ex.run(req("s1", cmd)) for cmd in cmds]
        assert [r.exit_code != 0 for r in results] == [True] * 6 + [False], results  # it may read, not write
        assert not os.path.exists(f"/etc/{mark}") and not os.path.exists(f"/usr/{mark}")
        with open(os.path.join(hostdir, "config")) as f:
            assert f.read() == "original"
        assert not os.path.exists(os.path.join(hostdir, mark))
        assert stat.S_IMODE(os.stat(hostdir).st_mode) == 0o755
    finally:
        shutil.rmtree(hostdir, ignore_errors=True)
        for leftover in (f"/etc/{mark}", f"/usr/{mark}"):  # (only if the test failed)
            if os.path.isdir(leftover):
                os.rmdir(leftover)
            elif os.path.exists(leftover):
                os.unlink(leftover)


@needs_root
async def test_actions_run_as_the_sandboxs_own_user_without_privileges(ex):
    await sandbox(ex, "s1")
    await sandbox(ex, "s2")
    seen = {}
    for name in ("s1", "s2"):
        r = await ex.run(req(name, "id -u; id -g; id -G; cat /proc/self/status; stat -c %u:%a .; umask"))
        lines = r.stdout.decode().splitlines()
        uid, gid, groups = int(lines[0]), int(lines[1]), lines[2].split()
        status = "\n".join(lines[3:-2])
        owner, mode = lines[-2].split(":")
        assert uid != 0 and uid == gid == int(owner) and groups == [str(gid)], lines[:3]
        assert users.DEFAULT_BASE <= uid < users.DEFAULT_BASE + users.DEFAULT_COUNT
        assert mode == "700" and lines[-1] == "0077"
        assert status_field(status, "Uid").split() == [str(uid)] * 4  # real, effective, saved, fs
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status_field(status, cap), 16) == 0, cap
        assert status_field(status, "NoNewPrivs") == "1"
        seen[name] = uid
    assert seen["s1"] != seen["s2"]
    r = await ex.run(req("s1", "su -c id root </dev/null; sudo -n id; mount -t tmpfs none ."))
    assert b"uid=0" not in r.stdout


@needs_root
async def test_files_put_belong_to_the_sandbox_and_reads_stay_inside(ex, tmp_path):
    await sandbox(ex, "s1")
    await ex.put("s1", "d/e/f.txt", b"data\n")
    r = await ex.run(req("s1", "id -u; stat -c %u d d/e d/e/f.txt; echo more >> d/e/f.txt; cat d/e/f.txt"))
    lines = r.stdout.decode().split()
    assert r.exit_code == 0 and lines[1:4] == [lines[0]] * 3 and lines[4:] == ["data", "more"]
    sb_dir = str(tmp_path / "sandboxes" / "s1")
    secret = tmp_path / "root-secret"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    os.link(secret, os.path.join(sb_dir, "hard"))  # (as protected_hardlinks=0 would let sandbox code do)
    os.symlink(secret, os.path.join(sb_dir, "soft"))
    for name in ("hard", "soft"):
        with pytest.raises(PathRejected):
            await ex.get("s1", name)
    await ex.put("s1", "hard", b"replaced")  # a new file of the sandbox's: root's file stays as it was
    assert secret.read_text() == "root only" and await ex.get("s1", "hard") == b"replaced"
    with pytest.raises(PathRejected):
        await ex.put("s1", "soft/x", b"x")
    r = await ex.run(req("s1", "ln -s / up; mkfifo fifo; echo ok"))
    assert r.stdout == b"ok\n"
    for path in ("up/etc/passwd", "fifo"):
        with pytest.raises(PathRejected):
            await ex.get("s1", path)


@needs_root
async def test_the_sandboxs_spawner_is_no_use_to_its_code(ex):
    if not ex.use_spawner:
        pytest.skip("the agent spawns itself here")
    await sandbox(ex, "s1")
    r = await ex.run(
        req(
            "s1",
            "id -u; grep -E '^(Uid|CapEff|CapPrm|NoNewPrivs)' /proc/$PPID/status; "
            "cat /proc/$PPID/environ >/dev/null 2>&1 || echo no-environ",
        )
    )
    lines = r.stdout.decode().splitlines()
    uid = lines[0]
    assert lines[1].split()[1:] == [uid] * 4
    assert lines[2].split()[1] == lines[3].split()[1] == "0000000000000000"  # CapPrm, CapEff
    assert lines[4].split()[1] == "1" and lines[-1] == "no-environ"


@needs_root
async def test_a_sandbox_that_stops_its_spawner_hurts_only_itself(tmp_path):
    e = executor(tmp_path)
    try:
        await sandbox(e, "bad")
        await sandbox(e, "good")
        assert (await e.run(req("good", "echo fine"))).stdout == b"fine\n"
        t0 = time.monotonic()
        bad = asyncio.ensure_future(e.run(req("bad", "kill -STOP $PPID; sleep 1000", timeout_s=1.0)))
        await asyncio.sleep(0.5)
        r = await asyncio.wait_for(e.run(req("good", "echo still fine", cores=(CPUS[0],))), 10)
        assert r.stdout == b"still fine\n"  # another sandbox's spawner: not stopped
        with pytest.raises(Exception, match="spawner"):
            await asyncio.wait_for(bad, 20)
        assert time.monotonic() - t0 < 15
        assert (await e.run(req("bad", "echo again"))).stdout == b"again\n"  # a new spawner
    finally:
        await close_all(e)


# ---------------------------------------------------------------- memory


@needs_root
@pytest.mark.parametrize("how", ["mem", "default"])
async def test_mem_is_enforced_and_reported_as_oom(tmp_path, how):
    py = python_for_sandboxes()
    e = executor(tmp_path, sandbox_mem_mib=128 if how == "default" else None)
    try:
        await sandbox(e, "s1", mem_mib=128 if how == "mem" else 0)
        alloc = f"{py} -c 'b = bytearray(1 << 30); print(len(b))'"  # 1 GiB, every page written
        r = await e.run(req("s1", alloc, timeout_s=60))
        assert (r.exit_code, r.killed, r.timed_out) == (137, False, False), r  # the OOM outcome
        assert b"1073741824" not in r.stdout
        assert e.sbcg.oom_kills(e._sandboxes["s1"].cg) >= 1
        r = await e.run(req("s1", f"{py} -c 'b = bytearray(32 << 20); print(len(b))'"))
        assert r.stdout == b"33554432\n"  # under the limit: fine
    finally:
        await close_all(e)


@needs_root
async def test_the_memory_limit_spans_the_sandboxs_actions(tmp_path):
    py = python_for_sandboxes()
    e = executor(tmp_path)
    try:
        await sandbox(e, "s1", mem_mib=128)
        hold = f"{py} -c 'import time; b = bytearray(80 << 20); time.sleep(2); print(len(b))'"
        two = (CPUS[0], CPUS[-1])
        rs = await asyncio.gather(*(e.run(req("s1", hold, cores=(c,), timeout_s=60)) for c in two))
        codes = sorted(r.exit_code for r in rs)
        assert 137 in codes, rs  # 2 x 80 MiB do not fit in 128 MiB together
        await sandbox(e, "s2", mem_mib=256)
        rs = await asyncio.gather(*(e.run(req("s2", hold, cores=(c,), timeout_s=60)) for c in two))
        assert [r.exit_code for r in rs] == [0, 0], rs  # in 256 MiB they do
    finally:
        await close_all(e)


# ---------------------------------------------------------------- processes and cores


@needs_root
async def test_a_spawner_keeps_few_slots_files_and_actions_still_land_in_their_slots(tmp_path, monkeypatch):
    """The spawner keeps the join files of the last ``SLOTS_KEPT`` slots (2 here), so most actions pass only
    their stdio; a slot it forgot gets its files again. Whatever it keeps or forgets, every action runs in
    its own slot's cgroups on its cores, and the spawner holds no more descriptors than that bound allows."""
    if len(CPUS) < 2:
        pytest.skip("needs two cores (three core sets)")
    monkeypatch.setattr(spawner_mod, "SLOTS_KEPT", 2)
    e = executor(tmp_path, spawner=True)
    try:
        await sandbox(e, "s1")
        shapes = [(c,) for c in CPUS[:3]] + [tuple(CPUS[:2])]
        seen_fds = []
        for i in range(3 * len(shapes)):
            cores = shapes[i % len(shapes)]
            r = await e.run(req("s1", "grep Cpus_allowed_list /proc/self/status; cat /proc/self/cgroup",
                                cores=cores))
            assert r.exit_code == 0, r
            out = r.stdout.decode()
            assert f"Cpus_allowed_list:\t{format_cpulist(cores)}" in out, out
            sb = e._sandboxes["s1"]
            names = {line.rsplit("/", 1)[-1] for line in out.splitlines() if "/slot-" in line}
            assert len(names) == 1, out  # one slot in every slot-level hierarchy
            name = names.pop()
            slot = next(s for s in sb.cg.free if s.dirs[0].endswith("/" + name))  # (given back after the run)
            assert slot.cpus == format_cpulist(cores), (slot, cores)
            seen_fds.append(len(os.listdir(f"/proc/{sb.spawner.pid}/fd")))
        assert len(shapes) > 2 and len(sb.spawner._kept) == 2  # (so it forgot some on the way)
        per_slot = len(e.sbcg.request_joins(sb.cg, sb.cg.free[0]))
        assert max(seen_fds) - min(seen_fds) <= per_slot, seen_fds  # one slot's files more at most (1 -> 2)
    finally:
        await close_all(e)




@needs_root
async def test_a_setsid_burner_is_gone_when_its_action_returns(ex):
    await sandbox(ex, "s1")
    core = CPUS[-1]
    r = await ex.run(req("s1", BURNER + "echo started", cores=(core,)))
    assert r.stdout.decode().split() == ["Cpus_allowed_list:", str(core), "started"], r  # kept on its core
    pid = await burner_pid(ex, "s1")
    assert not running(pid), "the burner outlived its action"
    sb = ex._sandboxes["s1"]
    assert procs_of(sb.uid) == ([sb.spawner.pid] if ex.use_spawner else [])  # nothing else of the sandbox


@needs_root
@pytest.mark.parametrize("end", ["destroy", "close"])
async def test_nothing_survives_the_sandbox(tmp_path, end):
    e = executor(tmp_path)
    try:
        await sandbox(e, "s1")
        uid = e._sandboxes["s1"].uid
        task = asyncio.ensure_future(e.run(req("s1", BURNER + "sleep 1000", timeout_s=1000)))
        pid = await burner_pid(e, "s1")
        assert running(pid)
        if end == "destroy":
            await e.destroy_sandbox("s1")
            assert not running(pid) and procs_of(uid) == []
            r = await asyncio.wait_for(task, 10)  # its action went with it: killed, as on close (agent.md)
            assert r.killed and r.exit_code == 137
        else:
            await e.close()
            assert (await asyncio.wait_for(task, 10)).killed
            assert not running(pid) and procs_of(uid) == []
    finally:
        await close_all(e)


@needs_root
async def test_an_action_cannot_leave_its_cores(ex):
    if len(CPUS) < 2:
        pytest.skip("needs two cores")
    await sandbox(ex, "s1")
    r = await ex.run(
        req("s1", "taskset -acp 0-4095 $$; grep Cpus_allowed_list /proc/self/status", cores=(CPUS[0],))
    )
    assert r.stdout.decode().split()[-1] == str(CPUS[0]), r


# ---------------------------------------------------------------- refusal


def test_refuses_without_the_capabilities_unless_told_the_code_is_trusted(tmp_path):
    why = "no memory cgroup controller (neither a v1 memory mount nor memory in cgroup2)"
    lacking = Containment(missing=[why])
    with pytest.raises(ContainmentUnavailable) as err:
        ProcessExecutor(str(tmp_path / "sb"), str(CPUS[0]), containment=lacking)
    assert "memory cgroup" in err.value.message and "trusted_code_only" in err.value.hint
    e = ProcessExecutor(
        str(tmp_path / "sb"), str(CPUS[0]), containment=lacking, trusted_code_only=True, cgroups=False
    )
    assert not e.contained


def test_what_is_missing_is_named():
    hybrid = parse_mountinfo(
        "34 31 0:31 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
        "37 31 0:34 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n"
        "38 31 0:35 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    roles, missing = pick_roles(hybrid, {"/sys/fs/cgroup/unified": []})
    assert missing == [] and roles.kill.controller == "freezer" and len(roles.hierarchies()) == 4
    unified = parse_mountinfo("30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n")
    roles, missing = pick_roles(unified, {"/sys/fs/cgroup": ["cpuset", "cpu", "io", "memory", "pids"]})
    assert missing == [] and roles.hierarchies() == [cg.Hierarchy("/sys/fs/cgroup", v2=True)]
    roles, missing = pick_roles(unified, {"/sys/fs/cgroup": ["cpu", "io", "memory", "pids"]})
    assert roles is None
    assert missing == ["no cpuset cgroup controller (neither a v1 cpuset mount nor cpuset in cgroup2)"]
    roles, missing = pick_roles([], {})
    assert roles is None and len(missing) == 4


@needs_root
def test_a_non_root_agent_refuses_the_process_executor_unless_trusted(tmp_path):
    """A real agent as uid 65534. It keeps one capability, CAP_DAC_READ_SEARCH, only to reach the Python
    installation and the repository wherever they are (here under /root): it is not root."""
    if subprocess.run(["setpriv", "--help"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no setpriv")
    wd = tmp_path / "wd"
    wd.mkdir()
    os.chown(wd, 65534, 65534)
    os.chmod(tmp_path, 0o755)
    drop = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=+dac_read_search",
        "--ambient-caps=+dac_read_search",
        "--",
    ]
    argv = [
        *drop,
        sys.executable,
        "-m",
        "agent",
        "--controller",
        "tcp://127.0.0.1:9",
        "--name",
        "unpriv",
        "--executor",
        "process",
        "--workdir",
        str(wd),
        "--log-file",
        str(wd / "agent.log"),
        "--cpus",
        str(CPUS[-1]),
        "--idle-cpus",
        str(CPUS[0]),
    ]
    env = {**os.environ, "PYTHONPATH": REPO, "HOME": str(wd)}
    res = subprocess.run(argv, env=env, capture_output=True, timeout=60, cwd=REPO, check=False)
    log = (wd / "agent.log").read_text()
    assert res.returncode == 2, (res, log)
    assert "cannot contain sandboxes" in log and "not root" in log and "trusted_code_only" in log, log
    proc = subprocess.Popen(
        [*argv, "--trusted-code-only"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while "executor process" not in (wd / "agent.log").read_text():
            assert proc.poll() is None and time.monotonic() < end, (wd / "agent.log").read_text()
            time.sleep(0.1)
        log = (wd / "agent.log").read_text()
        assert "NOT contained" in log and "(uid 65534)" in log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- pure pieces and the cgroup writes


def test_the_agents_own_spawn_drops_to_the_sandbox_user():
    argv = dropping_argv(
        ["/cg/a/tasks", "/cg/b/tasks"], (2000007, 2000007), "/usr/bin/setpriv", ["/bin/sh", "-c", "id"]
    )
    assert argv[:3] == ["/bin/sh", "-c", argv[2]] and argv[2].startswith("umask 077;")
    assert argv[3:7] == ["tangram-join", "/cg/a/tasks", "/cg/b/tasks", "--"]
    assert argv[7:] == [
        "/usr/bin/setpriv",
        "--reuid=2000007",
        "--regid=2000007",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
        "/bin/sh",
        "-c",
        "id",
    ]


@needs_root
def test_uid_claims(tmp_path):
    pool = users.UidPool(3_000_000, 3, str(tmp_path / "claims"))
    dirs = [tmp_path / f"sb{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()
    got = [pool.claim(str(d)) for d in dirs[:3]]
    assert got == [3_000_000, 3_000_001, 3_000_002]
    for d, uid in zip(dirs, got, strict=False):
        os.chown(d, uid, uid)
    with pytest.raises(users.UidError):
        pool.claim(str(dirs[3]))  # all taken, none stale
    assert pool.holds(got[1], str(dirs[1])) and not pool.holds(got[1], str(dirs[3]))
    os.rmdir(dirs[1])  # its sandbox is gone: the claim is stale
    assert pool.claim(str(dirs[3])) == got[1]
    pool.release(got[0], str(dirs[0]))
    assert not os.path.lexists(tmp_path / "claims" / str(got[0]))
    passwd = users.parse_id_ranges("a:x:105:105::/:/bin/sh\nb:x:99:99::/:/bin/sh", "passwd")
    assert users.overlaps(100, 10, passwd) == ["a"]
    assert users.overlaps(100, 10, users.parse_id_ranges("c:50:51\nd:200:10", "sub")) == ["c"]


class MimicFs(CgroupFs):
    """A directory tree that answers like cgroupfs: ``mkdir`` makes the interface files the kernel would show
    (on v2, those of the controllers the parent enabled), ``+ctrl`` writes to ``cgroup.subtree_control``
    enable a controller the cgroup offers (else ENOENT, as the kernel), v1 memory refuses a limit above
    memsw (EINVAL); every write is logged."""

    V1: ClassVar[dict[str, dict[str, str]]] = {
        "cpuset": {"cpuset.cpus": "", "cpuset.mems": ""},
        "memory": {
            "memory.limit_in_bytes": str(1 << 62),
            "memory.memsw.limit_in_bytes": str(1 << 62),
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0",
        },
        "pids": {"pids.max": "max"},
        "freezer": {"freezer.state": "THAWED"},
    }
    V2: ClassVar[dict[str, dict[str, str]]] = {
        "cpuset": {"cpuset.cpus": "", "cpuset.mems": ""},
        "memory": {"memory.max": "max", "memory.swap.max": "max", "memory.events": "oom 0\noom_kill 0"},
        "pids": {"pids.max": "max"},
    }

    def __init__(self, roots: dict[str, str]) -> None:
        self.roots = roots  # mount path -> "v2" or the v1 controller
        self.log: list[tuple[str, str]] = []

    def kind(self, path: str) -> tuple[str, str]:
        root = max((r for r in self.roots if path == r or path.startswith(r + "/")), key=len)
        return root, self.roots[root]

    def mkdir(self, path: str) -> None:
        os.mkdir(path)
        _, kind = self.kind(path)
        files = {"cgroup.procs": "", "tasks": ""} if kind != "v2" else {"cgroup.procs": "", "cgroup.kill": ""}
        if kind == "v2":
            enabled = _rd(os.path.join(os.path.dirname(path), "cgroup.subtree_control")).split()
            files.update({"cgroup.controllers": " ".join(enabled), "cgroup.subtree_control": ""})
            for c in enabled:
                files.update(self.V2.get(c, {}))
        else:
            files.update(self.V1[kind])
        for name, text in files.items():
            _wr(os.path.join(path, name), text)

    def write(self, path: str, text: str) -> None:
        self.log.append((path, text))
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "no such cgroup file", path)
        name, d = os.path.basename(path), os.path.dirname(path)
        if name == "cgroup.subtree_control":
            have, offered = _rd(path).split(), _rd(os.path.join(d, "cgroup.controllers")).split()
            for tok in text.split():
                if tok[1:] not in offered:
                    raise OSError(errno.ENOENT, f"{tok[1:]} is not offered", path)
                if tok[0] == "+" and tok[1:] not in have:
                    have.append(tok[1:])
            text = " ".join(have)
        elif name == "memory.limit_in_bytes" and int(text) > int(_rd(f"{d}/memory.memsw.limit_in_bytes")):
            raise OSError(errno.EINVAL, "above memsw", path)
        elif name == "memory.memsw.limit_in_bytes" and int(text) < int(_rd(f"{d}/memory.limit_in_bytes")):
            raise OSError(errno.EINVAL, "below the limit", path)
        _wr(path, text)

    def read(self, path: str) -> str:
        return _rd(path)


def _rd(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _wr(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def test_cgroup_v2_writes_against_a_mimic(tmp_path):
    root = str(tmp_path / "cgroup2")
    os.mkdir(root)
    _wr(os.path.join(root, "cgroup.controllers"), "cpuset cpu io memory hugetlb pids rdma misc")
    _wr(os.path.join(root, "cgroup.subtree_control"), "cpu memory")  # as systemd leaves it, say
    fs = MimicFs({root: "v2"})
    h = cg.Hierarchy(root, v2=True)
    sbcg = SandboxCgroups(Roles(h, h, h, h), "c1", "n1", fs=fs)
    inc = sbcg.dirs[h]
    assert inc == os.path.join(root, "tangram", "c1", "n1", sbcg.name)
    assert _rd(os.path.join(root, "cgroup.subtree_control")).split() == ["cpu", "memory", "cpuset", "pids"]
    for level in ("tangram", "tangram/c1", "tangram/c1/n1", f"tangram/c1/n1/{sbcg.name}"):
        assert _rd(f"{root}/{level}/cgroup.subtree_control").split() == ["cpuset", "memory", "pids"]
    sb = sbcg.sandbox("s1", 128, 100)
    d = os.path.join(inc, "sb-s1")
    assert sbcg.spawner_cgroups(sb) == ([f"{inc}/spawner/cgroup.procs"], [])  # a leaf, out of the sandbox
    assert _rd(f"{inc}/spawner/cgroup.subtree_control") == ""
    assert (_rd(f"{d}/memory.max"), _rd(f"{d}/memory.swap.max"), _rd(f"{d}/pids.max")) == (
        str(128 << 20),
        "0",
        "100",
    )
    assert _rd(f"{d}/cgroup.subtree_control") == "cpuset"  # for its slots
    slot = sbcg.take(sb, (2, 3))
    assert slot.dirs == [f"{d}/slot-0"] and _rd(f"{d}/slot-0/cpuset.cpus") == "2-3"
    assert slot.joins == [f"{d}/slot-0/cgroup.procs"]  # one hierarchy: one join per action
    assert sbcg.all_joins(sb, slot) == sbcg.request_joins(sb, slot) == slot.joins
    assert sbcg.give_back(sb, slot) and sbcg.take(sb, (2, 3)) is slot
    sbcg.sandbox("s1", 256, 100)
    assert _rd(f"{d}/memory.max") == str(256 << 20)
    _wr(f"{d}/memory.events", "low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n")
    assert sbcg.oom_kills(sb) == 2
    assert not any(p.endswith(("cgroup.procs", "tasks")) for p, _ in fs.log)  # nothing joined in the setup


def _v1_mimic(tmp_path):
    """A v1 host in a mimic (freezer, cpuset with cpus 0-7, memory, pids): (fs, hierarchies by controller,
    the SandboxCgroups of node n1)."""
    roots = {}
    for ctrl in ("freezer", "cpuset", "memory", "pids"):
        roots[str(tmp_path / ctrl)] = ctrl
        os.mkdir(tmp_path / ctrl)
    _wr(str(tmp_path / "cpuset" / "cpuset.cpus"), "0-7")
    _wr(str(tmp_path / "cpuset" / "cpuset.mems"), "0")
    fs = MimicFs(roots)
    hs = {c: cg.Hierarchy(str(tmp_path / c), v2=False, controller=c) for c in roots.values()}
    roles = Roles(hs["freezer"], hs["cpuset"], hs["memory"], hs["pids"])
    return fs, hs, SandboxCgroups(roles, "c1", "n1", fs=fs)


def test_cgroup_v1_writes_against_a_mimic(tmp_path):
    fs, hs, sbcg = _v1_mimic(tmp_path)
    assert [h.controller for h in sbcg.hs] == ["freezer", "cpuset", "memory", "pids"]
    inc_cpuset = sbcg.dirs[hs["cpuset"]]
    assert (_rd(f"{inc_cpuset}/cpuset.cpus"), _rd(f"{inc_cpuset}/cpuset.mems")) == ("0-7", "0")
    sb = sbcg.sandbox("s1", 128, 64)
    mem = os.path.join(sbcg.dirs[hs["memory"]], "sb-s1")
    assert _rd(f"{mem}/memory.limit_in_bytes") == _rd(f"{mem}/memory.memsw.limit_in_bytes") == str(128 << 20)
    sbcg.sandbox("s1", 512, 64)  # raising: memsw must go first (the mimic refuses the other order, as v1)
    assert _rd(f"{mem}/memory.limit_in_bytes") == _rd(f"{mem}/memory.memsw.limit_in_bytes") == str(512 << 20)
    assert _rd(os.path.join(sbcg.dirs[hs["pids"]], "sb-s1", "pids.max")) == "64"
    slot = sbcg.take(sb, (5,))
    names = [os.path.join(sbcg.dirs[hs[c]], "sb-s1") for c in ("freezer", "cpuset", "memory", "pids")]
    assert slot.dirs == [f"{names[0]}/slot-0", f"{names[1]}/slot-0"]
    assert slot.joins == [f"{names[0]}/slot-0/tasks", f"{names[1]}/slot-0/tasks"]  # kill, cores
    assert sbcg.all_joins(sb, slot) == [*slot.joins, f"{names[2]}/tasks", f"{names[3]}/tasks"]  # memory, pids
    # the spawner moves into the slot and the sandbox's memory for a spawn, and back: its memory home is not
    # the sandbox's (the OOM killer must not pick it there); it stays in the sandbox's pids
    assert sbcg.request_joins(sb, slot) == [*slot.joins, f"{names[2]}/tasks"]
    home, join = sbcg.spawner_cgroups(sb)
    assert home == [f"{names[0]}/tasks", f"{names[1]}/tasks", f"{sbcg.dirs[hs['memory']]}/spawner/tasks"]
    assert join == [f"{names[3]}/tasks"]
    assert _rd(f"{names[1]}/slot-0/cpuset.cpus") == "5" and _rd(f"{names[1]}/slot-0/cpuset.mems") == "0"
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n") == 7


def test_slots_kept_per_cpuset_against_a_v1_mimic(tmp_path):
    """Actions of one sandbox that come back to the same cores find their slot with those cpus: a sandbox
    with fewer than ``SLOT_SHAPES`` free slots gets a new slot rather than a re-set cpuset; with that many,
    a free one is re-set (one ``cpuset.cpus`` write)."""
    fs, _, sbcg = _v1_mimic(tmp_path)
    sb = sbcg.sandbox("s1", 128, 64)

    def cpus_writes() -> list[str]:
        return [t for p, t in fs.log if p.endswith("/cpuset.cpus") and "/slot-" in p]

    a = sbcg.take(sb, (0,))
    assert sbcg.give_back(sb, a)
    b = sbcg.take(sb, (1,))
    assert b is not a and b.cpus == "1" and a.cpus == "0"
    assert sbcg.give_back(sb, b)
    before = len(cpus_writes())
    for cores, slot in (((0,), a), ((1,), b), ((0,), a), ((1,), b)):  # alternating: no write at all
        assert sbcg.take(sb, cores) is slot
        assert sbcg.give_back(sb, slot)
    assert len(cpus_writes()) == before
    more = [sbcg.take(sb, (c,)) for c in range(2, 2 + SLOT_SHAPES)]  # a, b free: new slots for new cores
    assert len({id(s) for s in more}) == SLOT_SHAPES and not {id(a), id(b)} & {id(s) for s in more}
    for s in more:
        assert sbcg.give_back(sb, s)
    assert len(sb.free) == 2 + SLOT_SHAPES
    n_slots, before = len(sb.free), len(cpus_writes())
    again = sbcg.take(sb, (7,))  # free ones enough: one of them is re-set, no new cgroup
    assert again.cpus == "7" and len(sb.free) == n_slots - 1 and cpus_writes()[before:] == ["7"]
    assert _rd(os.path.join(again.dirs[1], "cpuset.cpus")) == "7"


@needs_root
def test_cgroup_v2_on_this_hosts_real_cgroup2_mount():
    """On this host's real cgroup2 mount. A pure v2 host (cpuset, memory and pids offered there): the whole
    setup, limits and probe of ``SandboxCgroups``. Any host with cgroup2: ``cgroup.subtree_control`` enabling
    (``enable_controllers``) down the chain with a controller the mount offers (enabled at the mount's root
    for the test and switched off again after), a process tree in a leaf, and ``cgroup.kill`` of it."""
    with open("/proc/self/mountinfo") as f:
        v2 = [m for m in parse_mountinfo(f.read()) if not m.controllers]
    if not v2:
        pytest.skip("no cgroup2 mount")
    h = cg.Hierarchy(v2[0].path, v2=True)
    offered = _rd(os.path.join(h.path, "cgroup.controllers")).split()
    node = f"n-{uuid.uuid4().hex[:6]}"
    if {"cpuset", "memory", "pids"} <= set(offered):
        sbcg = SandboxCgroups(Roles(h, h, h, h), "sec", node)
        try:
            sbcg.probe([CPUS[0]])
            sb = sbcg.sandbox("s1", 64, 32)
            assert _rd(os.path.join(sb.dirs[h], "memory.max")) == str(64 << 20)
        finally:
            sbcg.close()
    ctrl = next((c for c in ("hugetlb", "misc", "rdma", "pids", "memory", "cpuset") if c in offered), None)
    root_ctl = os.path.join(h.path, "cgroup.subtree_control")
    was = _rd(root_ctl).split()
    chain = [
        os.path.join(h.path, "tangram"),
        os.path.join(h.path, "tangram", "sec"),
        os.path.join(h.path, "tangram", "sec", node),
    ]
    leaf = os.path.join(chain[-1], "leaf")
    fs = CgroupFs()
    try:
        if ctrl is not None:
            enable_controllers(fs, h.path, [ctrl])
        for level in chain:
            os.makedirs(level, exist_ok=True)
            if ctrl is not None:
                enable_controllers(fs, level, [ctrl])
                assert ctrl in _rd(os.path.join(level, "cgroup.subtree_control")).split()
                enable_controllers(fs, level, [ctrl])  # already enabled: nothing written (else EBUSY-free)
        os.mkdir(leaf)
        if ctrl is not None:
            assert ctrl in _rd(os.path.join(leaf, "cgroup.controllers")).split()
        script = 'echo 0 > "$0" || exit 1; setsid sleep 1000 & exec sleep 1000'
        proc = subprocess.Popen(["/bin/sh", "-c", script, os.path.join(leaf, "cgroup.procs")])
        end = time.monotonic() + 10
        while len(cg.pids(leaf)) < 2:
            assert time.monotonic() < end, "the processes did not join"
            time.sleep(0.02)
        assert cg.remove_tree(h, chain[-1]) == 2  # cgroup.kill: the setsid one too
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        cg.remove_tree(h, chain[-1])
        if ctrl is not None:
            for level in reversed(chain[:-1]):  # switch it off again where this test switched it on
                with contextlib.suppress(OSError):
                    fs.write(os.path.join(level, "cgroup.subtree_control"), f"-{ctrl}")
            if ctrl not in was:
                with contextlib.suppress(OSError):
                    fs.write(root_ctl, f"-{ctrl}")
