"""`tangram bench chaos` at a bounded size: two trials of every fault kind (kill -9 of the agent,
of the controller, of a load client, and an agent restart under a running action) with real
processes, real sockets and, where dockerd answers, real containers.

The JSON's shape is checked strictly. The goals of issue 10 that are counts (0 lost, 0 run
twice, 0 left running, 0 cores leaked, every trial recovered) are checked per fault kind;
timings are printed by the bench, never asserted. A kind the product does not meet yet is
marked `xfail(strict=False)` in `KNOWN_FAILING` (remove the entry when its fix lands).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from click.testing import CliRunner

from tangram_cli.bench.chaos import KINDS, chaos

# kind -> why today's product misses a count goal for it (docs/recovery.md, "Chaos benchmark")
KNOWN_FAILING: dict[str, str] = {}
FIGURES = {
    "trials",
    "requests",
    "ok",
    "lost",
    "duplicated",
    "leftover",
    "leftover_containers",
    "cores_leaked",
    "errors",
    "recover_s",
    "recover_max_s",
    "not_recovered",
    "met",
    "detail",
}
DETAIL = {
    "lost_unanswered",
    "lost_client_gave_up",
    "duplicate_finals",
    "late_duplicate_finals",
    "ran_twice_or_more",
    "evidence",
    "leftover_processes",
    "leftover_containers",
    "cores_used_at_quiesce",
    "cores_burned_by_leftovers",
    "quiesce",
    "trials",
    "client_errors",
}
TRIALS = {"process": 2, "docker": 1}


@functools.cache
def _doc(executor: str) -> dict[str, Any]:
    args = ["--trials", str(TRIALS[executor]), "--executor", executor, "--lost-after", "8"]
    result = CliRunner().invoke(chaos, [*args, "--timeout", "200", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["chaos"]


def _goal_params(executor: str) -> list[Any]:
    marks: list[Any] = [pytest.mark.docker] if executor == "docker" else []
    return [
        pytest.param(
            executor,
            kind,
            id=f"{executor}-{kind}",
            marks=[
                *marks,
                *(
                    [pytest.mark.xfail(strict=False, reason=KNOWN_FAILING[kind])]
                    if kind in KNOWN_FAILING
                    else []
                ),
            ],
        )
        for kind in KINDS
    ]


EXECUTORS = [pytest.param("process"), pytest.param("docker", marks=pytest.mark.docker)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_chaos_report_shape(executor: str) -> None:
    doc = _doc(executor)
    assert "error" not in doc, doc.get("error")
    assert doc["executor"] == executor
    assert list(doc["by_kind"]) == list(KINDS)
    assert doc["goals"]["lost"] == 0
    assert doc["goals"]["recover_s"]["controller"] == 5.0
    for kind, fig in doc["by_kind"].items():
        assert not FIGURES - set(fig), kind
        assert not DETAIL - set(fig["detail"]), kind
        assert fig["trials"] == TRIALS[executor], (kind, fig["detail"]["notes"])
        assert len(fig["recover_s"]) == fig["trials"]
        assert fig["ok"] > 0, (kind, fig["errors"])
        assert all(t["long_running"] for t in fig["detail"]["trials"]), (kind, fig["detail"]["trials"])
        assert fig["detail"]["quiesce"]["answered"] is True
        for key in ("lost", "duplicated", "leftover", "cores_leaked"):
            assert isinstance(fig[key], int)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_chaos_leaves_nothing_after_the_run(executor: str) -> None:
    doc = _doc(executor)
    end = doc["end"]
    assert end["processes"] == 0
    assert doc["cleanup"]["killed_processes"] == 0
    assert end["containers"] == []
    assert end["sandboxes"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("executor", "kind"), _goal_params("process") + _goal_params("docker"))
def test_chaos_counts_meet_the_goals(executor: str, kind: str) -> None:
    fig = _doc(executor)["by_kind"][kind]
    d = fig["detail"]
    assert fig["lost"] == 0, (d["lost_unanswered"], d["lost_client_gave_up"])
    assert fig["duplicated"] == 0, (d["duplicate_finals"], d["late_duplicate_finals"], d["ran_twice_or_more"])
    assert fig["leftover"] == 0, (d["leftover_examples"], d["leftover_containers"])
    assert fig["cores_leaked"] == 0, (d["cores_used_at_quiesce"], d["cores_burned_by_leftovers"])
    assert fig["not_recovered"] == 0, d["trials"]
