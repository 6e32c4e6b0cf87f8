"""API key pools on a real controller (issue 14, item 4): an in-process controller on loopback
ports whose config gives an API several keys (secrets in environment variables), and a real
`AsyncClient` that leases, reports and releases. Secrets reach the lease's holder and nowhere
else: not the journal, the durable state file, `tangram status` records or the logs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram.errors import TangramError
from tangram_cli.controller.daemon import Controller

pytestmark = pytest.mark.timeout(60)

SECRETS = {"TG_TEST_KEY_A": "sk-test-aaaa-1111", "TG_TEST_KEY_B": "sk-test-bbbb-2222"}
CONFIG: dict[str, Any] = {
    "cluster": "keys",
    "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2},
    "apis": [
        {
            "name": "llm",
            "keys": [
                {"name": "a", "key_env": "TG_TEST_KEY_A", "rpm": 2, "tpm": 10_000, "concurrency": 4},
                {"name": "b", "key_env": "TG_TEST_KEY_B", "rpm": 1, "tpm": 10_000},
                {"name": "c", "key_env": "TG_TEST_KEY_UNSET", "rpm": 100},  # no secret: left out
            ],
        }
    ],
}


@pytest.fixture
async def keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, controllers: Any) -> Controller:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TG_TEST_KEY_UNSET", raising=False)
    return await controllers(CONFIG, journal=str(tmp_path / "journal"), state=str(tmp_path / "state.jsonl"))


async def test_leases_get_keys_with_room_reports_cool_keys_and_secrets_stay_out_of_records(
    keyed: Controller, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c = keyed
    async with tangram.AsyncClient(c.submit_addr, name="keys-test", connect_timeout=10) as tg:
        got = []
        for _ in range(3):  # a (2 RPM) and b (1 RPM): a, b, a by headroom; then both are full
            lease = await tg.api("llm", timeout=5, tokens=1000).acquire()
            got.append((lease.key_name, lease.key))
            await lease.release()
        assert got == [
            ("a", SECRETS["TG_TEST_KEY_A"]),
            ("b", SECRETS["TG_TEST_KEY_B"]),
            ("a", SECRETS["TG_TEST_KEY_A"]),
        ]
        assert "sk-test" not in repr(lease)
        with pytest.raises(TangramError):  # every key used its minute: the lease waits, then times out
            await tg.api("llm", timeout=0.5).acquire()

    rows = c._records(["apis"], 10)["apis"]
    (llm,) = [r for r in rows if r["api"] == "llm"]
    assert [(k["key"], k["rpm_used"], k["granted"]) for k in llm["keys"]] == [("a", 2, 2), ("b", 1, 1)]
    await c.stop()
    text = "\n".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())
    assert '"key":"a"' in text.replace(" ", "")  # the journal names the keys ...
    logged = "\n".join(r.getMessage() for r in [*caplog.get_records("setup"), *caplog.records])
    for secret in SECRETS.values():  # ... never their secrets
        assert secret not in text
        assert secret not in str(rows)
        assert secret not in logged
    assert "key c left out: $TG_TEST_KEY_UNSET is not set" in logged


async def test_a_rate_limit_report_cools_the_key_and_the_next_lease_gets_another(keyed: Controller) -> None:
    async with tangram.AsyncClient(keyed.submit_addr, name="keys-429", connect_timeout=10) as tg:
        async with tg.api("llm", timeout=5, tokens=500) as lease:
            assert lease.key_name == "a"
            lease.report(tokens=400, rate_limited=True, reset_s=30)  # the provider answered 429
        async with tg.api("llm", timeout=5) as lease:
            assert (lease.key_name, lease.key) == ("b", SECRETS["TG_TEST_KEY_B"])  # a cools down
        waiter = asyncio.ensure_future(tg.api("llm", timeout=1).acquire())  # b's minute used, a cooling
        with pytest.raises(TangramError):
            await waiter
    (llm,) = [r for r in keyed._records(["apis"], 10)["apis"] if r["api"] == "llm"]
    rows = {k["key"]: k for k in llm["keys"]}
    assert rows["a"]["limited"] == 1 and rows["a"]["cooling_s"] > 25
    assert rows["a"]["tpm_used"] == 400  # the report replaced the 500-token charge
