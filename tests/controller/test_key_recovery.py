"""API key pools survive a controller restart (issue 14 item 4, issue 10): a real controller
leases keys, stops, and a new one starts on the same state file. Each key's minute, its
cool-down after a 429 and the key a held lease has come back; secrets never reach the file.
In-process controllers, a raw client on loopback with a fixed identity (it outlives the first
controller, as a rollout's client does)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from tangram import protocol as p
from tangram_cli.controller.daemon import Controller
from tests.controller.test_recovery import _raw_as

pytestmark = pytest.mark.timeout(60)

SECRETS = {"TG_TEST_KEY_A": "sk-test-aaaa-1111", "TG_TEST_KEY_B": "sk-test-bbbb-2222"}
CONFIG: dict[str, Any] = {
    "cluster": "keys",
    "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2},
    "apis": [
        {
            "name": "llm",
            "keys": [
                {"name": "a", "key_env": "TG_TEST_KEY_A", "rpm": 2, "concurrency": 4},
                {"name": "b", "key_env": "TG_TEST_KEY_B", "rpm": 2},
            ],
        }
    ],
}


@pytest.fixture
def start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, controllers: Any) -> Any:
    """`await start()`: a new controller on the same state file (a test stops one before the next)."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    path = str(tmp_path / "state.jsonl")
    return lambda: controllers(CONFIG, state=path)


async def _lease(client: Any, rid: int, budget_ms: int = 5000) -> p.Envelope:
    await client.send(p.Lease("llm", 1, budget_ms=budget_ms), rid)
    return await client.final(rid)


def _keys(c: Controller) -> dict[str, dict[str, Any]]:
    (llm,) = [r for r in c._records(["apis"], 10)["apis"] if r["api"] == "llm"]
    return {k["key"]: k for k in llm["keys"]}


async def test_key_minutes_and_held_leases_survive_a_restart(
    start: Any, raw_client: Any, tmp_path: Path
) -> None:
    holder = secrets.token_bytes(16)
    first = await start()
    try:
        client = _raw_as(raw_client, first.submit_addr, holder)
        names, leases = [], []
        for rid in (1, 2, 3):  # a (tie), b (a is half used), a (a tie again): a's minute is full
            body = (await _lease(client, rid)).msg.body
            names.append(body["key_name"])
            leases.append(body["lease"])
        assert names == ["a", "b", "a"]
        for rid, lease in ((4, leases[0]), (5, leases[2])):  # b's lease stays held across the restart
            await client.send(p.Release(lease), rid)
            await client.final(rid)
    finally:
        await first.stop()
    text = (tmp_path / "state.jsonl").read_text()
    assert all(secret not in text for secret in SECRETS.values())

    second = await start()
    try:
        assert second.recovery.counters["restored_leases"] == 1
        held = second.core.basic.apis["llm"].keys.held(leases[1])
        assert held is not None and held[0].spec.name == "b"  # the key whose secret its holder uses
        rows = _keys(second)
        assert [(k, r["rpm_used"], r["in_flight"]) for k, r in rows.items()] == [("a", 2, 0), ("b", 1, 1)]
        other = _raw_as(raw_client, second.submit_addr, secrets.token_bytes(16))
        body = (await _lease(other, 1)).msg.body
        assert body["key_name"] == "b"  # a's minute is still full
        env = await _lease(other, 2, budget_ms=500)  # both keys' minutes are full: it waits, then fails
        assert isinstance(env.msg, p.Error), env.msg
        client = _raw_as(raw_client, second.submit_addr, holder, second.gateway.token_for(holder))
        await client.send(p.Release(leases[1]), 6)  # the held lease, released on the new controller
        assert isinstance((await client.final(6)).msg, p.Result)
        b = second.core.basic.apis["llm"].keys.named("b")
        assert b is not None and list(b.in_flight) == [body["lease"]]  # the other lease is still held
    finally:
        await second.stop()

    third = await start()  # the second one's rewritten file still holds the minute
    try:
        assert [(k, r["rpm_used"]) for k, r in _keys(third).items()] == [("a", 2), ("b", 2)]
        assert third.recovery.counters["restored_leases"] == 1  # the other client's, on b again
        held = third.core.basic.apis["llm"].keys.held(body["lease"])
        assert held is not None and held[0].spec.name == "b"
    finally:
        await third.stop()


async def test_a_key_cooling_after_a_429_stays_cool_after_a_restart(
    start: Any, raw_client: Any
) -> None:
    first = await start()
    try:
        client = _raw_as(raw_client, first.submit_addr, secrets.token_bytes(16))
        body = (await _lease(client, 1)).msg.body
        assert body["key_name"] == "a"
        await client.send(p.Release(body["lease"], tokens=40, rate_limited=True, reset_ms=30_000), 2)
        await client.final(2)
    finally:
        await first.stop()
    second = await start()
    try:
        rows = _keys(second)
        assert rows["a"]["cooling_s"] > 25 and rows["a"]["tpm_used"] == 40
        other = _raw_as(raw_client, second.submit_addr, secrets.token_bytes(16))
        for rid in (1, 2):  # a cools down: b takes both (a would win the second's tie)
            assert (await _lease(other, rid)).msg.body["key_name"] == "b"
    finally:
        await second.stop()
