"""Agent subprocesses for tests: `python -m agent` against a controller, its log in the workdir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_agent(
    addr: str, workdir: str, *extra: str, env: dict[str, str] | None = None, name: str = "n1"
) -> subprocess.Popen[bytes]:
    """A real agent of node `name` with a 0.5 s heartbeat and `extra` flags; it runs this checkout
    (the repository on PYTHONPATH) and writes `agent.log` in `workdir`."""
    argv = [
        sys.executable,
        "-m",
        "agent",
        "--controller",
        addr,
        "--name",
        name,
        "--workdir",
        workdir,
        "--heartbeat",
        "0.5",
        *extra,
    ]
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    with open(os.path.join(workdir, "agent.log"), "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            argv, stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": path, **(env or {})}, cwd=str(REPO)
        )


def stop_process(proc: subprocess.Popen[bytes], wait_s: float = 10.0) -> None:
    """SIGTERM, up to ``wait_s`` for it to exit, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
