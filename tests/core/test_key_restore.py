"""A restarted controller puts API key pools back (``KeyUsed``, ``ActionSpec.api_key``;
``managers/keys.py`` rule 6, ``api_pass.py`` rule 4): each key's sliding minute and cool-down,
and each live lease on the key it held. Scenarios on the pure core, counts and order only."""

from __future__ import annotations

from dataclasses import replace

from sched_util import lease_spec

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.managers.keys import ApiKey
from tangram.core.scheduler import Scheduler
from tangram.core.status import Code

T0 = 1000.0  # the restarted core's clock: nothing to do with the one before the restart


def make(*keys: ApiKey, now: float = T0) -> Scheduler:
    s = Scheduler()
    s.handle(ev.ApiDefined("llm", "concurrency", 0, keys=keys), now)
    return s


def lease(s: Scheduler, aid: str, now: float, key: str = "", tokens: int = 0) -> list[cmd.Command]:
    return s.handle(ev.ActionSubmitted(replace(lease_spec(aid, "llm"), api_key=key, tokens=tokens)), now)


def grants(out: list[cmd.Command]) -> dict[str, str]:
    return {c.action_id: c.key for c in out if isinstance(c, cmd.Grant)}


def rows(s: Scheduler) -> dict[str, dict[str, object]]:
    return {r["key"]: r for r in s.snapshot(limit=0).apis[0]["keys"]}


def test_a_restored_minute_holds_a_key_at_its_rpm_until_its_charges_age_out():
    s = make(ApiKey("a", rpm=2))
    s.handle(ev.KeyUsed("llm", "a", ((50.0, 1, 0, ""), (20.0, 1, 0, ""))), T0)
    assert rows(s)["a"]["rpm_used"] == 2
    assert grants(lease(s, "l0", T0)) == {}
    st = s.status_of("l0")
    assert st is not None and st.code is Code.UNSCHEDULABLE and "key a" in str(st)
    assert s.next_deadline() == T0 + 10.0  # the charge made 50 s before the restart ages out
    assert grants(s.handle(ev.Tick(), T0 + 10.0)) == {"l0": "a"}
    assert rows(s)["a"]["rpm_used"] == 2  # the one from 20 s before, and l0


def test_a_restored_cool_down_keeps_the_key_out_until_it_ends():
    s = make(ApiKey("a", rpm=100), ApiKey("b", rpm=100))
    s.handle(ev.KeyUsed("llm", "a", (), cool_left_s=30.0), T0)
    assert rows(s)["a"]["cooling_s"] == 30.0
    assert grants(lease(s, "l0", T0)) == {"l0": "b"}  # a would win the tie, but it cools down
    assert grants(lease(s, "l1", T0 + 29.0)) == {"l1": "b"}
    assert grants(lease(s, "l2", T0 + 30.0)) == {"l2": "a"}  # cooled: the most headroom again


def test_a_restored_lease_goes_back_on_its_key_and_counts_in_its_concurrency():
    s = make(ApiKey("a", rpm=10, concurrency=1), ApiKey("b", rpm=1, concurrency=1))
    s.handle(ev.KeyUsed("llm", "b", ((10.0, 1, 0, "r0"),)), T0)
    # b has no room by its own limits (its one request per minute is r0's): r0 goes back on it anyway
    assert grants(lease(s, "r0", T0, key="b")) == {"r0": "b"}
    b = rows(s)["b"]
    assert (b["rpm_used"], b["in_flight"]) == (1, 1)  # r0's restored charge, not a second one
    assert grants(lease(s, "l1", T0 + 1.0)) == {"l1": "a"}
    assert grants(lease(s, "l2", T0 + 2.0)) == {}  # a and b each hold one lease in flight
    s.handle(ev.ActionFinished("r0"), T0 + 3.0)
    assert grants(s.handle(ev.ActionFinished("l1"), T0 + 4.0)) == {"l2": "a"}


def test_a_report_of_a_restored_lease_corrects_its_restored_charge():
    s = make(ApiKey("a", tpm=1000))
    s.handle(ev.KeyUsed("llm", "a", ((5.0, 1, 900, "r0"),)), T0)
    assert grants(lease(s, "r0", T0, key="a")) == {"r0": "a"}
    assert grants(lease(s, "l1", T0 + 1.0, tokens=500)) == {}
    assert grants(s.handle(ev.ApiReported("r0", tokens=300), T0 + 2.0)) == {"l1": "a"}
    assert rows(s)["a"]["tpm_used"] == 800


def test_a_restored_lease_whose_charge_aged_out_is_not_charged_again():
    s = make(ApiKey("a", rpm=1))
    assert grants(lease(s, "r0", T0, key="a")) == {"r0": "a"}  # granted 70 s before the restart
    assert (rows(s)["a"]["rpm_used"], rows(s)["a"]["in_flight"]) == (0, 1)
    assert grants(lease(s, "l1", T0)) == {"l1": "a"}


def test_unknown_apis_keys_and_stale_charges_are_ignored():
    s = make(ApiKey("a", rpm=1))
    before = rows(s)
    s.handle(ev.KeyUsed("gone", "a", ((1.0, 1, 0, ""),), cool_left_s=30.0), T0)
    s.handle(ev.KeyUsed("llm", "zz", ((1.0, 1, 0, "r9"),), cool_left_s=30.0), T0)
    s.handle(ev.KeyUsed("llm", "a", ((60.0, 1, 0, ""), (75.0, 1, 0, ""))), T0)  # out of the window
    assert rows(s) == before
    # a lease restored on a key the config no longer has gets a key like any other lease
    assert grants(lease(s, "r9", T0, key="zz")) == {"r9": "a"}
    assert rows(s)["a"]["rpm_used"] == 1
