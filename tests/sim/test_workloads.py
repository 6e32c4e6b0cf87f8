"""The shipped workloads: they load, plans are deterministic, and every value has a source comment."""

from __future__ import annotations

from importlib import resources

import pytest

from tangram.errors import ConfigError
from tangram.sim import workloads

FILES = sorted(
    p.name for p in resources.files("tangram.sim").joinpath("workloads").iterdir() if p.name.endswith(".yaml")
)


def test_every_shipped_workload_loads_and_generates():
    assert FILES == [
        "coding.yaml", "coding_burst.yaml", "coding_jobs.yaml", "deepsearch.yaml", "deepsearch_keys.yaml",
        "mopd.yaml", "mopd_search.yaml",
    ]
    for name in workloads.NAMES:
        w = workloads.load(name)
        plans = workloads.generate(w, 10, seed=1)
        assert len(plans) == 10
        assert all(p.actions for p in plans)
        assert workloads.generate(w, 10, seed=1) == plans  # deterministic


def test_coding_has_about_fifty_actions_per_trajectory():
    plans = workloads.generate(workloads.load("coding"), 200, seed=0)
    mean = sum(len(p.actions) for p in plans) / len(plans)
    assert 45 < mean < 55
    assert all(p.actions[-1].category == "reward" and p.actions[-1].profiled for p in plans)


def test_a_trajectory_plan_does_not_depend_on_the_batch():
    w = workloads.load("deepsearch")
    assert workloads.generate(w, 3, seed=4)[2] == workloads.generate(w, 50, seed=4)[2]


def _uncommented(text: str) -> list[str]:
    """Value lines with no comment on them and none above their run of sibling lines."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        body = line.split("#")[0]
        if "#" in line or not body.strip() or body.strip().startswith("#") or body.rstrip().endswith(":"):
            continue
        indent = len(body) - len(body.lstrip(" -"))
        j, ok = i - 1, False
        while j >= 0:
            prev = lines[j]
            if prev.strip().startswith("#"):
                ok = True
                break
            if (
                prev.strip()
                and len(prev) - len(prev.lstrip(" -")) < indent
                and not prev.strip().startswith("-")
            ):
                ok = prev.rstrip().endswith(":") and j > 0 and lines[j - 1].strip().startswith("#")
                break
            j -= 1
        if not ok:
            bad.append(f"{i + 1}: {line.strip()}")
    return bad


@pytest.mark.parametrize("name", FILES)
def test_every_value_has_a_source_comment(name):
    text = resources.files("tangram.sim").joinpath("workloads", name).read_text()
    assert _uncommented(text) == []


def test_bad_workloads_are_config_errors(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("name: x\nturns: {dist: weird}\n")
    with pytest.raises(ConfigError, match="unknown dist"):
        workloads.load(str(f))
    f.write_text("name: x\nreward: {kind: teleport}\n")
    with pytest.raises(ConfigError, match="kind must be"):
        workloads.load(str(f))
    with pytest.raises(ConfigError, match="unknown workload"):
        workloads.load("nope")
