"""`--plot`: one palette across figures, and the PNG is written (skipped without matplotlib)."""

from __future__ import annotations

import pytest
from test_report import fig6_doc

from tangram.sim import plots


def test_palette_is_one_mapping_per_policy():
    assert plots.colour_of("tangram") == plots.POLICY_COLOURS["tangram"]
    assert plots.colour_of("k8s:8") == plots.colour_of("k8s")
    assert plots.colour_of("fixed-dop:16") == plots.POLICY_COLOURS["fixed-dop"]
    assert plots.colour_of("something-new") == plots.colour_of("something-new")
    named = [plots.colour_of(p) for p in ("tangram", "k8s", "static", "serverless", "fixed-dop:16")]
    assert len(set(named)) == len(named)  # the policies of one figure are told apart


def _rows(workload: str, batch: int, policy: str, scale: float) -> dict:
    return {
        "workload": workload,
        "batch": batch,
        "policy": policy,
        "mean_act_s": 2.0 * scale,
        "total_act_s": 100.0 * scale,
        "env_act_s": 70.0 * scale,
        "reward_act_s": 30.0 * scale,
        "step_time_s": 900.0 * scale,
    }


def _fig6_with_rows() -> dict:
    doc = fig6_doc()
    doc["rows"] = []
    for w, base, scale in (
        ("coding", "k8s", 10.0),
        ("deepsearch", "api-retry+static", 1.0),
        ("mopd", "static", 0.01),
    ):
        doc["rows"] += [_rows(w, 512, "tangram", scale), _rows(w, 512, base, 2 * scale)]
    return doc


def _fig8_cpu() -> dict:
    rows = [
        _rows("coding", b, p, b / 256 * (2 if p == "k8s" else 1))
        for b in (256, 4096)
        for p in ("tangram", "k8s")
    ]
    return {
        "experiment": "fig8-cpu",
        "rows": rows,
        "paper": {"mean_act_x": "3.1 -> 27.7 as the batch grows"},
        "ours": {"mean_act_x_by_batch": {"256": 1.17, "4096": 7.69}},
    }


def test_plots_are_written_with_the_same_colours(tmp_path):
    pytest.importorskip("matplotlib")
    used = {}
    for name, doc in (("fig6", _fig6_with_rows()), ("fig8-cpu", _fig8_cpu())):
        path = tmp_path / f"{name}.png"
        used[name] = plots.plot_experiment(doc, str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert used["fig6"]["tangram"] == used["fig8-cpu"]["tangram"] == plots.POLICY_COLOURS["tangram"]
    assert used["fig6"]["k8s"] == used["fig8-cpu"]["k8s"]
    fig7 = dict(_fig6_with_rows(), experiment="fig7")
    assert plots.plot_experiment(fig7, str(tmp_path / "fig7.png")) == used["fig6"]


def test_run_plot_uses_the_palette(tmp_path):
    pytest.importorskip("matplotlib")
    doc = {p: _rows("coding", 8, p, 1.0) | {"p50_act_s": 1.0, "p99_act_s": 5.0} for p in ("tangram", "k8s")}
    used = plots.plot_runs(doc, str(tmp_path / "runs.png"), "t")
    assert used == {"tangram": plots.colour_of("tangram"), "k8s": plots.colour_of("k8s")}
