"""RL jobs on the controller (issue 14, part 3): the `jobs` config (typed errors, round trip),
which job a client lands in (`admit_job`), and a real in-process controller with a fake agent
whose status records, JOBS table, `-o json` and Prometheus metrics show each job's weight,
holdings and core-seconds."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

import tangram
from tangram.errors import BadRequest, ConfigError
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.jobs_config import JobConf, admit_job, parse_jobs
from tangram_cli.errors import InventoryError
from tangram_cli.inventory import load_inventory
from tangram_cli.inventory.configs import controller_config
from tangram_cli.render import status as rs

from .test_metrics import scrape, value


@pytest.mark.parametrize(
    ("jobs", "error"),
    [
        ({"a": {"weight": -1}}, r"jobs\.a\.weight: expected a number > 0, got -1"),
        ({"a": {"weight": "3"}}, r"jobs\.a\.weight: expected a number > 0"),
        ({"a": {"caps": {"memory": 4}}}, r"jobs\.a\.caps: unknown resource 'memory' in caps"),
        ({"a": {"caps": {"cores": -4}}}, r"jobs\.a\.caps\.cores: expected an integer >= 0"),
        ({"a": {"caps": {"cores": 4, "cpus": 2}}}, r"'cpus' caps cpu a second time"),
        ({"a": {"wieght": 2}}, r"jobs\.a: unknown field 'wieght'"),
        ({"a b": {}}, r"jobs\.a b: bad job name"),
        ({"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}, r"key 'k' is bound to job 'a' already"),
        (["a"], r"jobs: expected a mapping"),
    ],
)
def test_bad_jobs_config_is_a_typed_error_naming_the_path(jobs: Any, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_config({"jobs": jobs})


def test_jobs_config_parses_and_round_trips() -> None:
    raw = {
        "g": {"weight": 3, "caps": {"cores": 8, "gpus": 2, "api": 4, "api:llm": 1}, "keys": ["alice"]},
        "e": {},
    }
    c = parse_config({"jobs": raw})
    assert c.jobs == (
        JobConf("g", 3.0, (("api", 4), ("api:llm", 1), ("cpu", 8), ("gpu", 2)), ("alice",)),
        JobConf("e", 1.0, (), ()),
    )
    assert parse_config(c.to_dict()) == c
    assert parse_jobs(None) == () and parse_config({}).jobs == ()
    assert c.jobs[0].event().caps == (("api", 4), ("api:llm", 1), ("cpu", 8), ("gpu", 2))


def test_which_job_a_client_lands_in() -> None:
    jobs = parse_jobs({"g": {"keys": ["alice"]}, "e": {}})
    assert admit_job(jobs, "", "alice") == ("g", None)  # bound: lands in its job
    assert admit_job(jobs, "g", "alice") == ("g", None)
    assert admit_job(jobs, "e", "alice")[1] == "key 'alice' is bound to job 'g'; it may not claim job 'e'"
    assert admit_job(jobs, "g", "bob")[1] == "job 'g' is bound to other keys; key 'bob' may not claim it"
    assert "without CURVE" in (admit_job(jobs, "g", None)[1] or "")
    assert admit_job(jobs, "e", "bob") == ("e", None) and admit_job(jobs, "new", None) == ("new", None)
    assert admit_job(jobs, "", None) == ("", None)


def test_a_bad_job_name_is_refused_by_the_client_library() -> None:
    with pytest.raises(BadRequest, match="bad job name 'a b'"):
        tangram.AsyncClient("tcp://127.0.0.1:1", job="a b", certs=None)


async def test_status_and_metrics_show_each_job(metered: Any, make_agent: Any) -> None:
    c = await metered(jobs={"grpo": {"weight": 3, "caps": {"cores": 2}}, "eval": {}})
    await make_agent(c, "n1", cpus=(0, 1, 2, 3))
    async with tangram.AsyncClient(c.submit_addr, name="trainer", job="grpo") as tg, tg.sandbox() as env:
        r = await env.exec("sleep 0.2", cpus=(1, 4), elastic="linear", duration_hint=1.0)
        assert len(r.cores) == 2  # the job's cap of 2 cores bounds the elastic grant
        rows = {row["job"]: row for row in c._records(["jobs"], 10)["jobs"]}
        assert rows["grpo"]["clients"] == 1 and rows["grpo"]["started"] >= 1
        assert rows["grpo"]["core_s"] > 0 and rows["grpo"]["caps"] == {"cpu": 2}
        assert rows["eval"]["weight"] == 1.0 and rows["eval"]["clients"] == 0
    records = c._records(["cluster", "nodes", "jobs"], 10)
    (table,) = [t for t in rs.tables(records, sections=rs.KNOWN_SECTIONS) if t[0] == "JOBS"]
    body = {r[0]: dict(zip(table[1], r, strict=True)) for r in table[2]}
    assert body["grpo"]["WEIGHT"] == "3" and body["grpo"]["CAPS"] == "cpu=2"
    assert rs.to_json(records)["records"]["jobs"] == records["jobs"]
    m = await scrape(c)
    assert value(m, "tangram_job_weight", job="grpo") == 3.0
    assert value(m, "tangram_job_core_seconds_total", job="grpo") == pytest.approx(
        rows["grpo"]["core_s"], abs=1.0
    )
    assert value(m, "tangram_job_actions_started_total", job="grpo") >= 1
    assert value(m, "tangram_job_cores", job="eval") == 0


async def test_status_and_metrics_show_each_jobs_memory_and_dominant_share(
    metered: Any, make_agent: Any
) -> None:
    """Two jobs' placed sandboxes hold 12 GiB and 1.5 GiB of a 48 GiB node: the records, the JOBS
    table, `-o json` and the metrics show each job's memory, and its dominant share is the larger
    of its memory share (grpo: 25%) and its cores share (eval: 2 of 4 cores running, 50%)."""
    c = await metered(jobs={"grpo": {"weight": 3}, "eval": {}})
    await make_agent(c, "n1", cpus=(0, 1, 2, 3), facts_extra={"mem_mib": 48 * 1024})
    async with (
        tangram.AsyncClient(c.submit_addr, name="trainer", job="grpo") as tg,
        tangram.AsyncClient(c.submit_addr, name="evaluator", job="eval") as te,
        tg.sandbox(mem="12GiB") as big,
        te.sandbox(mem=1536) as small,
    ):
        await big.exec("true", cpus=1)  # placing the trajectory binds its memory to the job
        running = asyncio.create_task(small.exec("sleep 30", cpus=2))
        for _ in range(500):
            if c.core.jobs.held.get("cpu", {}).get("eval") == 2:
                break
            await asyncio.sleep(0.01)
        records = c._records(["cluster", "nodes", "jobs"], 10)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, tangram.TangramError):
            await running
        rows = {row["job"]: row for row in records["jobs"]}
        assert rows["grpo"]["mem_mib"] == 12 * 1024 and rows["eval"]["mem_mib"] == 1536
        assert rows["grpo"]["dominant_share"] == 0.25  # memory binds: 12 of 48 GiB, no cores held
        assert rows["eval"]["cores"] == 2 and rows["eval"]["dominant_share"] == 0.5  # cores bind
        (table,) = [t for t in rs.tables(records, sections=rs.KNOWN_SECTIONS) if t[0] == "JOBS"]
        body = {r[0]: dict(zip(table[1], r, strict=True)) for r in table[2]}
        assert (body["grpo"]["MEM"], body["grpo"]["DOM-SHARE"]) == ("12GiB", "25%")
        assert (body["eval"]["MEM"], body["eval"]["DOM-SHARE"]) == ("1.5GiB", "50%")
        out = {r["job"]: r for r in rs.to_json(records)["records"]["jobs"]}
        assert (out["eval"]["mem_mib"], out["eval"]["dominant_share"]) == (1536, 0.5)
        m = await scrape(c)
        assert value(m, "tangram_job_mem_mib", job="grpo") == 12 * 1024
        assert value(m, "tangram_job_mem_mib", job="eval") == 1536
    for _ in range(500):  # closing the sandboxes releases their memory
        if not c.core.jobs.mem:
            break
        await asyncio.sleep(0.01)
    records = c._records(["cluster", "nodes", "jobs"], 10)
    assert {r["job"]: (r["mem_mib"], r["dominant_share"]) for r in records["jobs"]} == {
        "grpo": (0, 0.0), "eval": (0, 0.0)
    }
    (table,) = [t for t in rs.tables(records, sections=rs.KNOWN_SECTIONS) if t[0] == "JOBS"]
    assert {r[0]: (r[table[1].index("MEM")], r[table[1].index("DOM-SHARE")]) for r in table[2]} == {
        "grpo": ("-", "-"), "eval": ("-", "-")
    }


async def test_without_jobs_status_shows_no_jobs_table(metered: Any, make_agent: Any) -> None:
    c = await metered()
    await make_agent(c, "n1", cpus=(0, 1))
    async with tangram.AsyncClient(c.submit_addr, name="plain") as tg, tg.sandbox() as env:
        await env.exec("true", cpus=1)
    await asyncio.sleep(0)
    records = c._records(["cluster", "nodes", "jobs"], 10)
    assert [r["job"] for r in records["jobs"]] == [""]  # the default job only
    assert not [t for t in rs.tables(records) if t[0] == "JOBS"]


INVENTORY = """
version: 1
cluster: jobs-inv
controller: {bind: 127.0.0.1}
groups:
  local:
    role: cpu
    hosts: [{host: 127.0.0.1, connection: local}]
jobs:
  grpo: {weight: 3, caps: {cores: 4}, keys: [alice]}
"""


def test_an_inventorys_jobs_reach_the_controller_config(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    config = controller_config(load_inventory(str(path)))
    assert config.jobs == (JobConf("grpo", 3.0, (("cpu", 4),), ("alice",)),)
    path.write_text(INVENTORY.replace("weight: 3", "weight: -3"))
    with pytest.raises(InventoryError, match=r"jobs\.grpo\.weight: expected a number > 0, got -3"):
        load_inventory(str(path))
