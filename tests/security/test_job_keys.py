"""A CURVE key bound to an RL job (issue 14, part 3): a client may not claim another job's name.

Real sockets: an in-process controller with CURVE, whose config binds key `alice` to job `grpo`
(weight 3); the client library with `alice`'s key and with `bob`'s (another allowed key, as
`tangram keys add bob` makes it). `bob` copies `alice`'s job name: refused, and the core never
puts `bob`'s work in that job. `alice` may not leave her job by naming another one, and lands in
it without naming any."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram.errors import VersionMismatch
from tangram_cli import keys
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options
from tangram_cli.controller.sessions import client_key

pytestmark = pytest.mark.timeout(60)
CONFIG: dict[str, Any] = {
    "cluster": "jobkeys",
    "scheduler": {"client_grace_s": 30, "heartbeat_s": 0.2},
    "jobs": {"grpo": {"weight": 3, "keys": ["alice"]}, "eval": {"weight": 1}},
}


@pytest.fixture
async def curve_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Any, ...]]:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path / "home"))
    for var in ("TANGRAM_ADDR", "TANGRAM_CERTS", "TANGRAM_CLUSTER", "TANGRAM_JOB"):
        monkeypatch.delenv(var, raising=False)
    certs = keys.ensure_cluster_keys("jobkeys", [])
    _, alice = keys.add_client("jobkeys", "alice")
    _, bob = keys.add_client("jobkeys", "bob")
    c = Controller(parse_config(CONFIG), Options(bind="127.0.0.1", certs=str(certs)))
    c.start()
    await c.check_security()
    try:
        yield c, str(alice), str(bob)
    finally:
        await c.stop()


def _job_of(c: Controller, tg: tangram.AsyncClient) -> str:
    return c.core.jobs.job_of(client_key(tg._transport.identity))


async def _in_job(c: Controller, tg: tangram.AsyncClient, job: str) -> bool:
    """Whether the core puts ``tg``'s actions in ``job`` once its `JobJoined` is handled."""
    for _ in range(200):
        if _job_of(c, tg) == job:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_another_key_cannot_claim_a_bound_job(curve_controller: tuple[Any, ...]) -> None:
    c, alice, bob = curve_controller
    async with tangram.AsyncClient(c.submit_addr, certs=alice, job="grpo", name="alice") as tg:
        assert await _in_job(c, tg, "grpo")
        with pytest.raises(
            VersionMismatch, match="job 'grpo' is bound to other keys; key 'bob' may not claim it"
        ):
            async with tangram.AsyncClient(
                c.submit_addr, certs=bob, job="grpo", name="alice", connect_timeout=5
            ):
                pass
        assert _job_of(c, tg) == "grpo"  # alice's session is untouched
    assert c.gateway.counters["job_refused"] == 1
    rows = {r["job"]: r for r in c._records(["jobs"], 10)["jobs"]}
    assert rows["grpo"]["clients"] <= 1 and "bob" not in str(rows)


async def test_a_bound_key_stays_in_its_job(curve_controller: tuple[Any, ...]) -> None:
    c, alice, bob = curve_controller
    with pytest.raises(
        VersionMismatch, match="key 'alice' is bound to job 'grpo'; it may not claim job 'eval'"
    ):
        async with tangram.AsyncClient(c.submit_addr, certs=alice, job="eval", connect_timeout=5):
            pass
    async with tangram.AsyncClient(c.submit_addr, certs=alice) as tg:  # names none: lands in its job
        assert await _in_job(c, tg, "grpo")
    async with tangram.AsyncClient(c.submit_addr, certs=bob, job="eval") as tg:  # an unbound job: anyone
        assert await _in_job(c, tg, "eval")
