"""`tangram status` KEYS table (issue 14, item 4): one row per key of an API's key pool, with the
leases it holds, its requests and tokens in the sliding minute against its limits and the cool-down
left after a rate-limit answer, from records built by the controller's `statusd.build_records` around
the real scheduling core (a keyed API driven by leases, reports and releases). Never a secret: the
core knows keys by name only."""

from __future__ import annotations

import json
from typing import Any

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.actions import ActionSpec, Kind
from tangram.core.managers.keys import ApiKey
from tangram.core.resources import Demand, api_resource
from tangram.core.scheduler import Scheduler
from tangram_cli.controller.statusd import build_records
from tangram_cli.render import status as rs


def _lease(aid: str, api: str, tokens: int = 0) -> ev.ActionSubmitted:
    res = api_resource(api)
    spec = ActionSpec(aid, Kind.LEASE, ((res, Demand.fixed(1)),), key=res, api=api, client="c", tokens=tokens)
    return ev.ActionSubmitted(spec)


def keyed_records() -> dict[str, Any]:
    """API ``llm`` with keys a (2 requests and 10000 tokens a minute, 4 in flight) and b (1 request a
    minute); API ``search`` without keys. Three leases: a, b, a by headroom; b's holder reports a 429
    (10 minutes to reset) and releases; a's first lease reports 400 tokens and releases; one of a's
    stays held. As it travels: plain JSON."""
    core = Scheduler()
    keys = (ApiKey("a", rpm=2, tpm=10_000, concurrency=4), ApiKey("b", rpm=1))
    core.handle(ev.ApiDefined("llm", "concurrency", 0, keys=keys), 0.0)
    core.handle(ev.ApiDefined("search", "concurrency", 16), 0.0)
    granted = {}
    for i, t in enumerate((1.0, 2.0, 3.0)):
        out = core.handle(_lease(f"l{i}", "llm", tokens=1000), t)
        granted |= {c.action_id: c.key for c in out if isinstance(c, cmd.Grant)}
    assert granted == {"l0": "a", "l1": "b", "l2": "a"}
    core.handle(ev.ApiReported("l1", limited=True, reset_s=600.0), 4.0)
    core.handle(ev.ActionFinished("l1"), 4.0)
    core.handle(ev.ApiReported("l0", tokens=400), 5.0)
    core.handle(ev.ActionFinished("l0"), 5.0)
    records = build_records(
        core,
        sections=["cluster", "apis"],
        limit=20,
        cluster="keys",
        epoch=1,
        started=0.0,
        addresses={},
        agent_rows=[],
        client_rows=[],
        sandboxes=[],
        actions={},
        counters={},
        wait_p50=None,
        loop_lag_s=0.0,
        events=0,
        services_conf=[],
        now=5.0,
    )
    return json.loads(json.dumps(records))


def keys_table(records: dict[str, Any], **kw: Any) -> dict[str, dict[str, str]]:
    (table,) = [t for t in rs.tables(records, **kw) if t[0] == "KEYS"]
    return {row[1]: dict(zip(table[1], row, strict=True)) for row in table[2]}


def test_the_records_carry_each_keys_counts_and_no_secret() -> None:
    records = keyed_records()
    apis = {a["api"]: a for a in records["apis"]}
    assert apis["search"]["keys"] == []
    rows = {k["key"]: k for k in apis["llm"]["keys"]}
    a, b = rows["a"], rows["b"]
    assert (a["in_flight"], a["rpm_used"], a["tpm_used"], a["granted"]) == (1, 2, 1400, 2)
    assert (b["in_flight"], b["rpm_used"], b["limited"]) == (0, 1, 1)
    assert b["cooling_s"] == 599.0 and a["cooling_s"] == 0.0
    assert set(a) == {"key", "rpm", "rpm_used", "tpm", "tpm_used", "concurrency", "in_flight", "cooling_s",
                      "granted", "limited"}


def test_keys_table_shows_each_key_against_its_limits() -> None:
    body = keys_table(keyed_records())
    assert list(body) == ["a", "b"]
    a, b = body["a"], body["b"]
    assert (a["API"], a["INFLIGHT"], a["REQ/MIN"], a["TOKENS/MIN"]) == ("llm", "1/4", "2/2", "1400/10000")
    assert (a["COOLDOWN"], a["GRANTED"], a["429S"]) == ("-", "2", "0")
    # b has no concurrency or tokens limit: the count alone; its 429 cools it for the reset time
    assert (b["API"], b["INFLIGHT"], b["REQ/MIN"], b["TOKENS/MIN"]) == ("llm", "0", "1/1", "1000")
    assert (b["COOLDOWN"], b["GRANTED"], b["429S"]) == ("9m59s", "1", "1")


def test_an_api_with_keys_only_says_its_limits_are_per_key() -> None:
    (table,) = [t for t in rs.tables(keyed_records()) if t[0] == "APIS"]
    use = {row[0]: dict(zip(table[1], row, strict=True))["USED/LIMIT"] for row in table[2]}
    assert use == {"llm": "1 in flight (per-key limits)", "search": "0/16 concurrent"}


def test_keys_come_with_the_apis_table_and_not_without_a_pool() -> None:
    records = keyed_records()
    titles = [t[0] for t in rs.tables(records)]
    assert titles.index("KEYS") == titles.index("APIS") + 1
    assert [t[0] for t in rs.tables(records, sections=("apis",))] == ["APIS", "KEYS"]  # `status --apis`
    assert "KEYS" not in [t[0] for t in rs.tables(records, sections=("nodes", "queue"))]
    for api in records["apis"]:
        api["keys"] = []
    assert "KEYS" not in [t[0] for t in rs.tables(records)]
    assert rs.to_json(keyed_records())["records"]["apis"][0]["keys"][0]["key"] == "a"  # `-o json`


def test_an_older_controllers_api_rows_without_keys_render_as_before() -> None:
    records = keyed_records()
    for api in records["apis"]:
        del api["keys"]
    assert "KEYS" not in [t[0] for t in rs.tables(records)]
    records["apis"][0]["keys"] = [{"key": "x"}, "not a row"]  # a partial row: dashes, no crash
    (row,) = keys_table(records).values()
    assert (row["KEY"], row["INFLIGHT"], row["REQ/MIN"], row["COOLDOWN"]) == ("x", "-", "-", "-")
