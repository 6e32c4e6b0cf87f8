"""`tangram inventory validate|show` through the real click root (error reporting, exit codes)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tangram_cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
BAD = """\
version: 1
cluster: c1
defaults: {ssh: {prot: 22}}
controller: {bind: 0.0.0.0}
groups:
  g:
    role: cpu
    hosts: ["ok-[1-2]", "bad;host"]
    vars: {image: no, mem: 4G}
"""


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env or {"TANGRAM_INVENTORY": ""})


def test_validate_ok_example():
    r = invoke("inventory", "validate", str(ROOT / "inventory" / "example.yaml"))
    assert r.exit_code == 0, r.output
    assert r.output.startswith(
        "ok: 7 nodes (5 cpu: cpu-[01-04].internal,cpu-legacy; 2 gpu: gpu-[01-02].internal)"
    )


def test_validate_defaults_to_local_then_env(tmp_path):
    r = invoke("inventory", "validate")
    assert r.exit_code == 0 and "ok: 1 node" in r.output and "cluster local" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = invoke("inventory", "validate", env={"TANGRAM_INVENTORY": str(bad)})
    assert r.exit_code == 2


def test_validate_lists_every_error_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = invoke("inventory", "validate", str(bad))
    assert r.exit_code == 2
    out = r.output
    assert "Traceback" not in out
    assert out.startswith(f"error: invalid inventory {bad}: 5 problems")
    for line in (
        "defaults.ssh.prot: unknown key (did you mean 'port'?)",
        "controller.bind: bind '0.0.0.0' listens on every interface",
        "groups.g.hosts[1]: host name 'bad;host' contains ';'",
        "groups.g.vars.image: expected a string, got the boolean false",
        "groups.g.vars.mem: ambiguous unit 'G' in size (write GiB or GB)",
    ):
        assert line in out, out
    assert "To fix: " in out


def test_validate_json(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = invoke("inventory", "validate", "--json", str(bad))
    assert r.exit_code == 2
    data = json.loads(r.stdout)
    assert data["ok"] is False and len(data["errors"]) == 5
    assert {"path": "defaults.ssh.prot", "problem": "unknown key (did you mean 'port'?)"} in data["errors"]
    r = invoke("inventory", "validate", "--json", str(ROOT / "inventory" / "example.yaml"))
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True


def test_missing_file_is_exit_2():
    r = invoke("inventory", "validate", "/nonexistent/inv.yaml")
    assert r.exit_code == 2 and "cannot read inventory" in r.output and "Traceback" not in r.output


def test_show_table_and_json():
    example = str(ROOT / "inventory" / "example.yaml")
    r = invoke("inventory", "show", example)
    assert r.exit_code == 0, r.output
    assert "cluster rl-exp-42" in r.output and "cpu-legacy" in r.output and "10.0.1.17:2222" in r.output
    r = invoke("inventory", "show", "-o", "json", example)
    data = json.loads(r.stdout)
    legacy = next(n for n in data["nodes"] if n["name"] == "cpu-legacy")
    assert legacy["user"] == "ops" and legacy["port"] == 2222 and legacy["cpus"] == "2-63"
    assert legacy["mem_mib"] == 240 * 1024 and legacy["connect_timeout_ms"] == 10_000
    assert json.loads(invoke("inventory", "show", "--json").stdout)["cluster"] == "local"


def test_help_texts():
    for args in (
        ["inventory", "--help"],
        ["inventory", "validate", "--help"],
        ["inventory", "show", "--help"],
    ):
        r = invoke(*args)
        assert (r.exit_code == 0 and "TANGRAM_INVENTORY" in r.output) or "Validate" in r.output
