"""Scenario tests for API key pools (issue 14, item 4; ``managers/keys.py``, ``api_pass.py``).

An API lists keys, each with requests per minute (RPM), tokens per minute (TPM) and in-flight
limits; a lease gets a key with room (the most headroom first), its ``Grant`` names the key,
the holder reports tokens and rate-limit answers (``ApiReported``), and a 429 cools the key.
Counts and order only, never wall-clock timings."""

from __future__ import annotations

from sched_util import lease_spec

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.managers.keys import ApiKey
from tangram.core.scheduler import Scheduler
from tangram.core.status import Code


def make(*keys: ApiKey, limit: int = 0) -> Scheduler:
    s = Scheduler()
    s.handle(ev.ApiDefined("llm", "concurrency", limit, keys=keys), 0.0)
    return s


def lease(s: Scheduler, aid: str, now: float, tokens: int = 0) -> list[cmd.Command]:
    spec = lease_spec(aid, "llm")
    spec = type(spec)(**{**spec.__dict__, "tokens": tokens}) if tokens else spec
    return s.handle(ev.ActionSubmitted(spec), now)


def grants(out: list[cmd.Command]) -> dict[str, str]:
    return {c.action_id: c.key for c in out if isinstance(c, cmd.Grant)}


def test_leases_spread_over_the_keys_with_the_most_headroom_and_name_their_key():
    s = make(ApiKey("a", rpm=4), ApiKey("b", rpm=2))
    got = {}
    for i in range(6):
        got |= grants(lease(s, f"l{i}", float(i)))
    # used share a/b: 0/0 -> a (tie: the first key); .25/0 -> b; .25/.5 -> a; .5/.5 -> a;
    # .75/.5 -> b; .75/1 -> a (b is full)
    assert got == {"l0": "a", "l1": "b", "l2": "a", "l3": "a", "l4": "b", "l5": "a"}
    assert [r["rpm_used"] for r in s.snapshot().apis[0]["keys"]] == [4, 2]


def test_a_lease_waits_when_every_key_used_its_minute_and_is_granted_when_the_oldest_ages_out():
    s = make(ApiKey("a", rpm=1), ApiKey("b", rpm=1))
    assert grants(lease(s, "l0", 0.0)) == {"l0": "a"}
    assert grants(lease(s, "l1", 10.0)) == {"l1": "b"}
    s.handle(ev.ActionFinished("l0"), 11.0)
    s.handle(ev.ActionFinished("l1"), 11.0)
    assert grants(lease(s, "l2", 12.0)) == {}  # released, but each key's minute is used
    st = s.status_of("l2")
    assert st is not None and st.code is Code.UNSCHEDULABLE and "key a" in str(st)
    assert s.next_deadline() == 60.0  # a's one request ages out of its sliding minute
    assert grants(s.handle(ev.Tick(), 60.0)) == {"l2": "a"}


def test_tokens_per_minute_pick_the_key_with_room_and_a_lease_no_key_could_take_is_refused():
    s = make(ApiKey("a", tpm=1000), ApiKey("b", tpm=3000))
    assert grants(lease(s, "l0", 0.0, tokens=900)) == {"l0": "a"}  # tie: the first key
    assert grants(lease(s, "l1", 1.0, tokens=900)) == {"l1": "b"}  # a is 90% used, b 0%
    assert grants(lease(s, "l2", 2.0, tokens=1500)) == {"l2": "b"}  # only b has room for it
    out = lease(s, "big", 3.0, tokens=3001)
    (rej,) = [c for c in out if isinstance(c, cmd.Reject)]
    assert rej.code == "NO_CAPACITY" and "tokens per minute" in rej.message


def test_fcfs_a_head_without_room_is_not_overtaken_by_a_smaller_lease():
    s = make(ApiKey("a", tpm=1000))
    assert grants(lease(s, "l0", 0.0, tokens=800)) == {"l0": "a"}
    assert grants(lease(s, "big", 1.0, tokens=500)) == {}
    assert grants(lease(s, "small", 2.0, tokens=100)) == {}  # would fit, but FCFS
    assert grants(s.handle(ev.Tick(), 60.0)) == {"big": "a", "small": "a"}


def test_in_flight_limit_frees_on_release():
    s = make(ApiKey("a", concurrency=1))
    assert grants(lease(s, "l0", 0.0)) == {"l0": "a"}
    assert grants(lease(s, "l1", 1.0)) == {}
    assert s.next_deadline() is not None  # the lease's own expiry; no key deadline helps
    assert grants(s.handle(ev.ActionFinished("l0"), 2.0)) == {"l1": "a"}


def test_a_rate_limit_answer_cools_the_key_down_for_its_reset_time():
    s = make(ApiKey("a", rpm=100), ApiKey("b", rpm=100))
    assert grants(lease(s, "l0", 0.0)) == {"l0": "a"}
    s.handle(ev.ApiReported("l0", limited=True, reset_s=30.0), 1.0)
    s.handle(ev.ActionFinished("l0", ok=False, reason="rate limited"), 1.0)
    assert grants(lease(s, "l1", 2.0)) == {"l1": "b"}  # a cools until 31
    s.handle(ev.ApiReported("l1", limited=True, reset_s=5.0), 3.0)
    s.handle(ev.ActionFinished("l1"), 3.0)
    assert grants(lease(s, "l2", 4.0)) == {}  # both cooling
    assert "cooling down" in str(s.status_of("l2"))
    assert s.next_deadline() == 8.0  # b's cool-down ends first
    assert grants(s.handle(ev.Tick(), 8.0)) == {"l2": "b"}
    rows = {r["key"]: r for r in s.snapshot(limit=0).apis[0]["keys"]}
    assert (rows["a"]["limited"], rows["b"]["limited"], rows["a"]["cooling_s"]) == (1, 1, 23.0)


def test_reported_tokens_replace_the_charge():
    s = make(ApiKey("a", tpm=1000))
    assert grants(lease(s, "l0", 0.0, tokens=900)) == {"l0": "a"}
    assert grants(lease(s, "l1", 1.0, tokens=500)) == {}
    # the call was counted 300, not 900: room for l1 at once, before l0 is even released
    assert grants(s.handle(ev.ApiReported("l0", tokens=300), 2.0)) == {"l1": "a"}
    assert s.snapshot(limit=0).apis[0]["keys"][0]["tpm_used"] == 800
    s.handle(ev.ApiReported("gone", tokens=5), 3.0)  # an unknown lease changes nothing
    assert s.snapshot(limit=0).apis[0]["keys"][0]["tpm_used"] == 800


def test_an_api_wide_limit_still_applies_and_an_api_without_keys_grants_no_key():
    s = make(ApiKey("a", rpm=10), ApiKey("b", rpm=10), limit=1)
    assert grants(lease(s, "l0", 0.0)) == {"l0": "a"}
    assert grants(lease(s, "l1", 0.0)) == {}  # the API allows one in flight
    plain = Scheduler()
    plain.handle(ev.ApiDefined("search", "concurrency", 1), 0.0)
    out = plain.handle(ev.ActionSubmitted(lease_spec("p0", "search")), 0.0)
    assert out == [cmd.Grant("p0", "search", 300.0)] and out[0].key == ""


def test_redefining_the_same_keys_keeps_their_windows():
    keys = (ApiKey("a", rpm=1),)
    s = make(*keys)
    assert grants(lease(s, "l0", 0.0)) == {"l0": "a"}
    s.handle(ev.ApiDefined("llm", "concurrency", 0, keys=keys), 1.0)
    assert grants(lease(s, "l1", 2.0)) == {}  # a's minute is still used


def test_a_report_just_after_the_release_still_counts():
    # a driver may hand the release (a completion) to the core before the report that came with it
    s = make(ApiKey("a", rpm=100), ApiKey("b", rpm=100))
    assert grants(lease(s, "l0", 0.0, tokens=10)) == {"l0": "a"}
    s.handle(ev.ActionFinished("l0"), 1.0)
    s.handle(ev.ApiReported("l0", tokens=7, limited=True, reset_s=10.0), 1.0)
    assert grants(lease(s, "l1", 2.0)) == {"l1": "b"}
    row = s.snapshot(limit=0).apis[0]["keys"][0]
    assert (row["limited"], row["tpm_used"], row["cooling_s"]) == (1, 7, 9.0)


def test_status_at_a_later_time_ages_the_minute_and_the_cool_down_without_touching_the_core():
    s = make(ApiKey("a", rpm=5, tpm=1000))
    lease(s, "l0", 0.0, tokens=100)
    lease(s, "l1", 30.0, tokens=200)
    s.handle(ev.ActionFinished("l0"), 31.0)
    s.handle(ev.ApiReported("l1", tokens=200, limited=True, reset_s=20.0), 31.0)
    # no event after t=31: an idle controller's status still reads the clock
    def row(now):
        return s.snapshot(now=now).apis[0]["keys"][0]
    assert (row(None)["rpm_used"], row(None)["tpm_used"], row(None)["cooling_s"]) == (2, 300, 20.0)
    assert (row(45.0)["rpm_used"], row(45.0)["cooling_s"]) == (2, 6.0)
    assert (row(65.0)["rpm_used"], row(65.0)["tpm_used"], row(65.0)["cooling_s"]) == (1, 200, 0.0)
    assert (row(95.0)["rpm_used"], row(95.0)["tpm_used"]) == (0, 0)
    assert row(10.0)["rpm_used"] == 2  # an earlier time than the core's reads the core's own
    key = s.basic.apis["llm"].keys.keys[0]
    assert (key.requests, key.tokens, len(key.window)) == (2, 300, 2)  # nothing rolled by the reads
