"""Per-GPU lanes live (rule 4 of tangram_cli/controller/agents.py): an in-process controller and a
real agent subprocess with 2 emulated GPUs. A call of service ``a`` runs on one GPU; a call of
service ``b`` restores onto the other for 6 s; a second call of ``a``, made once the first one
ended, runs on the resident copy at once and is answered before b's restore ends (the agent has
not logged it yet): a restore holds up only what comes after it on its own GPUs, not the node.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.agents import start_agent, stop_process

pytestmark = pytest.mark.timeout(120)

SLOW_RESTORE_S = 6.0  # b's emulated restore


def _service(name: str, restore_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "runtime": "emulated",
        "model": "agent.gpu.demo_services:echo",
        "gpu_mem_mib": 1024,
        "chunk_sizes": [1],
        "load_s": restore_s,
        "t_ori": 0.05,
        "options": {"setup_s": restore_s, "bandwidth_gbps": 1000.0},
    }


CONFIG = {
    "cluster": "lanes",
    "scheduler": {"client_grace_s": 30},
    "services": [_service("a", 0.1), _service("b", SLOW_RESTORE_S)],
}


def _start_agent(addr: str, workdir: Path) -> subprocess.Popen[bytes]:
    return start_agent(addr, str(workdir), "--executor", "process", "--cpus", "0",
                       "--emulated-gpus", "2", "--gpu-memory", "16GiB", "--log-level", "INFO")


async def _until(what: str, check: Any, within_s: float, log: Path) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:]
    raise AssertionError(f"{what}: not within {within_s:g} s; agent log:\n{tail}")


async def test_a_restore_on_one_gpu_does_not_hold_up_a_call_on_another(tmp_path: Path) -> None:
    import tangram
    from tangram_cli.controller.config import parse_config
    from tangram_cli.controller.daemon import Controller, Options

    workdir = tmp_path / "agent"
    workdir.mkdir()
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1"))
    c.start()
    proc = _start_agent(c.agents_addr, workdir)
    log = workdir / "agent.log"
    try:
        await _until("agent registers with 2 GPUs", lambda: c.core.gpu.nodes.get("n1") is not None, 60, log)
        await _until("services prepared",
                     lambda: all(f"service {s} prepared" in log.read_text() for s in "ab"), 60, log)
        async with tangram.AsyncClient(c.submit_addr, name="lanes", connect_timeout=10) as tg:
            busy = asyncio.ensure_future(tg.call("a", {"sleep_s": 1.0}, gpus=1, timeout=60))
            await _until("a's first call runs", lambda: len(c.core.running) == 1, 20, log)
            slow = asyncio.ensure_future(tg.call("b", {"n": 2}, gpus=1, timeout=60))  # onto the other GPU
            await _until("b's call starts (its restore is sent)", lambda: len(c.core.running) == 2, 20, log)
            first = await asyncio.wait_for(busy, 60)
            second = await asyncio.wait_for(tg.call("a", {"n": 3}, gpus=1, timeout=60), 60)
            log_then = log.read_text()
            rb = await asyncio.wait_for(slow, 60)
    finally:
        await asyncio.to_thread(stop_process, proc, 10.0)
        await asyncio.wait_for(c.stop(), 15)

    assert first.loaded and not second.loaded and list(second.gpus) == list(first.gpus)
    assert rb.loaded and list(rb.gpus) != list(first.gpus)
    assert "service b on GPUs" not in log_then, log_then[-2000:]  # answered while b was restoring
    assert f"service b on GPUs {rb.gpus[0]}-{rb.gpus[0]}: restored" in log.read_text()
