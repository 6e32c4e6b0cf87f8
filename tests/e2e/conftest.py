"""A local cluster from real processes: the controller (in-process or `tangram controller`
subprocess) and a real agent subprocess (`python -m agent`), on 127.0.0.1 random ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from support.agents import start_agent, stop_process  # noqa: F401 - the e2e tests import them from here

from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options

CONFIG: dict[str, Any] = {
    "cluster": "e2e",
    "scheduler": {"client_grace_s": 30},
    "services": [
        {
            "name": "reward",
            "runtime": "emulated",
            "model": "agent.gpu.demo_services:reward",
            "gpu_mem_mib": 1024,
            "chunk_sizes": [1, 2],
            "load_s": 0.05,
        }
    ],
    "apis": [{"name": "search", "mode": "concurrency", "limit": 2}],
}


def cpus_for_test() -> str:
    n = len(os.sched_getaffinity(0))
    return "0-1" if n >= 2 else "0"


async def wait_for_node(c: Controller, name: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = c.agents.agents.get(name)
        if a is not None and a.live and (c.core.cpu.nodes.get(name) or c.core.gpu.nodes.get(name)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"agent {name} did not register within {timeout}s")


@pytest.fixture
async def cluster(tmp_path: Any) -> AsyncIterator[Callable[..., Any]]:
    """`await cluster(*agent_flags, env=...)` -> the in-process Controller with one real agent `n1`."""
    started: list[tuple[Controller, subprocess.Popen[bytes]]] = []

    async def make(
        *flags: str, env: dict[str, str] | None = None, config: dict[str, Any] | None = None
    ) -> Controller:
        c = Controller(parse_config(config or CONFIG), Options())
        c.start()
        workdir = tmp_path / f"agent{len(started)}"
        workdir.mkdir()
        proc = start_agent(c.agents_addr, str(workdir), *flags, env=env)
        started.append((c, proc))
        try:
            await wait_for_node(c, "n1")
        except AssertionError:
            log = (workdir / "agent.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"agent did not register; its log:\n{log}") from None
        return c

    yield make
    for c, proc in started:  # as `tangram down`: the agent removes its sandboxes (no container is left)
        c.request_stop(down=True)
        await c.stop()
        await asyncio.get_running_loop().run_in_executor(None, stop_process, proc)


@pytest.fixture
def controller_process(tmp_path: Any) -> Iterator[dict[str, Any]]:
    """`tangram controller` as a subprocess; yields its ready info (ports, addresses, pid)."""
    ready = tmp_path / "ready.json"
    config = tmp_path / "resolved.json"
    config.write_text(json.dumps(CONFIG))
    journal = tmp_path / "journal.jsonl"
    log = open(tmp_path / "controller.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tangram_cli.main import cli; cli()",
            "controller",
            "--bind",
            "127.0.0.1",
            "--config",
            str(config),
            "--journal",
            str(journal),
            "--ready-file",
            str(ready),
        ],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    log.close()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        assert json.loads(ready.read_text()) == info
        info["journal"] = str(journal)
        info["proc"] = proc
        yield info
    finally:
        with contextlib.suppress(Exception):
            stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()
