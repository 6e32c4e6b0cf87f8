"""The `tangram` command line as a subprocess, for tests that drive a real local cluster.

* ``tangram(*args, home=...)``: one `tangram` run with TANGRAM_HOME set to ``home`` and every other
  TANGRAM_* that picks a cluster removed (``clean_env``), so nothing touches the real ~/.tangram.
* ``local_cluster(home, *up_args)``: `tangram up` (the local default) on entry, `tangram down` on
  exit; both must exit 0.
* ``run_up(home, monkeypatch, *args)``: `tangram up` in this process (click's runner), with the
  same environment rules (set through ``monkeypatch``).

Imported as ``support.cli`` (tests/conftest.py puts tests/ on sys.path): not through the ``tests``
package, which a verl wheel shadows with a top-level ``tests`` package of its own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-c", "from tangram_cli.main import cli; cli()"]
CLUSTER_VARS = ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER", "TANGRAM_CERTS")


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment with TANGRAM_HOME=``home``, NO_COLOR, and no other cluster choice."""
    env = {**os.environ, "TANGRAM_HOME": str(home), "NO_COLOR": "1"}
    for var in CLUSTER_VARS:
        env.pop(var, None)
    return env


def tangram(*args: str, home: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=clean_env(home), timeout=timeout, check=False
    )


@contextlib.contextmanager
def local_cluster(home: Path, *up_args: str) -> Iterator[Path]:
    """A running local cluster (`tangram up --executor process UP_ARGS`) under ``home``, brought down
    at the end; yields ``home``."""
    up = tangram("up", "--executor", "process", *up_args, home=home, timeout=90)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield home
    finally:
        down = tangram("down", home=home, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr


def run_up(home: Path, monkeypatch: Any, *args: str) -> Any:
    """`tangram up ARGS` through click's runner, TANGRAM_HOME at ``home``, no other cluster variable."""
    from click.testing import CliRunner

    from tangram_cli.main import cli

    monkeypatch.setenv("TANGRAM_HOME", str(home))
    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    return CliRunner().invoke(cli, ["up", *args], catch_exceptions=False)
