"""Pure parts of the executors: cpusets, argv builders, cgroup parsing, paths, output caps."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.executors import fastpath
from agent.executors.base import (
    OutputCollector,
    PathRejected,
    RunRequest,
    SandboxSpec,
    check_request,
    exit_status,
    expand_dop,
    format_cpuset,
    parse_cpuset,
    split_relpath,
)
from agent.executors.docker import container_kwargs
from agent.executors.images import HOSTROOT_IMAGE
from agent.executors.process import process_argv


@pytest.mark.parametrize(("cores", "text"), [((0,), "0"), ((0, 1, 2, 3, 8), "0-3,8"), ((5, 1, 2), "1-2,5"),
                                             ((0, 2, 4), "0,2,4"), ((7, 8, 9, 10), "7-10")])
def test_format_cpuset(cores, text):
    assert format_cpuset(cores) == text
    assert parse_cpuset(text) == tuple(sorted(cores))


@pytest.mark.parametrize("bad", ["", " ", "1,1", "-1", "0-", "0-999", "3-1", "0,,1", "a", "1-2,2", "01", "0 - 1",
                                 "1,0-1", "0x1", "4096"])
def test_parse_cpuset_rejects(bad):  # tangram.units rules (tests/test_units.py has the table)
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpuset(bad, max_cpu=255)


def test_parse_cpuset_max_cpu():
    assert parse_cpuset("0-3", max_cpu=3) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="above 3"):
        parse_cpuset("0-4", max_cpu=3)


def test_format_cpuset_rejects_empty_and_negative():
    for bad in [(), (-1,)]:
        with pytest.raises(ValueError, match="cpulist"):
            format_cpuset(bad)


@given(st.sets(st.integers(0, 255), min_size=1))
def test_cpuset_round_trip(cores):
    assert parse_cpuset(format_cpuset(cores)) == tuple(sorted(cores))


def test_expand_dop():
    cmd, env = expand_dop("pytest -n {dop} {x}", 4, {"A": "1"})
    assert cmd == "pytest -n 4 {x}"
    assert env == {"A": "1", "TANGRAM_DOP": "4"}
    with pytest.raises(ValueError, match="dop"):
        expand_dop("x", 0)


def test_exit_status():
    assert exit_status(0) == 0
    assert exit_status(3) == 3
    assert exit_status(-9) == 137


def test_output_collector_caps_without_buffering():
    c = OutputCollector(10)
    for _ in range(1000):
        c.feed(b"abcdefgh")
    assert c.value() == b"abcdefghab"
    assert c.truncated
    assert c.total == 8000
    assert len(c._buf) == 10
    exact = OutputCollector(4)
    exact.feed(b"abcd")
    assert not exact.truncated


@pytest.mark.parametrize(("path", "parts"), [("a.txt", ["a.txt"]), ("./x/y", ["x", "y"]), ("/work/x/y", ["x", "y"]),
                                             ("x//y/", ["x", "y"])])
def test_split_relpath(path, parts):
    assert split_relpath(path) == parts


@pytest.mark.parametrize("bad", ["", "..", "../x", "x/../../y", "/etc/passwd", "/work", "/workx/a", "a\0b", "x/.."])
def test_split_relpath_rejects(bad):
    with pytest.raises(PathRejected):
        split_relpath(bad)


def _req(**kw):
    base = dict(action="a1", sandbox="s1", cmd="true", cores=(0,))
    return RunRequest(**{**base, **kw})


@pytest.mark.parametrize(("kw", "match"), [
    ({"cores": ()}, "cores"), ({"cores": (1, 1)}, "cores"), ({"cores": (7,)}, "outside"),
    ({"timeout_s": 0}, "timeout"), ({"timeout_s": float("nan")}, "timeout"), ({"dop": 0}, "dop"),
    ({"env": {"LD_PRELOAD": "x"}}, "LD_PRELOAD"), ({"env": {"A=B": "x"}}, "A=B"), ({"env": {"A\nB": "x"}}, "A"),
    ({"action": "../x"}, "action"), ({"sandbox": "Bad Name"}, "sandbox"),
])
def test_check_request_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        check_request(_req(**kw), allowed={0, 1})


def test_nsenter_argv():
    argv = fastpath.nsenter_argv(4242, ["/cg/memory/docker/x/cgroup.procs", "/cg/cpuset/docker/x/tangram-a/cgroup.procs"],
                                 "echo hi", uid_gid=(65534, 65534), setpriv=fastpath.SETPRIV_NNP)
    assert argv == [
        "/bin/sh", "-c", fastpath.JOIN_SCRIPT, "tangram-join",
        "/cg/memory/docker/x/cgroup.procs", "/cg/cpuset/docker/x/tangram-a/cgroup.procs", "--",
        "nsenter", "-t", "4242", "-m", "-u", "-i", "-n", "-p", "-r", "-w", "-S", "65534", "-G", "65534", "--",
        "setpriv", "--nnp", "/bin/sh", "-c", "echo hi",
    ]
    assert not any(a.startswith("--wd=") for a in argv)  # --wd=DIR opens DIR on the host


def test_nsenter_argv_root_full_setpriv():
    argv = fastpath.nsenter_argv(1, [], "true", setpriv=fastpath.SETPRIV_FULL)
    assert argv[4] == "--"
    assert argv[-7:] == ["setpriv", "--nnp", "--bounding-set=-all", "--inh-caps=-all", "/bin/sh", "-c", "true"]
    assert "-S" not in argv


def test_join_script_joins_then_execs(tmp_path):
    import subprocess

    files = [tmp_path / "a", tmp_path / "b"]
    argv = ["/bin/sh", "-c", fastpath.JOIN_SCRIPT, "j", *map(str, files), "--", "sh", "-c", "echo $$"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    assert [f.read_text().strip() for f in files] == [out, out]  # the same pid joined, then exec'd
    bad = ["/bin/sh", "-c", fastpath.JOIN_SCRIPT, "j", str(tmp_path / "no" / "x"), "--", "true"]
    assert subprocess.run(bad, capture_output=True).returncode == 125


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,nosuid,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PROC_CGROUP = """\
9:name=systemd:/docker/abc
4:memory:/docker/abc
3:cpuset:/docker/abc
2:cpu,cpuacct:/docker/abc
0::/docker/abc
"""


def test_cgroup_discovery_v1():
    dirs = fastpath.cgroup_dirs(fastpath.parse_proc_cgroup(PROC_CGROUP), fastpath.parse_mountinfo(MOUNTINFO))
    cg = fastpath.container_cgroups(dirs)
    assert cg == fastpath.ContainerCgroups(
        "/sys/fs/cgroup/cpuset/docker/abc",
        ("/sys/fs/cgroup/cpu,cpuacct/docker/abc", "/sys/fs/cgroup/memory/docker/abc",
         "/sys/fs/cgroup/systemd/docker/abc", "/sys/fs/cgroup/unified/docker/abc"),
        v2=False)


def test_cgroup_discovery_v2_and_nested_mount_root():
    mi = "30 23 0:26 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    dirs = fastpath.cgroup_dirs(fastpath.parse_proc_cgroup("0::/kubepods/pod1/c1\n"), fastpath.parse_mountinfo(mi))
    assert fastpath.container_cgroups(dirs) == fastpath.ContainerCgroups("/sys/fs/cgroup/pod1/c1", (), v2=True)
    assert fastpath.container_cgroups({}) is None


def test_container_kwargs_hardening():
    spec = SandboxSpec("s1", HOSTROOT_IMAGE, 256, {"tangram.test": "1"}, pids_limit=64, user="65534:65534")
    kw = container_kwargs(spec, "c1", "0-1", HOSTROOT_IMAGE)
    assert kw["network_mode"] == "none"
    assert kw["mem_limit"] == kw["memswap_limit"] == "256m"
    assert kw["init"] is True and kw["pids_limit"] == 64 and kw["cap_drop"] == ["ALL"]
    assert kw["security_opt"] == ["no-new-privileges"] and kw["cpuset_cpus"] == "0-1"
    assert kw["labels"] == {"tangram.test": "1", "tangram.cluster": "c1", "tangram.sandbox": "s1",
                            "tangram.user": "65534:65534"}
    # the container's own processes run as the keeper; sandbox code as the labelled user
    assert kw["user"] == "65533:65533" and kw["working_dir"] == "/work"
    assert all(v["mode"] == "ro" for v in kw["volumes"].values())
    assert "/etc" not in {v["bind"] for v in kw["volumes"].values()}  # never the host's /etc
    assert kw["read_only"] is True and [m["Target"] for m in kw["mounts"]] == ["/work", "/tmp"]
    assert "privileged" not in kw


def test_process_argv():
    assert process_argv("echo", 64, "/usr/bin/prlimit") == [
        "/usr/bin/prlimit", f"--as={64 << 20}", "--", "/bin/sh", "-c", "echo"]
    # no pinning exec: the cores come from the spawning thread's affinity (agent.executors.spawn)
    assert process_argv("echo", None, "/usr/bin/prlimit") == process_argv("echo", 64, None) == [
        "/bin/sh", "-c", "echo"]
