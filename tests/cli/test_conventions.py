"""The command line's conventions (docs/cli.md, "Conventions"), checked on every command through
click's CliRunner: one output flag, one meaning per short flag, one duration syntax, one name for
GPU memory, -v/-q everywhere, suggestions for unknown commands. Nothing here starts a cluster."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tangram_cli.main import cli
from tangram_cli.params import Duration

# every command that prints data: it takes -o/--output
DATA_COMMANDS = [
    ("up",),
    ("down",),
    ("status",),
    ("env",),
    ("logs",),
    ("demo",),
    ("sim",),
    ("keys", "add"),
    ("keys", "list"),
    ("inventory", "validate"),
    ("inventory", "show"),
    ("bench", "scheduler"),
    ("bench", "dispatch"),
    ("bench", "burst"),
    ("bench", "scale"),
    ("bench", "chaos"),
    ("bench", "pool"),
]
ALL_COMMANDS = [
    *DATA_COMMANDS,
    ("controller",),
    ("agent",),
    ("keys", "revoke"),
    ("keys",),
    ("inventory",),
    ("bench",),
]


def test_every_command_is_covered_here() -> None:
    """A command added to `tangram` must be listed above, so the conventions are checked on it."""
    from tangram_cli.main import COMMANDS

    assert set(COMMANDS) <= {path[0] for path in ALL_COMMANDS}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_HOME", str(h))
    for var in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER", "TANGRAM_DEBUG", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)
    return h


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def command_of(path: tuple[str, ...]) -> click.Command:
    ctx = click.Context(cli)
    cmd: Any = cli
    for name in path:
        cmd = cmd.get_command(ctx, name)
    return cmd


def parsed(path: tuple[str, ...], *args: str) -> dict[str, Any]:
    """The parameters ``args`` parse to, without running the command."""
    cmd = command_of(path)
    with cmd.make_context(path[-1], list(args)) as ctx:
        return dict(ctx.params)


# ---------------------------------------------------------------- 1. -o/--output everywhere


@pytest.mark.parametrize("path", DATA_COMMANDS, ids=" ".join)
def test_every_data_command_takes_dash_o(path: tuple[str, ...]) -> None:
    r = run(*path, "--help")
    assert r.exit_code == 0, r.output
    assert "-o, --output" in r.stdout
    assert "json" in r.stdout.split("-o, --output", 1)[1].split("\n", 1)[0]
    assert "--json" not in r.stdout  # the old flag is hidden


def test_old_json_flag_still_works(home: Path) -> None:
    r = run("inventory", "show", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["cluster"] == "local"
    r = run("inventory", "validate", "--json")
    assert json.loads(r.stdout)["ok"] is True
    r = run("inventory", "validate", "-o", "json")
    assert json.loads(r.stdout)["ok"] is True
    for flag in (["--json"], ["-o", "json"]):
        r = run("bench", "scheduler", "-n", "20", "--queued", "16", *flag)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["scheduler"][0]["queued"] == 16


def test_sim_takes_dash_o_json(home: Path) -> None:
    r = run("sim", "--workload", "coding", "-b", "2", "-p", "tangram", "-o", "json")
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)) == {"tangram"}


def test_down_and_env_print_json(home: Path) -> None:
    r = run("down", "-o", "json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["cluster"] == "local" and doc["found"] is False and doc["exit_code"] == 0
    assert "nothing is running" in doc["messages"][0]
    r = run("env", "-o", "json")
    assert r.exit_code == 4  # no cluster: the same error, whatever the format
    assert r.stdout == ""


# ---------------------------------------------------------------- 2. -w is --watch


def test_dash_w_means_watch_and_sim_workload_has_no_short_flag(home: Path) -> None:
    assert "-w, --watch" in run("status", "--help").stdout
    sim_help = run("sim", "--help").stdout
    assert "--workload" in sim_help
    assert "-w," not in sim_help
    for path in ALL_COMMANDS:  # no command gives -w another visible meaning
        text = run(*path, "--help").stdout
        assert "-w," not in text or "-w, --watch" in text, path
    r = run("sim", "-w", "coding", "-b", "2", "-p", "tangram", "-o", "json")  # old scripts still run
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tangram"]["batch"] == 2


# ---------------------------------------------------------------- 3. durations


def test_duration_type_reads_the_units_syntax() -> None:
    d = Duration(0.1, 3600)
    for text, seconds in (
        ("20", 20.0),
        ("20.5", 20.5),
        ("20s", 20.0),
        ("500ms", 0.5),
        ("1.5m", 90.0),
        ("1h", 3600.0),
    ):
        assert d.convert(text, None, None) == seconds
    assert d.convert(20, None, None) == 20.0
    for bad, why in (("10sec", "unknown unit"), ("-1", "negative"), ("2h", "maximum"), ("0", "minimum")):
        with pytest.raises(click.BadParameter, match=why):
            d.convert(bad, None, None)


@pytest.mark.parametrize(
    "path,flag",
    [
        (("up",), "--timeout"),
        (("down",), "--timeout"),
        (("status",), "--watch"),
        (("controller",), "--client-grace"),
        (("controller",), "--heartbeat"),
        (("agent",), "--orphan-timeout"),
        (("bench", "burst"), "--timeout"),
        (("bench", "scale"), "--timeout"),
        (("bench", "chaos"), "--timeout"),
        (("bench", "pool"), "--gap"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_every_duration_flag_takes_units_and_plain_seconds(path: tuple[str, ...], flag: str) -> None:
    name = {"--client-grace": "client_grace", "--orphan-timeout": "orphan_timeout"}.get(flag, flag[2:])
    name = "timeout_s" if path == ("up",) else name
    assert parsed(path, flag, "30s")[name] == 30.0
    assert parsed(path, flag, "30")[name] == 30.0
    if flag != "--heartbeat":
        assert parsed(path, flag, "1m")[name] == 60.0


def test_down_timeout_with_a_unit_and_a_bad_one(home: Path) -> None:
    r = run("down", "--timeout", "20s")
    assert r.exit_code == 0, r.output
    r = run("down", "--timeout", "20.0")
    assert r.exit_code == 0
    r = run("down", "--timeout", "10sec")
    assert r.exit_code == 2
    assert "unknown unit 'sec'" in r.stderr


# ---------------------------------------------------------------- 4. --gpu-mem


def test_gpu_mem_is_one_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import agent.link

    assert "--gpu-mem SIZE" in run("up", "--help").stdout
    agent_help = run("agent", "--help").stdout
    assert "--gpu-mem SIZE" in agent_help
    assert "--gpu-memory" not in agent_help
    seen: list[Any] = []
    monkeypatch.setattr(agent.link, "main", lambda cfg: seen.append(cfg) or 0)
    base = ["agent", "--controller", "tcp://127.0.0.1:1", "--emulated-gpus", "1", "--workdir", str(tmp_path)]
    assert run(*base, "--gpu-mem", "4GiB").exit_code == 0
    assert run(*base, "--gpu-memory", "2GiB").exit_code == 0  # the old name, hidden
    assert [c.gpu_mem_mib for c in seen] == [4096, 2048]


# ---------------------------------------------------------------- 5. -v / -q everywhere


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=" ".join)
def test_every_command_takes_v_and_q(path: tuple[str, ...]) -> None:
    r = run(*path, "-v", "-vv", "-q", "--no-color", "--help")
    assert r.exit_code == 0, r.output
    assert "-v, --verbose" in r.stdout and "-q, --quiet" in r.stdout


def test_status_v_is_accepted_and_vv_after_the_command_shows_tracebacks(home: Path) -> None:
    r = run("status", "-v")
    assert r.exit_code == 4  # no cluster; not a usage error
    assert "no cluster named 'local'" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("status", "-vv")
    assert r.exit_code == 4
    assert "Traceback" in r.stderr
    r = run("-v", "status", "-v")  # counts add up
    assert "Traceback" in r.stderr


def test_quiet_drops_progress_lines(home: Path) -> None:
    r = run("-q", "sim", "--workload", "coding", "-b", "2", "-p", "tangram")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    assert "mean ACT" in r.stdout


# ---------------------------------------------------------------- 6. unknown commands


def test_unknown_command_suggests_the_closest(home: Path) -> None:
    r = run("stauts")
    assert r.exit_code == 2
    assert "No such command 'stauts'. Did you mean 'status'?" in r.stderr
    r = run("dwon")
    assert r.exit_code == 2 and "Did you mean 'down'?" in r.stderr
    r = run("frobnicate")
    assert r.exit_code == 2 and "No such command 'frobnicate'." in r.stderr and "Did you mean" not in r.stderr
    r = run("keys", "lsit")
    assert r.exit_code == 2 and "Did you mean 'list'?" in r.stderr


def test_unknown_command_in_a_real_process() -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", "from tangram_cli.main import cli; cli()", "stauts"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert "Did you mean 'status'?" in r.stderr
