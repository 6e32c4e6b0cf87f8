"""bootstrap/plan.py: pure builders, checked as strings and argv (plan.py only builds command lines and
scripts; the runners in ssh.py and remote.py execute them)."""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram_cli.bootstrap import plan
from tangram_cli.inventory import load_inventory, local_default

EXAMPLE = "inventory/example.yaml"


def test_probe_argv_and_stdin():
    assert plan.probe_argv("python3") == [
        "python3",
        "-c",
        "import sys,json;exec(json.loads(sys.stdin.readline()))",
    ]
    line = plan.probe_stdin()
    assert line.endswith("\n") and "\n" not in line[:-1]
    assert json.loads(line) == plan.FACTS_SCRIPT


def test_facts_script_runs_with_the_stdlib_and_prints_one_json_line():
    r = subprocess.run(
        plan.probe_argv(sys.executable),
        input=plan.probe_stdin(),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    lines = r.stdout.splitlines()
    assert len(lines) == 1
    facts = json.loads(lines[0])
    for key in (
        "python",
        "arch",
        "cpu_count",
        "online_cpus",
        "numa",
        "mem_total_mib",
        "cgroup",
        "docker",
        "nvidia",
        "disk",
        "errors",
    ):
        assert key in facts
    assert facts["errors"] == {}


def test_bundle_hash_is_order_free_and_unambiguous():
    a = {"a.py": b"1", "wheels/x.whl": b"22"}
    assert plan.bundle_hash(a) == plan.bundle_hash(dict(reversed(list(a.items()))))
    assert plan.bundle_hash(a) != plan.bundle_hash({"a.py": b"1", "wheels/x.whl": b"23"})
    assert plan.bundle_hash({"ab": b"c"}) != plan.bundle_hash({"a": b"bc"})  # path/bytes boundary
    assert plan.bundle_hash({"a": b"1"}) != plan.bundle_hash({"b": b"1"})
    assert len(plan.bundle_hash({})) == 64


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.binary(max_size=16), max_size=5))
def test_bundle_hash_depends_only_on_content(files):
    assert plan.bundle_hash(files) == plan.bundle_hash(dict(sorted(files.items(), reverse=True)))


def test_start_command_exact():
    cmd = plan.start_command("~/.tangram/c1", "~/.tangram/c1/venv-0123")
    assert cmd == (
        'cd "$HOME"/.tangram/c1 && flock -n agent.lock setsid -f "$HOME"/.tangram/c1/venv-0123/bin/python'
        " -m agent --config agent.json </dev/null >>agent.log 2>&1"
    )
    cmd = plan.start_command("/srv/tangram x", "/srv/v")
    assert cmd.startswith("cd '/srv/tangram x' && ")


def test_paths_are_quoted_but_home_expands():
    assert plan.sh_path("~") == '"$HOME"'
    assert plan.sh_path("~/a b") == "\"$HOME\"/'a b'"
    assert plan.sh_path("/x;rm -rf /") == "'/x;rm -rf /'"
    assert plan.sftp_path("~/.tangram/x") == ".tangram/x" and plan.sftp_path("/abs") == "/abs"
    # the shell sees one word whatever the path holds
    for p in ["/a b", "/a'b", "/$(id)", "/`x`"]:
        assert shlex.split(f"ls {plan.sh_path(p)}") == ["ls", p]


def test_stop_command_checks_the_pid():
    cmd = plan.stop_command("~/.tangram/c1")
    assert cmd.startswith('pid=$(cat "$HOME"/.tangram/c1/agent.pid 2>/dev/null) && ')
    assert cmd.endswith('kill -TERM "$pid"')
    with pytest.raises(ValueError, match="signal"):
        plan.stop_command("/x", signal="HUP; rm -rf /")


def test_stop_command_runs(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "agent.pid").write_text(f"{proc.pid}\n")
        subprocess.run(["sh", "-c", plan.stop_command(str(tmp_path))], check=True, timeout=10)
        assert proc.wait(timeout=10) == -15
        (tmp_path / "agent.pid").write_text("1; rm -rf /\n")
        r = subprocess.run(["sh", "-c", plan.stop_command(str(tmp_path))], capture_output=True, text=True)
        assert r.returncode == 3 and "no agent pid" in r.stderr
    finally:
        proc.kill()
        proc.wait()


def test_install_command_is_idempotent_and_offline():
    cmd = plan.install_command("python3", "~/.t/c/bundles/h", "~/.t/c/venv-h")
    assert cmd.startswith(
        'test -f "$HOME"/.t/c/venv-h/.complete || { python3 -m venv "$HOME"/.t/c/venv-h && '
    )
    assert "--no-index --find-links" in cmd and cmd.endswith('touch "$HOME"/.t/c/venv-h/.complete; }')
    site = plan.install_command("python3", "/b", "/v", system_site_packages=True)
    assert "--system-site-packages --without-pip" in site and "pip install" not in site


def test_pip_install_uses_the_nodes_pip_or_ensurepip():
    cmd = plan.pip_install_command("~/.t/c/venv-h", ["pyzmq", "msgpack"])
    vpy = '"$HOME"/.t/c/venv-h/bin/python'
    assert cmd == (
        f"{{ {vpy} -m pip --version >/dev/null 2>&1 || {vpy} -m ensurepip --default-pip >/dev/null; }} && "
        f"{vpy} -m pip install --quiet pyzmq msgpack"
    )


def test_node_check_names_the_files_that_differ():
    seen = plan.NodeCheck("/root", False, {"agent.json": hashlib.sha256(b"{}").hexdigest()}, "", False)
    assert seen.differing({"agent.json": b"{}", "controller.key": b"k"}) == ["controller.key"]
    assert seen.differing({"agent.json": b"{ }"}) == ["agent.json"]


def test_purge_command_removes_the_run_directory_and_an_empty_parent(tmp_path):
    run = tmp_path / "work" / "c"
    (run / "bundles").mkdir(parents=True)
    (run / "agent.key_secret").write_text("s")
    out = subprocess.run(["sh", "-c", plan.purge_command(str(run))], capture_output=True, text=True)
    assert out.stdout.strip() == "gone" and not (tmp_path / "work").exists()
    assert 'rmdir -- "$HOME"/w' in plan.purge_command("~/w/c") and "rmdir" not in plan.purge_command("~/c")


def test_host_plan_steps_and_dry_run():
    inv = load_inventory(EXAMPLE)
    digest = plan.bundle_hash({"agent.pyz": b"x"})
    plans = plan.plan(inv.nodes, inv.cluster, digest)
    assert len(plans) == len(inv.nodes)
    legacy = next(p for p in plans if p.node == "cpu-legacy")
    assert [s.name for s in legacy.steps] == list(plan.STEP_NAMES)
    assert legacy.destination == "ops@10.0.1.17:2222"
    assert legacy.steps[1].command is None and "agent.pid" in legacy.steps[1].summary  # check: SFTP, no shell
    assert legacy.steps[2].command == "python3 -c 'import sys,json;exec(json.loads(sys.stdin.readline()))'"
    assert f"bundles/{digest}" in legacy.steps[3].summary
    text = plan.render(plans, verbose=True)
    assert text.startswith(f"bootstrap plan: {len(plans)} host(s), bundle {digest[:12]}")
    for name in plan.STEP_NAMES:
        assert f". {name}" in text
    assert "$ cd " in text


def test_local_nodes_need_no_ssh_plan():
    inv = local_default()
    assert plan.plan(inv.nodes, inv.cluster, "0" * 64) == []
    assert "nothing to bootstrap" in plan.render([])


def test_ipv6_destination():
    inv = load_inventory(
        "version: 1\ncluster: c\ncontroller: {bind: '::1'}\n"
        "groups: {g: {role: cpu, hosts: ['[fd00::1]:2222', 'ops@[fd00::2]']}}\n"
    )
    plans = plan.plan(inv.nodes, "c", "0" * 64)
    assert plans[0].destination.endswith("@[fd00::1]:2222")
    assert plans[1].destination == "ops@[fd00::2]:22"


def test_teardown_command_stops_the_agent_then_purges(tmp_path):
    run = tmp_path / "work" / "c"
    run.mkdir(parents=True)
    (run / "agent.json").write_text(json.dumps({"cluster_id": "0123456789ab"}, indent=2))
    (run / "agent.key_secret").write_text("s")
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "agent"])
    try:
        (run / "agent.pid").write_text(f"{agent.pid}\n")
        cmd = plan.teardown_command(str(run), "", purge=True)
        assert "cid=$(sed -n" in cmd and "label=tangram.cluster=" not in cmd
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
        assert out.stdout.split() == ["agent=stopped", "gone"], out.stderr
        assert agent.wait(timeout=5) is not None and not (tmp_path / "work").exists()
    finally:
        agent.kill()
        agent.wait()
    again = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert again.stdout.split() == ["gone"]  # idempotent: nothing left, nothing running
    keep = plan.teardown_command("~/w/c", "0123456789ab", purge=False)
    assert "cid='0123456789ab'" in keep or "cid=0123456789ab" in keep
    assert "rm -rf" not in keep
