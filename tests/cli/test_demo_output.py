"""`tangram demo`: the speed sentence, and the cores its elastic test runs get, checked on the
pure scheduling core (no cluster): the demo's exec arguments become the gateway's ActionSpec
and go to a Scheduler with one 2-core node."""

from __future__ import annotations

from typing import Any

from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.resources import CPU, Demand
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram_cli.controller.config import BUILTIN_PROFILES
from tangram_cli.demo.workload import DemoConfig, exec_args, speed_sentence


def test_speed_sentence_words_a_loss_as_slower():
    assert speed_sentence(0.63) == (
        "mean ACT: Tangram is 1.59x slower than the static per-trajectory allocation"
    )
    assert (
        speed_sentence(2.5) == "mean ACT: Tangram is 2.50x faster than the static per-trajectory allocation"
    )
    assert "about the same" in speed_sentence(1.03)
    assert "about the same" in speed_sentence(0.97)
    assert speed_sentence(None) is None and speed_sentence(0.0) is None


def _spec(aid: str, sandbox: str, args: dict[str, Any]) -> ActionSpec:
    """What the gateway builds from an exec request (tangram_cli/controller/gateway.py)."""
    cpus = args["cpus"]
    lo, hi = (cpus, cpus) if isinstance(cpus, int) else cpus
    elastic = args.get("elastic")
    return ActionSpec(
        aid,
        Kind.EXEC,
        ((CPU, Demand.range(lo, hi)),),
        sandbox=sandbox,
        trajectory=sandbox,
        action_type=f"exec:{elastic or ''}:python3",
        elasticity=BUILTIN_PROFILES[elastic] if elastic else None,
        t_ori=args.get("duration_hint"),
    )


def _two_cores() -> Scheduler:
    s = Scheduler(CoreConfig(depth=2), seed=0)
    s.handle(ev.NodeJoined("n1", cpus=(0, 1), numa=((0, 1),), mem_mib=8000, gpus=0, gpu_mem_mib=0), 0.0)
    for sb in ("sb0", "sb1"):
        s.handle(ev.SandboxOpened(sb, client="demo", mem_mib=0), 0.0)
    return s


def _dops(cmds: list[Any]) -> dict[str, int]:
    return {c.action_id: c.dop for c in cmds if type(c).__name__ == "Spawn"}


def test_test_run_gets_both_cores_of_an_idle_two_core_node():
    cfg = DemoConfig(cores=2)
    s = _two_cores()
    cmds = s.handle(ev.ActionSubmitted(_spec("t1", "sb0", exec_args(cfg, "test", False))), 0.0)
    assert _dops(cmds) == {"t1": 2}


def test_test_run_waits_for_a_short_command_then_gets_both_cores():
    """Another trajectory's command holds a core: with the command's duration hint the core
    holds the test run for it (ms) rather than start it on one core. Before the hint the
    command was taken to last 1 s and the test run started at DoP 1."""
    cfg = DemoConfig(cores=2)
    s = _two_cores()
    first = s.handle(ev.ActionSubmitted(_spec("c1", "sb1", exec_args(cfg, "cmd", False))), 0.0)
    assert _dops(first) == {"c1": 1}
    held = s.handle(ev.ActionSubmitted(_spec("t1", "sb0", exec_args(cfg, "test", False))), 0.01)
    assert "t1" not in _dops(held)
    after = s.handle(ev.ActionFinished("c1"), 0.05)
    assert _dops(after) == {"t1": 2}


def test_static_policy_asks_for_its_reserved_cores():
    cfg = DemoConfig(cores=2, reserve=1)
    assert exec_args(cfg, "test", True)["cpus"] == 1
    assert exec_args(cfg, "cmd", True)["cpus"] == 1
    assert "elastic" not in exec_args(cfg, "test", True)
