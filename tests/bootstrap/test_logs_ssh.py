"""`tangram logs NODE` for an agent started over SSH: its agent.log is read on the node with `tail` over a
real OpenSSH server on 127.0.0.2 (Tangram's known_hosts, the inventory's key), printed, converted to
JSON, and followed (`-f`: `tail -F` over SSH) while lines are appended."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tangram_cli import state as st

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]

CLI = [sys.executable, "-c", "from tangram_cli.main import cli; cli()"]
TEXT = "2026-11-30T01:23:2{}.000Z INFO agent[node-a] agent: line {}"


def _cluster(server, key, workdir: Path) -> None:
    """A recorded cluster `rl` whose node `node-a` is an SSH host (what `tangram up rl.yaml` writes)."""
    host = st.HostState(
        name="node-a",
        host=server.host,
        connection="ssh",
        port=server.port,
        user=getpass.getuser(),
        workdir=str(workdir),
        identity_file=str(key.path),
        connect_timeout_ms=5000,
    )
    st.write(st.ClusterState(name="rl", hosts=[host], inventory="rl.yaml"))


def _run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_")}
    env.update(TANGRAM_HOME=str(home), NO_COLOR="1")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_logs_of_an_ssh_node_print_convert_and_follow(
    sshd_factory, ssh_key, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = sshd_factory("127.0.0.2")
    home, workdir = tmp_path / "home", tmp_path / "node" / "rl"
    monkeypatch.setenv("TANGRAM_HOME", str(home))
    workdir.mkdir(parents=True)
    log = workdir / "agent.log"
    log.write_text(
        "".join(TEXT.format(i, i) + "\n" for i in range(5)) + "Traceback (most recent call last):\n"
    )
    _cluster(server, ssh_key, workdir)

    r = _run(home, "logs", "node-a", "-c", "rl", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        TEXT.format(3, 3),
        TEXT.format(4, 4),
        "Traceback (most recent call last):",
    ]
    assert (home / "known_hosts").read_text().strip()  # accept-new recorded the node's key

    r = _run(home, "logs", "node-a", "-c", "rl", "-n", "2", "-o", "json")
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert docs == [
        {"ts": "2026-11-30T01:23:24.000Z", "level": "INFO", "source": "agent", "node": "node-a"}
        | {"logger": "agent", "msg": "line 4"},
        {"raw": "Traceback (most recent call last):"},
    ]

    r = _run(home, "logs", "node-b", "-c", "rl")
    assert r.returncode == 2 and "no node 'node-b' in cluster 'rl' (known: controller, node-a)" in r.stderr

    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_")}
    env.update(TANGRAM_HOME=str(home), PYTHONUNBUFFERED="1")
    follower = subprocess.Popen(
        [*CLI, "logs", "node-a", "-c", "rl", "-f", "-n", "1"], stdout=subprocess.PIPE, text=True, env=env
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follower.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lines == ["Traceback (most recent call last):\n"]
        with open(log, "a") as fh:
            fh.write(
                json.dumps(
                    {
                        "ts": "2026-11-30T01:24:00.000Z",
                        "level": "WARNING",
                        "source": "agent",
                        "node": "node-a",
                        "logger": "agent",
                        "pid": 1,
                        "msg": "appended",
                    }
                )
                + "\n"
            )
        deadline = time.monotonic() + 30
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lines[1] == "2026-11-30T01:24:00.000Z WARNING agent[node-a] agent: appended\n"  # JSON as text
        assert follower.poll() is None
    finally:
        follower.terminate()
        follower.wait(10)
        follower.stdout.close()  # type: ignore[union-attr]
