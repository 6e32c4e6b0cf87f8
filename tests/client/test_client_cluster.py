"""The client's timeouts and arguments against a real local cluster (controller in-process, a real
`python -m agent` with the process executor, 127.0.0.1): `timeout` bounds the run, not the queue;
`total_timeout` bounds both; `ActionTimeout` is a `TimeoutError` carrying the output so far;
`mem` is checked at open; `exec` takes a list of arguments."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import tangram
from tangram.errors import ActionTimeout, BadRequest, NoCapacity, UnitError
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options
from tests.e2e.conftest import CONFIG, cpus_for_test
from tests.e2e.conftest import cluster as cluster  # noqa: F401 - the fixture, reused

CORES = len(cpus_for_test().split("-"))  # every core the agent hands out (1 or 2)
FLAGS = ("--executor", "process", "--cpus", cpus_for_test(), "--mem", "4GiB")


async def test_timeout_bounds_the_run_not_the_queue(cluster) -> None:
    c = await cluster(*FLAGS)
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        blocker = asyncio.ensure_future(env.exec("sleep 2.5", cpus=CORES, timeout=30))
        await asyncio.sleep(0.5)  # the blocker holds every core: the next exec has to queue
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:  # the builtin catches it
            await env.exec("echo started; echo oops >&2; sleep 30", cpus=CORES, timeout=1)
        waited = time.monotonic() - t0
        err = info.value
        assert isinstance(err, ActionTimeout) and err.retryable
        assert err.stdout == "started\n" and err.stderr == "oops\n"  # it ran, and its output came back
        assert waited > 2.5  # queued for ~2 s (more than its timeout), then ran for 1 s
        assert waited < 12, waited
        assert (await blocker).exit_code == 0
        r = await env.exec("echo next", cpus=CORES, timeout=20)  # the cores came back
        assert r.stdout == "next\n"


async def test_total_timeout_bounds_the_queue_and_the_run(cluster) -> None:
    c = await cluster(*FLAGS)
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        blocker = asyncio.ensure_future(env.exec("sleep 3", cpus=CORES))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(ActionTimeout, match="queued") as info:
            await env.exec("touch ran", cpus=CORES, timeout=30, total_timeout=1)
        assert time.monotonic() - t0 < 10 and info.value.stdout_bytes == b""  # never started
        await blocker
        assert (await env.exec("test -e ran; echo $?")).stdout == "1\n"  # dropped from the queue, never run
        with pytest.raises(ActionTimeout) as info:  # a total shorter than the run limit cuts the run
            await env.exec("echo begun; sleep 30", timeout=30, total_timeout=1)
        assert info.value.stdout == "begun\n"


async def test_exec_takes_a_list_of_arguments(cluster) -> None:
    c = await cluster(*FLAGS)
    odd = ["a b", "$HOME", "it's", "*", "", "{dop}"]
    async with tangram.AsyncClient(c.submit_addr) as tg, tg.sandbox() as env:
        r = await env.exec(["printf", "[%s]", *odd])
        assert r.stdout == "[a b][$HOME][it's][*][][1]"  # quoted with shlex.join; only {dop} is filled in
        with pytest.raises(BadRequest, match="cmd"):
            await env.exec([])

    def blocking() -> str:  # in a thread: the controller runs on this test's event loop
        with tangram.Client(c.submit_addr) as sync_tg, sync_tg.sandbox(mem="512MiB") as sync_env:
            return sync_env.exec(["echo", "a;b"], timeout=20, total_timeout=60).stdout

    assert await asyncio.to_thread(blocking) == "a;b\n"


async def test_mem_is_checked_at_open_and_means_what_the_agent_reads(cluster, tmp_path: Path) -> None:
    c = await cluster(*FLAGS)  # the node offers 4 GiB for sandboxes
    async with tangram.AsyncClient(c.submit_addr) as tg:
        with pytest.raises(UnitError, match="above the limit of 64TiB"):
            tg.sandbox(mem=10**8)  # absurd (bytes meant as MiB?): refused before anything is sent
        for bad in ("2 gigs", "2G", -1):
            with pytest.raises(UnitError):
                await tg.open_sandbox(mem=bad)
        with pytest.raises(NoCapacity, match="more than any node offers") as info:
            await tg.open_sandbox(mem="8GiB")  # larger than every node: refused at open, not first exec
        assert "4GiB" in str(info.value)
        async with tg.sandbox(mem="2GB") as env:  # decimal: 2 * 10^9 bytes = 1907 MiB
            assert (await env.exec("true")).exit_code == 0  # the agent created it
            assert c.registry.sandboxes[env.id].mem_mib == c.core.sandboxes[env.id].mem_mib == 1907
            log = (tmp_path / "agent0" / "agent.log").read_text()
            assert f"sandbox {env.id} created (directory, 1907 MiB)" in log


async def test_mem_is_not_refused_before_any_node_joined() -> None:
    c = Controller(parse_config(CONFIG), Options())
    c.start()
    try:
        async with tangram.AsyncClient(c.submit_addr) as tg:
            sb = await tg.open_sandbox(mem="8GiB")  # a large node may still join: the first exec decides
            await sb.close()
    finally:
        await c.stop()
