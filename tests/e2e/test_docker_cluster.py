"""End to end with real Docker: the agent's docker executor sets the container's cpuset to
exactly the granted cores before each exec."""

from __future__ import annotations

import asyncio

import pytest

import tangram

from .conftest import cpus_for_test

pytestmark = pytest.mark.docker

ALLOWED = "grep Cpus_allowed_list /proc/self/status | cut -f2"


def parse_cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


async def test_cpuset_in_container_equals_granted_cores(cluster, docker_client, busybox_image) -> None:
    # busybox, not hostroot: on hosts where /sbin is a symlink Docker cannot mount docker-init
    # (`--init`) into the hostroot image (reported to the agent engineer).
    adapter = getattr(docker_client.api, "_custom_adapter", None)  # the fixture's daemon, private or not
    socket_path = getattr(adapter, "socket_path", None)
    url = f"unix://{socket_path}" if socket_path else docker_client.api.base_url
    env = {"DOCKER_HOST": url}
    c = await cluster(
        "--executor",
        "docker",
        "--cpus",
        cpus_for_test(),
        "--image",
        busybox_image,
        "--cluster",
        "tangram-test",
        env=env,
    )
    async with tangram.AsyncClient(c.submit_addr) as tg:
        async with tg.sandbox(mem="256MiB") as sb:
            await sb.put("t.txt", b"inside")
            r = await sb.exec(f"cat t.txt; echo; {ALLOWED}", cpus=1, timeout=60)
            assert r.exit_code == 0, r.stderr
            lines = r.stdout.splitlines()
            assert lines[0] == "inside"
            assert parse_cpulist(lines[1]) == set(r.cores)
            if cpus_for_test() == "0-1":
                r = await sb.exec(
                    f"echo {{dop}}; {ALLOWED}", cpus=(1, 2), elastic="linear", duration_hint=1.0, timeout=60
                )
                lines = r.stdout.splitlines()
                assert lines[0] == "2" and parse_cpulist(lines[1]) == {0, 1} == set(r.cores)
        if cpus_for_test() == "0-1":
            a, b = await tg.open_sandbox(), await tg.open_sandbox()
            ra, rb = await asyncio.gather(
                a.exec(f"{ALLOWED}; sleep 0.5", timeout=60), b.exec(f"{ALLOWED}; sleep 0.5", timeout=60)
            )
            assert parse_cpulist(ra.stdout) == set(ra.cores) and parse_cpulist(rb.stdout) == set(rb.cores)
            assert not set(ra.cores) & set(rb.cores)
            await a.close()
            await b.close()
