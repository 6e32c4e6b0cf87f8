"""The controller's pool sizing (tangram_cli/controller/pools.py) against a real controller and agents on
real sockets: targets follow the opens the core places on each node, every Hello gets the full set (zeros
for pools nobody wants), and only agents that keep pools are told. The config parser's errors name the key."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.waiting import until

import tangram
from tangram.core.pool import PoolPolicy, PoolShape
from tangram.errors import ConfigError
from tangram_cli.controller.pools import parse_policy, shape_on

from .conftest import CONFIG

POOL_FACTS = {"pool": [{"image": "old:1", "mem_mib": 0, "target": 2, "idle": 2, "making": 0}],
              "image": "tangram/hostroot:1", "sandbox_mem_mib": 1024, "mem_mib": 65536}


async def test_targets_follow_the_opens_and_every_hello_gets_them_all(make_agent, controllers) -> None:
    c = await controllers({**CONFIG, "sandbox_pool": {"min": 1, "max": 4}})
    agent = await make_agent(c, "n1", cpus=(0, 1), facts_extra=POOL_FACTS)
    plain = await make_agent(c, "n2", cpus=(0, 1))  # no `pool` in its facts: never told
    # The Hello: the configured shape at `min`, and 0 for the pool it holds that nobody wants.
    await until(lambda: len(agent.pool_targets) == 2)
    assert sorted(agent.pool_targets) == [("", 0, 1), ("old:1", 0, 0)]
    async with tangram.AsyncClient(c.submit_addr, name="pools") as tg:
        boxes = [await tg.open_sandbox() for _ in range(6)]
        results = await asyncio.gather(*(b.exec("true", timeout=30) for b in boxes))
        assert all(r.exit_code == 0 for r in results)
        on_n1 = sum(r.node == "n1" for r in results)
        assert on_n1 >= 1
        # a burst of `on_n1` opens on n1 (the core spreads them by memory): its pool grows to that
        await until(lambda: agent.pool_targets[-1] == ("", 0, min(4, max(1, on_n1))))
        for b in boxes:
            await b.close()
    sent = len(agent.pool_targets)
    await asyncio.sleep(2.5)  # two sizing rounds: nothing changed, nothing sent again
    assert len(agent.pool_targets) == sent
    assert plain.pool_targets == []
    rows = {(r["node"], r["image"]): r["target"] for r in c.pools.rows()}
    assert rows == {("n1", ""): min(4, max(1, on_n1)), ("n1", "old:1"): 0}
    assert c.pools.counters["pool_target_errors"] == 0


async def test_pools_off_only_tells_agents_to_drop_what_they_hold(make_agent, controllers) -> None:
    c = await controllers()
    assert not c.config.sandbox_pool.enabled
    agent = await make_agent(c, "n1", cpus=(0, 1), facts_extra=POOL_FACTS)
    await until(lambda: agent.pool_targets == [("old:1", 0, 0)])
    async with tangram.AsyncClient(c.submit_addr, name="off") as tg, tg.sandbox() as sb:
        assert (await sb.exec("true", timeout=30)).exit_code == 0
    await asyncio.sleep(1.5)
    assert agent.pool_targets == [("old:1", 0, 0)]


def test_the_agents_default_image_names_the_same_pool_as_no_image() -> None:
    assert shape_on(POOL_FACTS, "tangram/hostroot:1", 0) == PoolShape("", 0)
    assert shape_on(POOL_FACTS, "", 512) == PoolShape("", 512)
    assert shape_on(POOL_FACTS, "swe:1", 0) == PoolShape("swe:1", 0)


def test_parse_policy() -> None:
    assert parse_policy(None) == PoolPolicy(max=0)
    assert parse_policy({}) == PoolPolicy()  # the mapping turns pools on
    got = parse_policy({"min": 2, "max": 8, "window_s": 5, "shapes": [{"image": "swe:1", "mem_mib": 2048}]})
    assert got == PoolPolicy(min=2, max=8, window_s=5.0, shapes=(PoolShape("swe:1", 2048),))


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ([], "expected a mapping"),
        ({"mxa": 3}, "unknown key 'mxa'"),
        ({"min": -1}, "sandbox_pool.min"),
        ({"min": 9, "max": 2}, "`min` (9) must not be more than `max` (2)"),
        ({"mem_fraction": 3}, "mem_fraction"),
        ({"shapes": [{"image": 3}]}, "sandbox_pool.shapes[0].image"),
        ({"shapes": [{"mem": 3}]}, "sandbox_pool.shapes[0]"),
    ],
)
def test_bad_policies_name_the_key(raw: Any, names: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy(raw)
    assert names in err.value.message


async def test_memory_no_trajectory_holds_bounds_the_pools(make_agent, controllers) -> None:
    """8 GiB offered, a quarter for pools, 1 GiB per pooled sandbox: at most 2 however many opens."""
    c = await controllers({**CONFIG, "sandbox_pool": {"min": 4, "max": 8}})
    agent = await make_agent(c, "n1", cpus=(0, 1), facts_extra={**POOL_FACTS, "mem_mib": 8192})
    await until(lambda: ("", 0, 2) in agent.pool_targets)
    assert ("", 0, 4) not in agent.pool_targets
