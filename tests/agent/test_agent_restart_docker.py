"""A real ``python -m agent --executor docker``, killed with SIGKILL while an action runs, and started again
with the same node name: the actions of the dead agent are gone when the new one says Hello, and the sandbox
(its container and files) is still there, listed in the Hello (``agent.executors.leftovers``)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_link import FakeController, spawn, spawners_of, stop_proc, two_cpus

from tangram import protocol as p

pytestmark = pytest.mark.docker

# pids as the container sees them; each sleeper execs in place. The setsid ones leave the exec's process
# group: only the fast path (action sub-cgroups) can find them, so they are checked there only. (Debian's
# static busybox has no nohup applet: the trap is what nohup does.)
GROUP = ("echo $$ > p-main; sh -c 'trap \"\" HUP; echo $$ > p-nohup; exec sleep 1000' >/dev/null 2>&1 & "
         "sh -c \"sh -c 'echo \\$\\$ > p-double; exec sleep 1000' &\" & ")
SETSID = ("setsid sh -c 'echo $$ > p-setsid; exec sleep 1000' & "
          "setsid sh -c 'echo $$ > p-burner; while :; do :; done' >/dev/null 2>&1 & ")


@pytest.fixture
async def ctl():
    c = FakeController()
    yield c
    c.destroy()


def agent_argv(ctl: FakeController, tmp_path, name: str, cluster: str, mode: str, image: str) -> list[str]:
    cpus = two_cpus()
    return [sys.executable, "-m", "agent", "--controller", ctl.addr, "--name", name, "--cluster", cluster,
            "--executor", "docker", "--docker-mode", mode, "--image", image,
            "--cpus", f"{cpus[0]},{cpus[1]}", "--idle-cpus", str(cpus[0]), "--workdir", str(tmp_path / "wd"),
            "--log-file", str(tmp_path / "wd" / "agent.log"), "--heartbeat", "0.2"]


def docker_env(docker_client) -> dict[str, str]:
    adapter = getattr(docker_client.api, "_custom_adapter", None)  # the fixture's daemon, private or not
    socket_path = getattr(adapter, "socket_path", None)
    url = f"unix://{socket_path}" if socket_path else docker_client.api.base_url
    return {**os.environ, "DOCKER_HOST": url}


def in_box(container, script: str) -> str:
    code, out = container.exec_run(["sh", "-c", script], workdir="/work")
    assert code == 0, out
    return out.decode()


def running_in_box(container, pids: list[int]) -> list[int]:
    """Which of ``pids`` (container pids) still run (zombies do not count)."""
    script = "for p in " + " ".join(map(str, pids)) + "; do " \
             "[ -e /proc/$p/stat ] && ! grep -q '^[0-9]* ([^)]*) Z' /proc/$p/stat && echo $p; done; true"
    return [int(x) for x in in_box(container, script).split()]


async def recorded(container, names: list[str], timeout: float = 15.0) -> list[int]:
    end = time.monotonic() + timeout
    script = "cat " + " ".join(names)
    while True:
        code, out = await asyncio.to_thread(container.exec_run, ["sh", "-c", script], workdir="/work")
        pids = out.decode().split() if code == 0 else []
        if len(pids) == len(names):
            return [int(x) for x in pids]
        assert time.monotonic() < end, f"the action did not write {names}: {out!r}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(("mode", "kill"),
                         [("auto", "agent"), ("auto", "agent-and-spawner"), ("docker", "agent")])
async def test_a_restarted_docker_agent_kills_running_actions_and_keeps_the_sandbox(
        ctl, tmp_path, docker_client, busybox_image, test_labels, mode, kill):
    if mode == "auto" and os.geteuid() != 0:
        pytest.skip("the fast path needs root")
    name, cluster = f"crash-{uuid.uuid4().hex[:6]}", f"t{uuid.uuid4().hex[:8]}"
    argv = agent_argv(ctl, tmp_path, name, cluster, mode, busybox_image)
    env = docker_env(docker_client)
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    second = None
    try:
        ident, _ = await ctl.handshake(timeout=30)
        reply = await ctl.request(ident, p.CreateSandbox("sb1", busybox_image, 64, test_labels), timeout=60)
        assert isinstance(reply.msg, p.Result), reply.msg
        container = docker_client.containers.get(f"tangram-{cluster}-sb1")
        assert container.labels["tangram.node"] == name
        fast = mode == "auto"
        names = ["p-main", "p-nohup", "p-double"] + (["p-setsid", "p-burner"] if fast else [])
        cmd = GROUP + (SETSID if fast else "") + "sleep 1000"
        await ctl.send(ident, spawn("long", cmd, [two_cpus()[1]], timeout_s=1000), rid=500)  # never answered
        pids = await recorded(container, names)
        assert running_in_box(container, pids) == pids
        spawners = spawners_of(first.pid, b"nsspawner.py") if kill == "agent-and-spawner" else []
        victims = [first.pid, *spawners]
        assert len(victims) == (2 if kill == "agent-and-spawner" else 1)
        for pid in victims:  # stopped first, so neither sees the other die and reacts (on a loaded machine
            os.kill(pid, signal.SIGSTOP)  # the spawner could notice its agent gone before its own SIGKILL)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        first.wait(10)
        second = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        _, hello = await ctl.expect(p.Hello, timeout=30)
        left = running_in_box(container, pids)  # at the Hello, before any Welcome or core
        assert left == [], f"still running when the new agent said Hello: {left}"
        assert hello.msg.sandboxes == ["sb1"]
        container.reload()
        assert container.status == "running"  # the sandbox survives; only its actions died
        log = (tmp_path / "wd" / "agent.log").read_text()
        m = re.search(r"recovery: 1 running sandboxes of this node checked: ([0-9]+) processes killed in "
                      r"([0-9]+) action cgroups, ([0-9]+) old spawners and ([0-9]+) docker execs killed", log)
        assert m, log
        killed, slots, _, execs = map(int, m.groups())
        if fast:
            assert slots >= 1 and killed >= (len(pids) if kill == "agent-and-spawner" else 2)
        else:
            assert execs == 1
    finally:
        stop_proc(first)
        if second is not None:
            stop_proc(second)
        for c in docker_client.containers.list(all=True, filters={"label": [f"tangram.cluster={cluster}"]}):
            c.remove(force=True, v=True)  # with whatever a failed run left in it
