from __future__ import annotations

import json

from click.testing import CliRunner

from tangram_cli.main import cli

KEYS = {
    "mean_act_s",
    "p50_act_s",
    "p99_act_s",
    "step_time_s",
    "env_act_s",
    "reward_act_s",
    "total_act_s",
    "queue_share",
    "cpu_busy_core_s",
    "cpu_held_core_s",
    "cpu_util",
    "gpu_busy_s",
    "gpu_util",
    "events",
}


def test_json_is_one_document_keyed_by_policy(tmp_path):
    res = CliRunner().invoke(
        cli,
        [
            "sim",
            "-w",
            "coding",
            "-b",
            "6",
            "-p",
            "tangram",
            "-p",
            "k8s",
            "--json",
            "--journal",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc) == {"tangram", "k8s"}
    for p in doc.values():
        assert set(p) >= KEYS
        assert p["mean_act_s"] > 0
        assert p["batch"] == 6
    assert sorted(f.name for f in tmp_path.iterdir()) == ["coding-k8s.jsonl", "coding-tangram.jsonl"]


def test_table_output_has_ratios():
    res = CliRunner().invoke(
        cli, ["sim", "-w", "mopd", "-b", "8", "-p", "tangram", "-p", "static"], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.output
    assert "static / tangram" in res.stdout
    assert "mean ACT" in res.stdout


def test_bad_policy_and_workload_exit_2_with_a_hint():
    res = CliRunner().invoke(cli, ["sim", "-p", "bogus"])
    assert res.exit_code == 2
    assert "unknown policy" in res.stderr
    assert "To fix" in res.stderr
    res = CliRunner().invoke(cli, ["sim", "-w", "nowhere"])
    assert res.exit_code == 2
    assert "unknown workload" in res.stderr


def test_cluster_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cpu_nodes: 1\ncores_per_node: 16\n")
    res = CliRunner().invoke(cli, ["sim", "-w", "coding", "-b", "4", "--cluster", str(f), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tangram"]["cores"] == 16
    f.write_text("cpu_nodez: 1\n")
    res = CliRunner().invoke(cli, ["sim", "--cluster", str(f)])
    assert res.exit_code == 2
    assert "unknown cluster field" in res.stderr


def test_pool_size_flags_apply_after_the_cluster_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cpu_nodes: 4\ncores_per_node: 16\n")
    res = CliRunner().invoke(
        cli, ["sim", "-w", "coding", "-b", "4", "-p", "tangram", "--cluster", str(f), "--cpu-nodes", "2", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tangram"]["cores"] == 32
    res = CliRunner().invoke(cli, ["sim", "-w", "mopd", "-b", "4", "-p", "tangram", "--gpus", "12", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tangram"]["gpus"] == 12
    res = CliRunner().invoke(cli, ["sim", "--cpu-nodes", "0"])
    assert res.exit_code == 2
