"""agent.probe: pure parsers on sample text, readers on a fake tree and on this machine."""
from __future__ import annotations

import os

import pytest

from agent import probe

MOUNTINFO_V2 = """\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
MOUNTINFO_V1 = """\
33 24 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
34 33 0:29 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
40 33 0:35 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,cpuset
41 33 0:36 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:17 - cgroup cgroup rw,memory
"""
MEMINFO = """\
MemTotal:       24684092 kB
MemFree:        22751820 kB
MemAvailable:   24072560 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
garbage line
"""


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3,8\n", [0, 1, 2, 3, 8]),
    ("0", [0]),
    ("0-1,4-5", [0, 1, 4, 5]),
    ("\n", []),
    ("", []),
    ("2,0", [0, 2]),
])
def test_parse_cpulist(text, cpus):
    assert probe.parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "0-", "-1", "0,,1", "1-70000"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError):
        probe.parse_cpulist(text)


def test_parse_meminfo():
    info = probe.parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 24684092 and info["HugePages_Total"] == 0 and "garbage line" not in info
    assert probe.mem_offer_mib(info) == 24105 - 2410
    assert probe.mem_offer_mib({"MemTotal": 100 * 1024 * 1024}) == 100 * 1024 - 4096
    assert probe.mem_offer_mib({}) == 0


def test_parse_cgroup_version():
    assert probe.parse_cgroup_version(MOUNTINFO_V2) == "v2"
    assert probe.parse_cgroup_version(MOUNTINFO_V1) == "v1"  # hybrid with a v1 cpuset counts as v1
    assert probe.parse_cgroup_version("") == "none"
    assert probe.parse_cgroup_version("no separator here\n") == "none"


def test_parse_numa_skips_memory_only_nodes():
    assert probe.parse_numa({1: "4-7\n", 0: "0-3\n", 2: "\n"}) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_readers_on_a_fake_tree(tmp_path):
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-5\n")
    for n, cpus in ((0, "0-2"), (1, "3-5"), (2, "")):
        d = tmp_path / f"sys/devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (tmp_path / "sys/devices/system/node/possible").write_text("0-2\n")
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    (tmp_path / "proc/self/mountinfo").write_text(MOUNTINFO_V2)
    root = str(tmp_path)
    assert probe.online_cpus(root) == [0, 1, 2, 3, 4, 5]
    assert probe.numa_cpulists(root) == [[0, 1, 2], [3, 4, 5]]
    assert probe.meminfo(root)["MemTotal"] == 24684092
    assert probe.cgroup_version(root) == "v2"
    facts = probe.probe(check_docker=False, check_gpus=False, root=root)
    assert facts.online == [0, 1, 2, 3, 4, 5] and facts.mem_total_mib == 24105 and facts.cgroup == "v2"
    assert facts.docker is False and facts.gpus == []


def test_readers_on_an_empty_tree(tmp_path):
    root = str(tmp_path)
    assert probe.numa_cpulists(root) == [] and probe.meminfo(root) == {}
    assert probe.cgroup_version(root) == "none"
    assert probe.online_cpus(root) == sorted(os.sched_getaffinity(0))  # falls back to our affinity


def test_this_machine():
    facts = probe.probe(check_docker=False)
    assert facts.online and set(facts.online) <= set(range(4096))
    assert set(facts.online) <= os.sched_getaffinity(0)
    assert all(n for n in facts.numa)
    assert facts.mem_total_mib > 0 and 0 < facts.mem_offer_mib <= facts.mem_total_mib
    assert facts.cgroup in ("v1", "v2", "none") and facts.hostname and facts.python
    assert isinstance(facts.gpus, list)


def test_docker_reachable_is_a_bool_and_false_for_a_dead_socket(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    assert probe.docker_reachable(timeout_s=1.0) is False
