"""GPU pre-wake live (issue 14, item 2): an in-process controller and a real agent subprocess with
3 emulated GPUs (no CUDA needed). A call waits in the queue while its service is restored onto the
idle GPU, so the restore overlaps its queue wait and the call runs with no restore on its path.

3 GPUs make the chunks [0, 2) and [2, 3): ``x`` (service a on 2 GPUs) runs on GPUs 0-1; ``h`` (a on
2 GPUs) waits for them and, first in line, blocks the queue (FCFS); ``w`` (service b on 1 GPU)
waits behind ``h``. GPU 2 is idle, and no call could start on it: the core restores b there
ahead (a ``Load`` with no ``Invoke``), and when x ends, h and w start together, w on the copy
restored while it waited. The journal and the agent's log show the order; the call's reply says
it loaded nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.agents import start_agent, stop_process

from tangram import journal as jr

pytestmark = pytest.mark.timeout(120)

RESTORE_S = 1.0  # each service's emulated restore (setup_s), as the core is told (load_s)


def _service(name: str, sizes: list[int], t_ori: float) -> dict[str, Any]:
    return {
        "name": name,
        "runtime": "emulated",
        "model": "agent.gpu.demo_services:echo",
        "gpu_mem_mib": 1024,
        "chunk_sizes": sizes,
        "load_s": RESTORE_S,
        "t_ori": t_ori,
        "options": {"setup_s": RESTORE_S, "bandwidth_gbps": 1000.0},
    }


CONFIG = {
    "cluster": "prewake",
    "scheduler": {"client_grace_s": 30},
    "services": [_service("a", [2], 3.0), _service("b", [1], 0.2)],
}


def _start_agent(addr: str, workdir: Path) -> subprocess.Popen[bytes]:
    return start_agent(
        addr,
        str(workdir),
        "--executor",
        "process",
        "--cpus",
        "0",
        "--emulated-gpus",
        "3",
        "--gpu-memory",
        "16GiB",
        "--log-level",
        "INFO",
    )


async def _until(what: str, check: Any, within_s: float, log: Path) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"{what}: not within {within_s:g} s; agent log:\n{log.read_text(errors='replace')[-3000:]}"
    )


def _timeline(path: Path) -> dict[str, Any]:
    """From the journal: each call's submission and start times by service, and the Loads."""
    _, records = jr.read(path)
    subs: dict[str, tuple[str, float]] = {}
    starts: dict[str, float] = {}
    loads: list[tuple[float, str, int, bool]] = []  # (t, service, start, with an Invoke in the record)
    for r in records:
        e = r["event"]
        if e["type"] == "ActionSubmitted" and e["spec"]["kind"] == "call":
            subs[e["spec"]["action_id"]] = (e["spec"]["service"], r["t"])
        invoked = {c["action_id"] for c in r["commands"] if c["type"] == "Invoke"}
        for c in r["commands"]:
            if c["type"] == "Invoke":
                starts[c["action_id"]] = r["t"]
            elif c["type"] == "Load":
                loads.append((r["t"], c["service"], c["start"], bool(invoked)))
    return {"subs": subs, "starts": starts, "loads": loads}


async def test_a_restore_runs_while_its_call_waits_in_the_queue(tmp_path: Path) -> None:
    import tangram
    from tangram_cli.controller.config import parse_config
    from tangram_cli.controller.daemon import Controller, Options

    workdir = tmp_path / "agent"
    workdir.mkdir()
    journal = tmp_path / "journal"
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", journal=str(journal)))
    c.start()
    proc = _start_agent(c.agents_addr, workdir)
    log = workdir / "agent.log"
    try:
        await _until("agent registers with 3 GPUs", lambda: c.core.gpu.nodes.get("n1") is not None, 60, log)
        await _until(
            "services prepared",
            lambda: all(f"service {s} prepared" in log.read_text() for s in "ab"),
            60,
            log,
        )
        async with tangram.AsyncClient(c.submit_addr, name="prewake", connect_timeout=10) as tg:
            x = asyncio.ensure_future(tg.call("a", {"sleep_s": 3.0}, gpus=2, timeout=60))
            await _until("x runs", lambda: len(c.core.running) == 1, 20, log)
            h = asyncio.ensure_future(tg.call("a", {"sleep_s": 0.1}, gpus=2, timeout=60))
            await _until("h queued", lambda: len(c.core.pending.lane("gpu")) == 1, 20, log)
            w = await asyncio.wait_for(tg.call("b", {"n": 1}, gpus=1, timeout=60), 60)
            rx, rh = await asyncio.wait_for(asyncio.gather(x, h), 60)
    finally:
        await asyncio.to_thread(stop_process, proc, 15.0)
        await asyncio.wait_for(c.stop(), 15)

    assert rx.loaded and rh.value == {"echo": {"sleep_s": 0.1}}
    assert w.value == {"echo": {"n": 1}} and list(w.gpus) == [2]
    assert not w.loaded  # nothing restored on its path: b was resident when it started
    assert w.queued_s > RESTORE_S  # it waited for h (behind x) longer than b's restore took
    tl = _timeline(journal)
    (w_id,) = [aid for aid, (svc, _) in tl["subs"].items() if svc == "b"]
    w_sub, w_start = tl["subs"][w_id][1], tl["starts"][w_id]
    ahead = [(t, s) for t, svc, s, with_invoke in tl["loads"] if svc == "b" and not with_invoke]
    assert len(ahead) == 1, tl["loads"]  # one restore ahead of its call ...
    t_load, start = ahead[0]
    assert start == 2 and w_sub <= t_load < w_start  # ... started while w waited
    assert w_start - t_load >= RESTORE_S - 0.05  # and the wait covered the whole restore
    assert "service b on GPUs 2-2: restored" in log.read_text()
