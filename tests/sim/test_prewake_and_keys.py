"""The simulator with GPU pre-wake and API key pools (issue 14, items 2 and 4).

* Pre-wake: ``tangram`` (pre-wake on) against ``tangram+no-prewake`` on one seed: the restore
  share of GPU action time and the mean GPU ACT fall; the cluster model runs a restore ahead of
  its call on its own and puts on the call's path only what is left of it.
* Key pools: in ``deepsearch-keys`` the provider model enforces each key's RPM, TPM and
  in-flight limits; under Tangram no 429 reaches rollout code and each keyed API serves within
  5% of the sum of its keys' limits while calls wait for it; calling directly (api-retry) meets
  429s.
"""

from __future__ import annotations

import pytest

from tangram.core import commands as cmd
from tangram.core.managers.keys import ApiKey
from tangram.sim import workloads
from tangram.sim.baselines import parse_policy
from tangram.sim.cluster import ClusterModel, ClusterSpec, KeyedProvider, Truth
from tangram.sim.experiments import run_one


def _pair(workload: str, batch: int) -> tuple[dict, dict]:
    return run_one(workload, "tangram", batch, 0), run_one(workload, "tangram+no-prewake", batch, 0)


def test_no_prewake_is_a_policy_and_turns_it_off():
    assert parse_policy("tangram").core.prewake
    assert not parse_policy("tangram+no-prewake").core.prewake
    assert parse_policy("tangram:3+no-prewake").core.depth == 3


@pytest.mark.timeout(240)
def test_prewake_lowers_the_restore_share_and_the_gpu_act_in_mopd_search():
    on, off = _pair("mopd+search", 512)
    assert on["restore_share"] <= 0.5 * off["restore_share"]
    assert on["gpu_act_s"] < off["gpu_act_s"]
    assert off["prewakes"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prewake_at_batch_2048_in_mopd_and_mopd_search():
    for workload, most in (("mopd", 0.6), ("mopd+search", 0.5)):
        on, off = _pair(workload, 2048)
        print(
            f"{workload}@2048: restore share {off['restore_share']:.3f} -> {on['restore_share']:.3f}, "
            f"mean GPU ACT {off['gpu_act_s']:.3f} -> {on['gpu_act_s']:.3f} s"
        )
        assert on["restore_share"] <= most * off["restore_share"]
        assert on["gpu_act_s"] < off["gpu_act_s"]


def _model() -> ClusterModel:
    truths = {"c1": Truth(2.0, None, 50.0), "c2": Truth(2.0, None, 50.0)}
    return ClusterModel(ClusterSpec(restore_t0_s=0.0, h2d_gb_s=50.0), truths.__getitem__, lambda s: 50.0)


def test_a_restore_ahead_runs_on_its_own_and_only_its_rest_lies_on_the_call():
    m = _model()  # 50 GB at 50 GB/s: a 1 s restore
    assert m.apply([cmd.Load("g", "svc", 0, 1, 1.0)], 10.0) == []  # no call: nothing finishes
    assert (m.prewakes, m.prewake_gpu_s) == (1, 1.0)
    out = m.apply([cmd.Invoke("c1", "g", "svc", 0, 1, 2.0)], 10.25)  # 0.75 s of it left
    assert out[0][0] == pytest.approx(10.25 + 0.75 + 2.0) and m.runs["c1"].restore_s == pytest.approx(0.75)
    out = m.apply([cmd.Invoke("c2", "g", "svc", 0, 1, 2.0)], 20.0)  # long restored: none on its path
    assert out[0][0] == pytest.approx(22.0) and m.runs["c2"].restore_s == 0.0 and m.restores == 0


def test_the_keyed_provider_enforces_each_keys_limits_on_a_sliding_minute():
    p = KeyedProvider((ApiKey("a", rpm=2), ApiKey("b", tpm=100, concurrency=1)))
    assert p.call("a", 0, 0.0, 1.0) and p.call("a", 0, 30.0, 31.0)
    assert not p.call("a", 0, 59.0, 60.0)  # a third request within a minute: 429
    assert p.reset_s("a", 59.0) == pytest.approx(1.0)
    assert p.call("a", 0, 60.0, 61.0)  # the first one aged out
    assert p.call("b", 60, 0.0, 5.0)
    assert not p.call("b", 10, 1.0, 2.0)  # one in flight already
    assert not p.call("b", 50, 6.0, 7.0)  # 60 + 50 tokens > 100 in the minute
    assert p.call("b", 40, 6.0, 7.0)
    assert p.refused == 3 and len(p.served) == 5


def test_the_keys_workload_declares_tokens_and_leaves_the_other_workloads_alone():
    keyed = workloads.load("deepsearch-keys")
    reader = next(a for a in keyed.apis if a.name == "llm_reader")
    assert [k.name for k in reader.keys] == ["r0", "r1"] and reader.limit == 0
    plans = workloads.generate(keyed, 20, seed=0)
    reads = [a for p in plans for a in p.actions if a.api == "llm_reader"]
    assert reads and all(a.tokens > 0 for a in reads)
    assert all(
        a.tokens == 0 for p in workloads.generate(workloads.load("deepsearch"), 20, 0) for a in p.actions
    )


@pytest.mark.timeout(300)
def test_key_pools_no_429_reaches_rollout_code_and_throughput_meets_the_keys_limits():
    t = run_one("deepsearch-keys", "tangram", 1024, 0)
    assert t["api_429"] == 0 and t["failed"] == 0
    for api in ("web_search", "llm_reader"):
        k = t["keyed"][api]
        assert k["minutes"] >= 3, (api, k)  # saturated for minutes: calls waited for the keys
        assert 0.95 <= k["share_of_limit"] <= 1.0 + 1e-9, (api, k)
    direct = run_one("deepsearch-keys", "api-retry", 1024, 0)
    assert direct["api_429"] > 1000
