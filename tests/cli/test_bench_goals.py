"""PASS/FAIL of the benchmarks against their goals, on fixed inputs (no timing is measured or
asserted here)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tangram_cli.bench import burst, dispatch, goals, scale, scheduler
from tangram_cli.main import cli


def test_word_summary_and_overall():
    assert goals.word(True) == "PASS" and goals.word(False) == "FAIL"
    assert goals.word(None) == "-"
    assert goals.at_most(1.0, 1.0) is True and goals.at_most(1.01, 1.0) is False
    assert goals.at_least(700, 700) is True and goals.at_least(699, 700) is False
    assert goals.at_most(None, 1.0) is None and goals.at_most(True, 1.0) is None
    assert goals.summary({"a": True, "b": True}) == "goals: PASS (2 of 2 met)"
    text = goals.summary({"a": True, "b": False, "c": None})
    assert text == "goals: FAIL (1 of 2 missed: b); not measured: c"
    assert goals.overall({"a": True, "b": None}) is True
    assert goals.overall({"a": True, "b": False}) is False
    assert goals.overall({"a": None}) is None


def _rows(p99_1024: float, worst_ratio: float) -> list[dict]:
    return [
        {"queued": 128, "p99_ms": 0.5, "p99_ratio": 1.0},
        {"queued": 1024, "p99_ms": p99_1024, "p99_ratio": worst_ratio},
    ]


def test_scheduler_goals():
    ok = goals.scheduler_goals(_rows(0.9, 1.8))
    assert {k: g["met"] for k, g in ok.items()} == {"p99_ms_at_1024": True, "p99_ratio_max": True}
    bad = goals.scheduler_goals(_rows(2.7, 2.5))
    assert {k: g["met"] for k, g in bad.items()} == {"p99_ms_at_1024": False, "p99_ratio_max": False}
    assert bad["p99_ms_at_1024"]["measured"] == 2.7
    missing = goals.scheduler_goals([{"queued": 128, "p99_ms": 0.5, "p99_ratio": 1.0}])
    assert missing["p99_ms_at_1024"]["met"] is None


def _fixed_measure(monkeypatch, p99_1024: float):
    def fake(queued, steps, seed=0, depth=2):
        p99 = 0.5 if queued == 128 else p99_1024
        return {
            "queued": queued,
            "calls": steps,
            "p50_ms": 0.1,
            "p99_ms": p99,
            "max_ms": p99,
            "mean_ms": 0.1,
            "cpu_p50_ms": 0.1,
            "cpu_p99_ms": p99,
            "running": 1,
        }

    monkeypatch.setattr(scheduler, "measure", fake)


def test_bench_scheduler_prints_pass_fail(monkeypatch):
    _fixed_measure(monkeypatch, 2.0)  # p99 2 ms at 1024 (FAIL), ratio 4 (FAIL)
    res = CliRunner().invoke(cli, ["bench", "scheduler", "--queued", "128", "--queued", "1024"])
    assert res.exit_code == 0, res.output
    assert "FAIL p99_ms_at_1024" in res.output and "FAIL p99_ratio_max" in res.output
    assert "goals: FAIL (2 of 2 missed" in res.output
    _fixed_measure(monkeypatch, 0.8)
    res = CliRunner().invoke(cli, ["bench", "scheduler", "--queued", "128", "--queued", "1024"])
    assert "PASS p99_ms_at_1024" in res.output and "goals: PASS" in res.output


def test_bench_scheduler_json_has_met(monkeypatch):
    _fixed_measure(monkeypatch, 0.8)
    res = CliRunner().invoke(cli, ["bench", "scheduler", "--queued", "128", "--queued", "1024", "-o", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["met"] == {"p99_ms_at_1024": True, "p99_ratio_max": True}
    assert doc["goal_p99_ms_at_1024"] == 1.0  # the old keys stay


def _burst_doc(**over) -> dict:
    doc = {
        "actions": 100,
        "completed": 100,
        "failed": {},
        "answered_once_ok": True,
        "agent": "instant bench agent",
        "actions_per_s": 6000.0,
        "resent_fraction": 0.0,
        "controller": {"rss_peak_mib": 120, "status": {"answer_max_s": 0.2}},
    }
    doc.update(over)
    return doc


def test_burst_goals():
    met = burst.goals_met(_burst_doc())
    assert all(met.values()), met
    slow = burst.goals_met(_burst_doc(actions_per_s=900.0, completed=99))
    assert slow["instant_actions_per_s"] is False and slow["all_completed"] is False
    real = burst.goals_met(_burst_doc(agent="python -m agent --executor process", actions_per_s=900.0))
    assert real["instant_actions_per_s"] is None  # the rate goal is for the instant agent only
    big = burst.goals_met(_burst_doc(controller={"rss_peak_mib": 301, "status": {"answer_max_s": 1.5}}))
    assert big["controller_rss_peak_mib"] is False and big["status_answer_max_s"] is False


def test_scale_goals():
    doc = {
        "all_completed": True,
        "failed": {},
        "answered_once_ok": True,
        "controller": {
            "decide": {"p99_ms": 1.5},
            "status": {"decide_p99_max_ms": 2.5, "answer_max_s": 0.3},
            "counters": {"agents_lost": 0},
            "agent_restarts": 0,
        },
    }
    met = scale.goals_met(doc)
    assert met["decide_p99_ms"] is True and met["decide_p99_ms_highest_sample"] is False
    assert met["no_agent_lost"] is True and met["all_completed"] is True


def test_dispatch_goals_per_executor():
    process = {
        "executor": "process",
        "latency_p50_ms": 2.0,
        "throughput_actions_per_s": 800,
        "ratio_to_raw_spawn": 1.4,
    }
    assert dispatch.goals_met(process) == {
        "throughput_actions_per_s": False,
        "ratio_to_raw_spawn": True,
        "latency_p50_ms": True,
    }
    docker = {"executor": "docker", "throughput_actions_per_s": 800}
    assert dispatch.goals_met(docker) == {"throughput_actions_per_s": True, "latency_p50_ms": None}
