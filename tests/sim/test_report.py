"""`tangram sim --experiment`: the comparison with the paper and the [i/N] progress, on
fixed documents (no simulation runs here)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tangram.sim import report
from tangram_cli.main import cli


def fig6_doc() -> dict:
    ours = {
        "coding": {
            "baseline": "k8s",
            "batch": 2048,
            "total_act_x": 4.73,
            "env_act_x": 5.21,
            "reward_act_x": 1.86,
            "mean_act_x": 3.0,
            "step_x": 2.48,
            "baseline_failed_calls": 0,
        },
        "deepsearch": {
            "baseline": "api-retry+static",
            "batch": 512,
            "total_act_x": 1.0,
            "env_act_x": 1.0,
            "reward_act_x": 0.81,
            "mean_act_x": 0.9,
            "step_x": 1.01,
            "baseline_failed_calls": 2558,
        },
        "mopd": {"baseline": "static", "batch": 2048, "step_x": 1.0, "baseline_failed_calls": 0},
    }
    paper = {
        "coding": {"total_act_x": 4.3, "env_act_x": 9.0, "reward_act_x": 2.8, "step_x": 1.4},
        "deepsearch": {"step_x": 1.5},
        "mopd": {"step_x": "smaller (long-tail bound)"},
    }
    row = {"workload": "coding", "batch": 2048, "policy": "tangram", "mean_act_s": 1.0}
    return {"experiment": "fig6", "rows": [row], "paper": paper, "ours": ours}


def by_result(rows: list[report.Row]) -> dict[str, report.Row]:
    return {r.result.split(" (")[0]: r for r in rows}


def test_judge_uses_the_stated_tolerance():
    assert report.TOLERANCE == 0.25
    assert report.judge(4.73, 4.3).check == report.OK  # 1.10
    assert report.judge(5.21, 9.0, "why").check == report.OFF  # 0.58
    assert report.judge(5.21, 9.0, "why").note == "why"
    assert report.judge(1.26, 1.0).check == report.OFF
    assert report.judge(0.76, 1.0).check == report.OK
    text = report.judge(1.0, "smaller")
    assert text.check == report.INFO and text.ratio is None
    assert report.judge(None, 3.0).check == report.OFF


def test_fig6_flags_deepsearch_step_and_failed_calls_with_reasons():
    rows = by_result(report.compare(fig6_doc()))
    step = rows["deepsearch step time x"]
    assert step.check == report.OFF
    assert step.ratio == pytest.approx(1.01 / 1.5)
    assert "§4.3" in step.note
    failed = rows["deepsearch baseline failed actions"]
    assert failed.check == report.OFF and failed.ours == 2558 and "§4.3" in failed.note
    assert rows["coding total ACT x"].check == report.OK
    assert rows["coding env-interaction ACT x"].check == report.OFF
    assert "§4" in rows["coding env-interaction ACT x"].note
    assert rows["mopd step time x"].check == report.INFO
    assert "coding baseline failed actions" not in rows  # none failed: no row


def test_every_off_row_has_a_reason():
    for r in report.compare(fig6_doc()):
        if r.check == report.OFF:
            assert r.note, r.result


def test_progress_counts_and_estimates():
    lines: list[str] = []
    t = iter([0.0, 10.0, 30.0, 60.0])
    p = report.RunProgress(3, lines.append, clock=lambda: next(t))
    for name in ("a", "b", "c", "d"):
        p.note(name)
    assert lines[0].startswith("[1/3] a (ETA after the first run")
    assert lines[1] == "[2/3] b (ETA 20s)"  # 10 s per run, 2 left (this one included)
    assert lines[2] == "[3/3] c (ETA 15s)"  # 15 s per run, 1 left
    assert lines[3].startswith("[4/4] d")  # more runs than planned: N grows


def test_planned_runs_match_the_experiments():
    assert report.planned_runs("fig6") == 8
    assert report.planned_runs("fig8-cpu") == 10
    assert report.planned_runs("fig8-gpu") == 12 + 19
    assert report.planned_runs("fig9") == 10 + 6  # the 15-node pair at 1280 is reused
    assert report.planned_runs("fig9", cpu_nodes=3) == 10 + 8
    assert report.planned_runs("table1") == 6


def _fake_run(monkeypatch):
    from tangram.sim import experiments

    def fake(name, seed, spec, note, batch=None):
        for w in ("coding", "deepsearch"):
            note(f"fig6 {w}")
        return fig6_doc()

    monkeypatch.setattr(experiments, "run_experiment", fake)


def test_cli_prints_side_by_side_table_and_progress(monkeypatch):
    _fake_run(monkeypatch)
    res = CliRunner().invoke(cli, ["sim", "--experiment", "fig6"])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "ours vs the paper" in out and "±25%" in out
    assert "OFF" in out and "§4.3" in out
    assert '"paper"' not in out  # no raw JSON dump any more
    assert "…" not in out  # cells fold, nothing is cut
    assert "[1/8] fig6 coding" in res.stderr and "[2/8]" in res.stderr and "ETA" in res.stderr


def test_cli_quiet_has_no_progress(monkeypatch):
    _fake_run(monkeypatch)
    res = CliRunner().invoke(cli, ["-q", "sim", "--experiment", "fig6"])
    assert res.exit_code == 0, res.output
    assert "[1/8]" not in res.stderr


def test_cli_json_keeps_the_document_and_adds_the_comparison(monkeypatch):
    _fake_run(monkeypatch)
    res = CliRunner().invoke(cli, ["sim", "--experiment", "fig6", "-o", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["paper"]["deepsearch"]["step_x"] == 1.5
    flagged = {r["result"].split(" (")[0] for r in doc["vs_paper"] if r["check"] == "OFF"}
    assert "deepsearch step time x" in flagged


def test_other_experiments_compare_on_their_document_shapes():
    fig8_cpu = {
        "experiment": "fig8-cpu",
        "ours": {"mean_act_x_by_batch": {"256": 1.17, "1024": 2.78, "4096": 7.69}},
    }
    rows = report.compare(fig8_cpu)
    assert [r.check for r in rows] == [report.OFF, report.INFO, report.OFF]  # paper: 3.1 -> 27.7
    fig8_gpu = {
        "experiment": "fig8-gpu",
        "paper": {"vs_static_x_at_2048": 18.1, "gpu_share_for_equal_act": 0.29},
        "ours": {
            "by_batch": {
                "256": {"vs_static_x": 2.2, "vs_serverless_x": 1.0},
                "2048": {"vs_static_x": 16.4, "vs_serverless_x": 2.16},
            },
            "gpu_share_of_static_for_equal_act": 0.56,
        },
    }
    rows = by_result(report.compare(fig8_gpu))
    assert rows["mopd mean ACT x vs static, batch 2048"].check == report.OK  # 16.4 / 18.1 = 0.91
    assert rows["serverless at batch 2048"].check == report.OFF
    assert "§4.4" in rows["GPU share for static's ACT"].note
    fig9 = {
        "experiment": "fig9",
        "paper": {"vs_fixed16_x_at_1280": 3.0},
        "ours": {"1280": {"mean_act_x": 1.0}, "batch_1280_by_cpu_nodes": {"4": {"mean_act_x": 1.33}}},
    }
    rows = report.compare(fig9)
    assert rows[0].check == report.OFF and "§4.1" in rows[0].note
    assert rows[1].check == report.INFO
    table1 = {
        "experiment": "table1",
        "ours": {"coding@256": {"overhead_share": 0.0008}, "mopd@256": {"overhead_share": 0.12}},
    }
    rows = report.compare(table1)
    assert rows[0].check == report.OK and rows[0].paper == "< 0.03"
    assert rows[1].check == report.OFF
