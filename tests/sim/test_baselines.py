"""Each baseline's defining behaviour."""

from __future__ import annotations

import pytest
from simutil import SMALL, Checked, tiny

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.errors import ConfigError
from tangram.sim import workloads
from tangram.sim.baselines import RetryPolicy, parse_policy, static_layout
from tangram.sim.engine import Engine


def _run(workload, policy, batch, spec=SMALL, seed=1):
    e = Engine(
        workload if not isinstance(workload, str) else workloads.load(workload),
        parse_policy(policy),
        spec=spec,
        batch=batch,
        seed=seed,
    )
    e.core = Checked(e.core)
    r = e.run()
    return e, r


def test_k8s_pod_holds_its_cores_for_the_whole_trajectory():
    e, r = _run("coding", "k8s", 40)  # 40 pods x 4 cores > 64 cores: trajectories queue
    reserve, closed, spawns = {}, {}, {}
    for now, event, out in e.core.log:
        for c in out:
            if isinstance(c, cmd.Reserve):
                reserve[c.sandbox] = (now, c.cores)
            elif isinstance(c, cmd.Spawn):
                spawns.setdefault(c.sandbox, []).append(c)
            elif isinstance(c, cmd.Done) and c.action_id.startswith("open:"):
                closed[c.action_id[5:]] = now
        if isinstance(event, ev.SandboxClosed):
            assert event.sandbox in closed  # the pod's cores come back only when it closes
    assert set(reserve) == set(closed) == {t.plan.tid for t in r.trajs}
    ends = {t.plan.tid: t.end for t in r.trajs}
    for sb, (_, cores) in reserve.items():
        assert len(cores) == 4
        assert closed[sb] == pytest.approx(ends[sb])  # held to the trajectory's end
        assert all(s.cores == cores for s in spawns[sb])  # every action runs on the pod's cores
        assert spawns[sb][-1].dop == 4
        assert {s.dop for s in spawns[sb][:-1]} == {1}
    starts = sorted(t0 for t0, _ in reserve.values())
    assert starts[-1] > 0  # the cluster was full: later trajectories waited for a pod


def test_fixed_dop_gives_exactly_k():
    e, r = _run("coding", "fixed-dop:8", 16)
    rewards = [
        c
        for _, _, out in e.core.log
        for c in out
        if isinstance(c, cmd.Spawn)
        and c.action_id.endswith(
            tuple(f"/{len(t.plan.actions) - 1}" for t in r.trajs if c.sandbox == t.plan.tid)
        )
    ]
    assert len(rewards) == 16
    assert all(c.dop == 8 and len(c.cores) == 8 for c in rewards)


def test_static_runs_each_service_only_on_its_own_gpus_and_never_loads():
    e, _ = _run("mopd", "static", 64)
    layout = e.core.core.layout
    owner = {
        (node, g): svc
        for svc, reps in layout.items()
        for node, start, size in reps
        for g in range(start, start + size)
    }
    invokes = [c for _, _, out in e.core.log for c in out if isinstance(c, cmd.Invoke)]
    assert len(invokes) == 64
    for c in invokes:
        assert all(owner[(c.node, g)] == c.service for g in range(c.start, c.end))
    assert not any(isinstance(c, (cmd.Load, cmd.Evict)) for _, _, out in e.core.log for c in out)


def test_static_layout_packs_services_and_refuses_too_many():
    lay = static_layout([("a", 4, 1), ("b", 2, 2)], [("g0", 4), ("g1", 4)])
    assert lay == {"a": [("g0", 0, 1), ("g0", 1, 1), ("g0", 2, 1), ("g0", 3, 1)], "b": [("g1", 0, 2)]}
    with pytest.raises(ConfigError, match="needs 10 GPUs"):
        static_layout([("a", 10, 1)], [("g0", 8)])


def test_serverless_ignores_residency_and_uses_one_chunk_size():
    p = parse_policy("serverless")
    assert p.core.cache_aware is False
    e, _ = _run("mopd", "serverless", 64)
    invokes = [c for _, _, out in e.core.log for c in out if isinstance(c, cmd.Invoke)]
    assert invokes
    assert all(c.end - c.start == 1 for c in invokes)
    # against the same fixed chunk size with cache-aware placement (policy "min"), more restores
    _, m = _run("mopd", "min", 64)
    _, s = _run("mopd", "serverless", 64)
    assert s.counters["loads"] > m.counters["loads"]


def test_api_retry_calls_directly_and_backs_off():
    w = tiny(
        tools=[{"name": "q", "kind": "api", "api": "x", "t_ori_s": 5.0}],
        reward=None,
        turns=1,
        apis=[{"name": "x", "mode": "concurrency", "limit": 1}],
    )
    e, r = _run(w, "api-retry", 3)
    assert not any(isinstance(ev_, ev.ActionSubmitted) for _, ev_, _ in e.core.log)  # no leases
    first = sorted(r.records, key=lambda x: x.start)
    assert first[0].attempts == 1
    assert max(x.attempts for x in r.records) > 1
    rp = RetryPolicy()
    import random

    rng = random.Random(0)
    waits = [rp.backoff(k, rng) for k in (1, 2, 3, 10)]
    assert 0.5 <= waits[0] <= 1.0
    assert 1.0 <= waits[1] <= 2.0
    assert 2.0 <= waits[2] <= 4.0
    assert waits[3] <= rp.cap_s
    # with leases (tangram) the same calls queue in the core instead and never fail
    _, rt = _run(w, "tangram", 3)
    assert all(x.ok for x in rt.records)
    assert sorted(round(x.end - x.submit, 6) for x in rt.records) == [5.0, 10.0, 15.0]


@pytest.mark.parametrize("bad", ["nope", "fixed-dop", "fixed-dop:x", "fixed-dop:0", "static:3", "k8s:-1"])
def test_bad_policies_are_config_errors(bad):
    with pytest.raises(ConfigError):
        parse_policy(bad)


def test_policy_combinations():
    p = parse_policy("api-retry+static")
    assert p.api_direct
    assert p.static
    assert p.core.policy == "tangram"
    assert parse_policy("tangram:3").core.depth == 3
    assert parse_policy("k8s:8").reserve == 8
    assert parse_policy("fixed-dop:16").core.fixed_dop == 16
