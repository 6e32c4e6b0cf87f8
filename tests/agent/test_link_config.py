"""AgentConfig loading and validation, the argparse and click front ends, and the link's pure helpers."""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from agent.__main__ import main as module_main
from agent.config import AgentConfig, parse_cpulist, parse_mib
from agent.executors.base import PathRejected, SandboxNotFound
from agent.link import Backoff, error_reply, gpu_chunk, peek_request_id, reject_is_retryable, write_pidfile
from tangram import protocol as p
from tangram.errors import ConfigError, ProtocolError
from tangram_cli.main import cli

ADDR = "tcp://127.0.0.1:7700"


def test_defaults_and_resolution(tmp_path):
    cfg = AgentConfig.from_dict({"controller": ADDR, "workdir": str(tmp_path)})
    assert cfg.name and cfg.executor == "auto" and cfg.image == "tangram/hostroot:1"
    assert cfg.pidfile() == str(tmp_path / "agent.pid")
    assert cfg.resolve_cpus([0, 1, 2, 3]) == ([1, 2, 3], [0])
    assert cfg.resolve_cpus([5]) == ([5], [5])  # one core: shared by idle sandboxes and actions
    cfg = AgentConfig.from_dict({"controller": ADDR, "cpus": "0-1", "idle_cpus": [0]})
    assert cfg.resolve_cpus([0, 1, 2]) == ([0, 1], [0])
    with pytest.raises(ConfigError, match="not online"):
        cfg.resolve_cpus([0])


def test_file_and_flag_precedence(tmp_path):
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"controller": ADDR, "name": "from-file", "cpus": "0-3", "gpu_mem_mib": "8GiB",
                                "services": [{"name": "rm", "runtime": "emulated", "model": "m:f",
                                              "gpu_mem_mib": 1}]}))
    cfg = AgentConfig.load(str(path), name="from-flag", cpus=None)
    assert cfg.name == "from-flag" and cfg.cpus == [0, 1, 2, 3] and cfg.gpu_mem_mib == 8192
    assert cfg.services[0]["name"] == "rm"


@pytest.mark.parametrize(("raw", "match"), [
    ({}, "`controller` is required"),
    ({"controller": "127.0.0.1:7700"}, "tcp://HOST:PORT"),
    ({"controller": "tcp://10.1.2.3:7700"}, "loopback"),
    ({"controller": ADDR, "bogus": 1, "other": 2}, r"unknown keys \['bogus', 'other'\]"),
    ({"controller": ADDR, "executor": "podman"}, "executor"),
    ({"controller": ADDR, "cpus": "3-1"}, "cpus"),
    ({"controller": ADDR, "cpus": [1, 1]}, "listed twice"),
    ({"controller": ADDR, "idle_cpus": []}, "idle_cpus"),
    ({"controller": ADDR, "name": "bad name"}, "name"),
    ({"controller": ADDR, "cluster": "Upper"}, "cluster"),
    ({"controller": ADDR, "heartbeat_s": 0}, "heartbeat_s"),
    ({"controller": ADDR, "heartbeat_s": True}, "heartbeat_s"),
    ({"controller": ADDR, "emulated_gpus": -1}, "emulated_gpus"),
    ({"controller": ADDR, "gpu_mem_mib": "lots"}, "gpu_mem_mib"),
    ({"controller": ADDR, "services": [{"runtime": "emulated"}]}, "services"),
    ({"controller": ADDR, "backoff_min_s": 2, "backoff_max_s": 1}, "backoff"),
])
def test_bad_configs_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        AgentConfig.from_dict(raw)


def test_remote_controller_needs_allow_remote():
    assert AgentConfig.from_dict({"controller": "tcp://10.1.2.3:7700", "allow_remote": True}).allow_remote
    assert AgentConfig.from_dict({"controller": "tcp://localhost:7700"}).controller


def test_bad_json_file(tmp_path):
    path = tmp_path / "agent.json"
    path.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        AgentConfig.load(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        AgentConfig.load(str(tmp_path / "missing.json"))


def test_units():  # tangram.units rules (tests/test_units.py has the table)
    assert parse_mib("16GiB") == 16384 and parse_mib("512MiB") == 512 and parse_mib(2048) == 2048
    assert parse_mib("1.5GiB") == 1536 and parse_mib("1TiB") == 1 << 20 and parse_mib("2GB") == 1907
    for bad in ("x", "-1", "1KiB", True, "1.5G", "1T"):
        with pytest.raises(ConfigError):
            parse_mib(bad)
    assert parse_cpulist("0-2,5") == [0, 1, 2, 5] and parse_cpulist([3, 1]) == [1, 3]


def test_units_agree_with_the_client_and_the_inventory():
    """An agent reads "2GB" and "0-3, 8" as `sandbox(mem=...)` and an inventory do (tangram.units)."""
    from tangram.client.aio import parse_mem
    from tangram_cli.inventory import parse_cpuset, parse_size_mib

    cfg = AgentConfig.from_dict({"controller": ADDR, "mem_mib": "2GB", "sandbox_mem_mib": "1.5GiB",
                                 "cpus": "0-3, 8", "idle_cpus": [9]})
    assert cfg.mem_mib == parse_mem("2GB") == parse_size_mib("2GB") == 1907 and cfg.sandbox_mem_mib == 1536
    assert tuple(cfg.cpus) == parse_cpuset("0-3, 8") == (0, 1, 2, 3, 8) and cfg.idle_cpus == [9]
    assert module_main(["--controller", ADDR, "--mem", "2G"]) == 2  # ambiguous: refused like everywhere


def test_module_entry_bad_config_exits_2(capsys):
    assert module_main(["--controller", "tcp://127.0.0.1:1", "--gpu-memory", "lots"]) == 2
    assert "gpu-memory" in capsys.readouterr().err


def test_cli_help_and_errors():
    runner = CliRunner()
    res = runner.invoke(cli, ["agent", "--help"])
    assert res.exit_code == 0 and "--controller" in res.output and "--emulated-gpus" in res.output
    assert "tangram agent --controller tcp://127.0.0.1:7700" in res.output
    res = runner.invoke(cli, ["agent"])
    assert res.exit_code == 2 and "--controller" in res.output
    res = runner.invoke(cli, ["agent", "--controller", "tcp://127.0.0.1:1", "--cpus", "z"])
    assert res.exit_code == 2 and "cpus" in res.output


def test_backoff_is_jittered_and_capped():
    b = Backoff(0.1, 5.0, random.Random(1))
    delays = [b.next() for _ in range(12)]
    assert 0.05 <= delays[0] <= 0.1 and all(d <= 5.0 for d in delays) and max(delays) >= 2.5
    b.reset()
    assert b.next() <= 0.1


def test_helpers():
    assert reject_is_retryable("duplicate live name")
    assert not reject_is_retryable("agent speaks 2, controller 1")
    assert peek_request_id([b"TGR1", b"\x45", (9).to_bytes(8, "big"), b""]) == 9
    assert peek_request_id([b"x"]) == 0 and peek_request_id([b"a", b"b", b"\xff" * 8]) == 0
    assert gpu_chunk([2, 3]) == (2, 4)
    for bad in ([], [0, 2], [1, 0]):
        with pytest.raises(Exception, match="consecutive"):
            gpu_chunk(bad)


@pytest.mark.parametrize(("exc", "code"), [
    (SandboxNotFound("no sandbox"), "SANDBOX_LOST"),
    (PathRejected("escape"), "BAD_REQUEST"),
    (ValueError("bad cores"), "BAD_REQUEST"),
    (ProtocolError(p.ProtocolErrorKind.SCHEMA, "x"), "BAD_REQUEST"),
    (TimeoutError(), "TIMEOUT"),
    (OSError(28, "No space left"), "INTERNAL"),
    (RuntimeError("bug"), "INTERNAL"),
])
def test_error_mapping(exc, code):
    err = error_reply(exc)
    assert isinstance(err, p.Error) and err.code == code


def test_gpu_error_mapping():
    g = pytest.importorskip("agent.gpu.base")
    assert error_reply(g.ServiceError("boom", detail="Traceback ...")).code == "REMOTE_ERROR"
    assert error_reply(g.ServiceError("boom", detail="Traceback ...")).detail == "Traceback ..."
    assert error_reply(g.CallTimeout("slow")).code == "TIMEOUT"
    assert error_reply(g.GpuOutOfMemory("full")).code == "RETRY_LATER"
    assert error_reply(g.UnknownService("who")).code == "BAD_REQUEST"
    assert error_reply(g.LoadFailed("no")).code == "INTERNAL"


def test_pidfile_refuses_a_live_other_agent(tmp_path):
    path = tmp_path / "agent.pid"
    path.write_text("1\n")  # pid 1 is alive
    with pytest.raises(ConfigError, match="another agent"):
        write_pidfile(str(path))
    path.write_text("999999999\n")  # stale
    write_pidfile(str(path))


def test_a_sandbox_without_mem_is_never_unlimited() -> None:
    """Default 4 GiB, at most what the node offers; an explicit sandbox_mem_mib wins."""
    base = {"controller": "tcp://127.0.0.1:5"}
    assert AgentConfig.from_dict(dict(base)).default_sandbox_mem() == 4096
    assert AgentConfig.from_dict(dict(base, mem_mib=1024)).default_sandbox_mem() == 1024
    assert AgentConfig.from_dict(dict(base, mem_mib=65536)).default_sandbox_mem() == 4096
    assert AgentConfig.from_dict(dict(base, mem_mib=65536, sandbox_mem_mib=300)).default_sandbox_mem() == 300
