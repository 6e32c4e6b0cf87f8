"""The Docker fast path's kept cgroup files (``fastpath.CgroupFile``, ``SlotPool``): a container's and its
slots' ``cpuset.cpus`` are written through descriptors kept open, twice per action, in a real v1 cpuset
hierarchy (skipped where there is none that this process may write: not root, or cgroup v2 only)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from agent.executors.base import parse_cpuset
from agent.executors.fastpath import CgroupFile, ContainerCgroups, SlotPool, parse_mountinfo

CPUS = sorted(os.sched_getaffinity(0))


def _cpuset_root() -> str | None:
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        mounts = parse_mountinfo(fh.read())
    root = next((m.path for m in mounts if "cpuset" in m.controllers), None)
    return root if root is not None and os.access(root, os.W_OK) else None


def _read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read().strip()


def _make(path: str, parent: str) -> None:
    os.mkdir(path)
    for name in ("cpuset.mems", "cpuset.cpus"):
        with open(os.path.join(path, name), "w", encoding="ascii") as fh:
            fh.write(_read(os.path.join(parent, name)) or "\n")


@pytest.fixture
def container() -> Iterator[str]:
    """A cpuset cgroup with every core of this process, standing in for a container's."""
    root = _cpuset_root()
    if root is None:
        pytest.skip("no v1 cpuset hierarchy this process may write (needs root and cgroup v1)")
    path = os.path.join(root, f"tangram-test-{uuid.uuid4().hex[:8]}")
    _make(path, root)
    try:
        yield path
    finally:
        for sub in sorted(os.listdir(path)):
            if os.path.isdir(os.path.join(path, sub)):
                os.rmdir(os.path.join(path, sub))
        os.rmdir(path)


def test_a_kept_file_writes_through_one_descriptor_and_reopens_a_cgroup_made_again(container: str) -> None:
    sub = os.path.join(container, "s")
    _make(sub, container)
    f = CgroupFile(os.path.join(sub, "cpuset.cpus"))
    try:
        f.write(str(CPUS[0]))
        fd = f.fd
        assert fd is not None and _read(f.path) == str(CPUS[0])
        f.write("\n")
        assert f.fd == fd and _read(f.path) == ""
        os.rmdir(sub)  # the cgroup goes while the file is open (as runc removes a container's) ...
        _make(sub, container)  # ... and one of the same name comes: the kept descriptor is stale
        f.write(str(CPUS[-1]))
        assert f.fd is not None and _read(f.path) == str(CPUS[-1])
        with pytest.raises(OSError):  # a set the parent does not have: refused, and said so
            f.write(str(max(CPUS) + 64))
        assert f.fd is None and _read(f.path) == str(CPUS[-1])
    finally:
        f.close()
    assert f.fd is None


def test_slot_pool_sets_cpusets_through_kept_files_and_closes_them(container: str) -> None:
    pool = SlotPool(ContainerCgroups(container, (), v2=False))
    pool.set_cpus(str(CPUS[0]))
    assert _read(os.path.join(container, "cpuset.cpus")) == str(CPUS[0])
    slot = pool.take(str(CPUS[0]))
    assert _read(os.path.join(slot, "cpuset.cpus")) == str(CPUS[0])
    assert pool.give_back(slot) and _read(os.path.join(slot, "cpuset.cpus")) == ""  # empty while free
    assert pool.take(str(CPUS[0])) == slot  # kept: the same slot, its file still open
    assert pool.give_back(slot)
    everything = ",".join(map(str, CPUS))
    pool.set_cpus(everything)  # widening back: no free slot stands in the way
    assert list(parse_cpuset(_read(os.path.join(container, "cpuset.cpus")))) == CPUS
    kept = list(pool.files.values())
    assert {container, slot} <= pool.files.keys() and all(f.fd is not None for f in kept)
    pool.remove_all()
    assert not os.path.exists(slot) and not pool.files and all(f.fd is None for f in kept)
    pool.set_cpus(str(CPUS[-1]))  # an action ending after its sandbox's destroy began: written, kept not
    assert _read(os.path.join(container, "cpuset.cpus")) == str(CPUS[-1]) and not pool.files
