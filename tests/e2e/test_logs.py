"""Logs end to end: the one log format (tangram/logfmt.py) as real controller and agent processes write
it, text and JSON lines, and `tangram logs` on a real local cluster (`tangram up --executor process`):
the controller's log, the agent's, an unknown node, `-f` following the agent while `down` stops it,
and the logs after `down`. The controller subprocess also serves its metrics over real HTTP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram.logfmt import TEXT_LINE, parse_line

from .conftest import stop_process
from .test_up_local import tangram as tangram_cli

CLI = [sys.executable, "-c", "from tangram_cli.main import cli; cli()"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANGRAM_")}
    return {**env, **extra}


def _wait_for(path: Path, pattern: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {path}:\n{text[-3000:]}")


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - 127.0.0.1 only
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not served")


def _run_pair(tmp: Path, env: dict[str, str], *agent_flags: str) -> tuple[str, str, dict[str, Any]]:
    """`tangram controller --metrics-port 0` and `python -m agent` as processes; one exec through them.
    Returns both logs (stderr) and the controller's ready line."""
    tmp.mkdir()
    clog, alog = tmp / "controller.log", tmp / "agent.log"
    with open(clog, "wb") as err:
        ctl = subprocess.Popen(
            [*CLI, "controller", "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=err, env=env
        )
    agent = None
    try:
        assert ctl.stdout is not None
        ready = json.loads(ctl.stdout.readline())
        with open(alog, "wb") as err:
            argv = [sys.executable, "-m", "agent", "--controller", ready["agents_addr"], "--name", "n1"]
            argv += [
                "--workdir",
                str(tmp / "work"),
                "--executor",
                "process",
                "--cpus",
                "0",
                "--heartbeat",
                "0.5",
            ]
            agent = subprocess.Popen([*argv, *agent_flags], stdout=err, stderr=err, env=env)
        deadline = time.monotonic() + 60
        while _metric(ready["metrics_addr"], "tangram_agents_up") < 1:
            assert time.monotonic() < deadline, alog.read_text()[-3000:]
            time.sleep(0.2)
        with tangram.Client(ready["submit_addr"], name="logs-test") as tg, tg.sandbox() as sb:
            assert sb.exec("echo hi", cpus=1).stdout == "hi\n"
        ok = 'tangram_actions_finished_total{kind="exec",outcome="ok"}'
        assert _metric(ready["metrics_addr"], ok) == 1.0
        _wait_for(alog, "welcomed by")
    finally:
        if agent is not None:
            stop_process(agent)
        stop_process(ctl)  # type: ignore[arg-type]
        if ctl.stdout is not None:
            ctl.stdout.close()
    return clog.read_text(), alog.read_text(), ready


def test_controller_and_agent_write_one_format_text_and_json(tmp_path: Path) -> None:
    clog, alog, ready = _run_pair(tmp_path / "text", _env())
    for text, who in ((clog, "controller"), (alog, "agent[n1]")):
        records = [m for m in map(TEXT_LINE.match, text.splitlines()) if m]
        assert records, text
        assert {m["source"] + (f"[{m['node']}]" if m["node"] else "") for m in records} == {who}
        assert all(m["ts"].endswith("Z") for m in records)
    assert re.search(
        r"Z INFO controller tangram\.controller: controller local up: .* metrics http://127", clog
    )
    assert re.search(r"Z INFO agent\[n1\] agent: welcomed by", alog)
    assert ready["metrics_addr"] == f"http://127.0.0.1:{ready['metrics']}/metrics"

    # JSON lines: the controller by the environment, the agent by its flag (over a "text" environment)
    clog, _, _ = _run_pair(tmp_path / "json", _env(TANGRAM_LOG_FORMAT="json"))
    _, alog, _ = _run_pair(tmp_path / "json-flag", _env(TANGRAM_LOG_FORMAT="text"), "--log-format", "json")
    for text, source in ((clog, "controller"), (alog, "agent")):
        docs = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert docs and all({"ts", "level", "source", "logger", "pid", "msg"} <= set(d) for d in docs)
        assert {d["source"] for d in docs} == {source}
        assert all(parse_line(json.dumps(d)) == d for d in docs)
    cdocs = [json.loads(line) for line in clog.splitlines() if line.startswith("{")]
    adocs = [json.loads(line) for line in alog.splitlines() if line.startswith("{")]
    assert any(d["msg"].startswith("controller local up") for d in cdocs)
    assert any(d.get("node") == "n1" and d["msg"].startswith("welcomed by") for d in adocs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tangram_logs_on_a_local_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_LOG_FORMAT", "json")  # `up` hands it to the controller and the agent
    up = tangram_cli("up", "--executor", "process", "--gpus", "0", home=home)
    monkeypatch.delenv("TANGRAM_LOG_FORMAT")
    assert up.returncode == 0, up.stdout + up.stderr
    follower = None
    try:
        ctl = tangram_cli("logs", home=home)  # the controller's, its JSON lines shown as text
        assert ctl.returncode == 0, ctl.stderr
        assert re.search(r"^\S+Z INFO controller tangram\.controller: controller local up", ctl.stdout, re.M)
        raw = (home / "clusters/local/logs/controller.log").read_text()
        assert '"source": "controller"' in raw  # the file holds JSON lines

        as_json = tangram_cli("logs", "controller", "-o", "json", "-n", "3", home=home)
        docs = [json.loads(line) for line in as_json.stdout.splitlines()]
        assert len(docs) == 3 and all("ts" in d or "raw" in d for d in docs)

        agent = tangram_cli("logs", "local", "-n", "2", home=home)
        assert agent.returncode == 0 and len(agent.stdout.splitlines()) == 2
        assert "INFO agent[local] agent: welcomed by" in agent.stdout

        bad = tangram_cli("logs", "nosuch", home=home)
        assert bad.returncode == 2
        assert "no node 'nosuch' in cluster 'local' (known: controller, local)" in bad.stderr

        env = {**os.environ, "TANGRAM_HOME": str(home), "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
        follower = subprocess.Popen(
            [*CLI, "logs", "local", "-f", "-n", "1"], stdout=subprocess.PIPE, text=True, env=env
        )
        lines: list[str] = []
        reader = threading.Thread(
            target=lambda: lines.extend(iter(follower.stdout.readline, "")), daemon=True
        )
        reader.start()
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(lines) == 1  # -n 1, then it waits
        down = tangram_cli("down", home=home)  # the agent logs its shutdown: -f prints it
        assert down.returncode == 0, down.stderr
        deadline = time.monotonic() + 30
        while not any("shutdown requested by the controller" in ln for ln in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.1)
        assert follower.poll() is None  # still following
    finally:
        if follower is not None:
            follower.terminate()
            follower.wait(10)
            follower.stdout.close()  # type: ignore[union-attr]
        tangram_cli("down", home=home)
    after = tangram_cli("logs", "local", "-n", "50", home=home)  # no state.json now: the files remain
    assert after.returncode == 0, after.stderr
    assert "agent local exits" in after.stdout
