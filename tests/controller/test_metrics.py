"""The controller's Prometheus endpoint (tangram_cli/controller/metrics_http.py), scraped over real HTTP
on 127.0.0.1 while a real in-process controller serves a fake agent over real ZeroMQ: the counters
and histograms say exactly what the actions that ran did (their clients' results are the reference),
client labels stay capped, and the per-action cost of recording stays small."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tangram
from tangram.errors import ActionTimeout, ConfigError, NoCapacity
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import Controller, Options
from tangram_cli.controller.metrics import OUTCOMES, TIME_BUCKETS

from .conftest import CONFIG

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def fetch(url: str, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - 127.0.0.1 only
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", exc.read().decode()


async def scrape(c: Controller) -> Samples:
    status, ctype, body = await asyncio.to_thread(fetch, c.ready_info()["metrics_addr"])
    assert status == 200 and ctype.startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples[(metric, frozenset(labels.items()))]


def close_below(recorded: float, answered: float) -> bool:
    """The controller records an action's end a moment before it answers it (same dispatch, two
    clock reads): what it recorded is at most what the client was told, and as good as equal to it
    unless the process was descheduled between the reads (a loaded machine)."""
    return answered - 0.1 <= recorded <= answered + 1e-5


def series(samples: Samples, metric: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in samples if n == metric]


async def _run_actions(c: Controller, raw_client: Any) -> dict[str, Any]:
    """Three execs, one exec no node can hold, three GPU calls, a lease held 0.2 s, one bad request."""
    execs, calls = [], []
    async with tangram.AsyncClient(c.submit_addr, name="alice") as tg:
        async with tg.sandbox() as env:
            execs.append(await env.exec("echo one", cpus=1))
            execs.append(await env.exec("sleep 0.05", cpus=1))
            execs.append(await env.exec("echo {dop}", cpus=(2, 2)))
            with pytest.raises(NoCapacity):
                await env.exec("true", cpus=8)  # no node has 8 cores: rejected, never started
        calls.append(await tg.call("echo", {"x": 1}, gpus=1, timeout=10))
        calls.append(await tg.call("echo", {"x": 2}, gpus=1, timeout=10))
        calls.append(await tg.call("echo", {"x": 3}, gpus=2, timeout=10))
        t0 = time.monotonic()
        async with tg.api("search"):
            await asyncio.sleep(0.2)
        lease_held = time.monotonic() - t0
    raw = raw_client(c.submit_addr)
    await raw.send_raw([b"garbage"])  # one bad request: a controller counter
    assert (await raw.recv()).msg.code == "BAD_REQUEST"
    return {"exec": execs, "call": calls, "lease_held": lease_held}


def _check_timings(m: Samples, ran: dict[str, Any]) -> None:
    """Queue wait, run time and overhead: the clients' results, action by action."""
    for kind in ("exec", "call"):
        results = ran[kind]
        assert value(m, "tangram_action_queue_wait_seconds_count", kind=kind) == 3
        assert value(m, "tangram_action_queue_wait_seconds_sum", kind=kind) == pytest.approx(
            sum(r.queued_s for r in results), abs=1e-5
        )
        assert value(m, "tangram_action_run_seconds_count", kind=kind) == 3
        assert value(m, "tangram_action_run_seconds_sum", kind=kind) == pytest.approx(
            sum(r.run_s for r in results), abs=1e-5
        )
        assert value(m, "tangram_action_overhead_seconds_count", kind=kind) == 3
        held_beyond = value(m, "tangram_action_overhead_seconds_sum", kind=kind)
        assert close_below(held_beyond, sum(r.overhead_s for r in results))
        assert value(m, "tangram_action_queue_wait_seconds_bucket", kind=kind, le="+Inf") == 3
        assert value(m, "tangram_actions_finished_total", kind=kind, outcome="ok") == 3
    assert value(m, "tangram_actions_finished_total", kind="exec", outcome="rejected") == 1
    assert value(m, "tangram_action_queue_wait_seconds_count", kind="lease") == 1
    assert value(m, "tangram_actions_finished_total", kind="lease", outcome="ok") == 1
    assert value(m, "tangram_action_run_seconds_count", kind="lease") == 1
    for kind in ("exec", "call"):  # every bucket holds the results at or under its bound
        for le in TIME_BUCKETS:
            want = sum(1 for x in ran[kind] if x.run_s <= le)
            assert value(m, "tangram_action_run_seconds_bucket", kind=kind, le=repr(le)) == want


def _check_units(m: Samples, ran: dict[str, Any]) -> None:
    """Units granted (cores per exec, GPUs per call, API units per lease) and resource-seconds:
    units x (run + overhead), the time the controller held them."""
    cores = [len(r.cores) for r in ran["exec"]]
    gpus = [len(r.gpus) for r in ran["call"]]
    assert cores == [1, 1, 2] and gpus == [1, 1, 2]
    for res, units in (("cpu", cores), ("gpu", gpus), ("api", [1])):
        assert value(m, "tangram_action_granted_units_count", resource=res) == len(units)
        assert value(m, "tangram_action_granted_units_sum", resource=res) == sum(units)
        assert value(m, "tangram_units_granted_total", resource=res) == sum(units)
    assert value(m, "tangram_action_granted_units_bucket", resource="cpu", le="1.0") == 2
    cpu_s = sum(len(r.cores) * (r.run_s + r.overhead_s) for r in ran["exec"])
    gpu_s = sum(len(r.gpus) * (r.run_s + r.overhead_s) for r in ran["call"])
    by_client = "tangram_client_resource_seconds_total"
    assert close_below(value(m, by_client, client="alice", resource="cpu"), cpu_s)
    assert close_below(value(m, by_client, client="alice", resource="gpu"), gpu_s)
    assert value(m, "tangram_service_gpu_seconds_total", service="echo") == value(
        m, by_client, client="alice", resource="gpu"
    )
    api_s = value(m, "tangram_api_unit_seconds_total", api="search")
    assert 0.2 <= api_s <= ran["lease_held"] + 1e-3
    assert value(m, by_client, client="alice", resource="api") == api_s
    assert {s["client"] for s in series(m, by_client)} == {"alice"}


async def test_scrape_reflects_exactly_the_actions_run(metered, make_agent, raw_client) -> None:
    c = await metered()
    agent = await make_agent(c, "n1", cpus=(0, 1), gpus=2, gpu_mem_mib=1000)  # one copy a GPU: evictions
    evicts: list[Any] = []
    real_evict = c.agents.evict
    c.agents.evict = lambda cmd: (evicts.append(cmd), real_evict(cmd))[1]  # count what the agent is sent
    before = await scrape(c)
    assert value(before, "tangram_action_queue_wait_seconds_count", kind="exec") == 0
    ran = await _run_actions(c, raw_client)
    m = await scrape(c)
    _check_timings(m, ran)
    _check_units(m, ran)
    # GPU restores and evictions: what the agent was told to do
    assert value(m, "tangram_gpu_restores_total", service="echo") == len(agent.loads) >= 1
    assert value(m, "tangram_gpu_evictions_total", service="echo") == len(evicts) >= 1
    # node utilisation, gauges and the controller's counters
    assert value(m, "tangram_node_cpus", node="n1") == 2 and value(m, "tangram_node_gpus", node="n1") == 2
    assert value(m, "tangram_node_cpus_used", node="n1") == 0 and value(m, "tangram_node_up", node="n1") == 1
    assert value(m, "tangram_agents_up") == 1 and value(m, "tangram_running_actions") == 0
    assert value(m, "tangram_controller_counter", name="bad_requests") == 1
    assert value(m, "tangram_controller_counter", name="finished") == 3 + 3 + 1


async def test_outcomes_of_actions_that_did_not_finish(metered, make_agent) -> None:
    c = await metered()
    agent = await make_agent(c, "n1", cpus=(0, 1))
    async with tangram.AsyncClient(c.submit_addr, name="carol") as tg, tg.sandbox() as env:
        with pytest.raises(ActionTimeout):
            await env.exec("sleep 30", cpus=2, timeout=0.3)  # killed at its timeout: ran, then timed out
        running = asyncio.ensure_future(env.exec("sleep 30", cpus=2))
        while len(agent.runs) < 2:
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(env.exec("true", cpus=2))  # waits for the cores
        await asyncio.sleep(0.1)
        queued.cancel()  # cancelled while queued: never started
        running.cancel()  # cancelled while running: killed
        for task in (queued, running):
            with pytest.raises(asyncio.CancelledError):
                await task
        for _ in range(300):
            if not c.registry.actions:
                break
            await asyncio.sleep(0.01)
    m = await scrape(c)
    got = {o: value(m, "tangram_actions_finished_total", kind="exec", outcome=o) for o in OUTCOMES}
    assert got == {"ok": 0, "error": 0, "cancelled": 1, "timeout": 1, "rejected": 1}
    assert value(m, "tangram_action_queue_wait_seconds_count", kind="exec") == 2  # the two that started
    assert value(m, "tangram_action_run_seconds_count", kind="exec") <= 2  # killed runs may still report
    held = value(m, "tangram_client_resource_seconds_total", client="carol", resource="cpu")
    assert held >= 2 * 0.3  # two cores for at least the 0.3 s timeout


async def test_node_gauges_show_cores_in_use(metered, make_agent) -> None:
    c = await metered()
    await make_agent(c, "n1", cpus=(0, 1))
    async with tangram.AsyncClient(c.submit_addr, name="bob") as tg, tg.sandbox() as env:
        task = asyncio.ensure_future(env.exec("sleep 1", cpus=2))
        for _ in range(200):
            if c.core.snapshot().running:
                break
            await asyncio.sleep(0.01)
        m = await scrape(c)
        assert value(m, "tangram_node_cpus_used", node="n1") == 2
        assert value(m, "tangram_running_actions") == 1
        await task


async def test_reserved_sandbox_counts_its_cores_while_open(metered, make_agent) -> None:
    c = await metered()
    await make_agent(c, "n1", cpus=(0, 1))
    async with tangram.AsyncClient(c.submit_addr, name="dave") as tg:
        t0 = time.monotonic()
        async with tg.sandbox(reserve=2) as env:
            await env.exec("true")
            await asyncio.sleep(0.2)
        open_for = time.monotonic() - t0
    for _ in range(300):
        if not c.registry.actions:
            break
        await asyncio.sleep(0.01)
    m = await scrape(c)
    assert value(m, "tangram_action_queue_wait_seconds_count", kind="open") == 1
    assert value(m, "tangram_actions_finished_total", kind="open", outcome="ok") == 1
    assert value(m, "tangram_action_queue_wait_seconds_count", kind="exec") == 1
    # the exec ran on the reservation's two cores: they count once, for the sandbox, while it was open
    assert value(m, "tangram_action_granted_units_sum", resource="cpu") == 2
    held = value(m, "tangram_client_resource_seconds_total", client="dave", resource="cpu")
    assert 2 * 0.2 <= held <= 2 * open_for


async def test_client_labels_are_capped(metered, make_agent) -> None:
    c = await metered(metrics_clients=2)
    await make_agent(c, "n1", cpus=(0, 1))
    held: dict[str, float] = {}
    for name in ("a", "b", "c", "d", "a"):
        async with tangram.AsyncClient(c.submit_addr, name=name) as tg, tg.sandbox() as env:
            r = await env.exec("true", cpus=1)
            label = name if name in ("a", "b") else "other"
            held[label] = held.get(label, 0.0) + r.run_s + r.overhead_s
    m = await scrape(c)
    rows = series(m, "tangram_client_resource_seconds_total")
    assert {s["client"] for s in rows} == {"a", "b", "other"}  # c and d share "other"
    for label, seconds in held.items():
        got = value(m, "tangram_client_resource_seconds_total", client=label, resource="cpu")
        assert close_below(got, seconds)


async def test_endpoint_paths_and_when_it_is_off(metered, make_controller) -> None:
    c = await metered()
    url = c.ready_info()["metrics_addr"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert (await asyncio.to_thread(fetch, url.replace("/metrics", "/nope")))[0] == 404
    assert (await asyncio.to_thread(fetch, url, "POST"))[0] == 405
    assert c.metrics_http.scrapes == 0
    await scrape(c)
    assert c.metrics_http.scrapes == 1
    with pytest.raises(ConfigError, match="cannot bind the metrics endpoint"):
        Controller(parse_config(CONFIG), Options(bind="127.0.0.1", metrics_port=c.metrics_http.port))
    with pytest.raises(ValueError, match="every interface"):  # the controller's bind rule holds for it
        Controller(parse_config(CONFIG), Options(bind="0.0.0.0", metrics_port=0))
    off = await make_controller()  # no port anywhere: no endpoint, nothing recorded
    assert off.metrics is None and off.metrics_http is None and "metrics" not in off.ready_info()


def test_recording_counts_every_exec_once() -> None:
    """The hot path as the driver hands it over: an exec's start (Spawn) and end (Done), for many
    actions; each is counted once (the per-action cost is measured by a benchmark, never here)."""
    from tangram.core import commands as cmd
    from tangram.outcomes import ExecOutcome
    from tangram_cli.controller.metrics import Metrics
    from tangram_cli.controller.state import ActionRecord, Outcome

    n = 2_000
    actions = {}
    for i in range(n):
        rec = ActionRecord(f"x{i}", "exec", b"id%d" % (i % 50), i, f"k{i % 50}", 0.0, 1e9, sandbox="sb")
        rec.started, rec.cores = 0.001, (0, 1)
        rec.outcome = Outcome(result=ExecOutcome(run_s=0.01, exit_code=0))
        actions[rec.action_id] = rec
    m = Metrics(actions, lambda ident: ident.decode(), 20)
    for i in range(n):
        m.on_commands([cmd.Spawn(f"x{i}", "n1", "sb", (0, 1), 2)], 0.5)
    for i in range(n):
        m.on_commands([cmd.Done(f"x{i}", True)], 0.7)
    assert m.finished["exec"]["ok"] == n and m.wait["exec"].count == n


KEY_SECRETS = {"TG_METRICS_KEY_A": "sk-metrics-aaaa-7373", "TG_METRICS_KEY_B": "sk-metrics-bbbb-8484"}
KEYED_APIS = [
    {
        "name": "llm",
        "keys": [
            {"name": "a", "key_env": "TG_METRICS_KEY_A", "rpm": 10, "tpm": 10_000, "concurrency": 2},
            {"name": "b", "key_env": "TG_METRICS_KEY_B", "rpm": 5},
        ],
    }
]
KEY_SERIES = (
    "tangram_api_key_minute_requests",
    "tangram_api_key_minute_tokens",
    "tangram_api_key_leases_in_flight",
    "tangram_api_key_leases_granted_total",
    "tangram_api_key_rate_limited_total",
    "tangram_api_key_cooling",
)


async def scrape_keys(c: Controller) -> tuple[dict[str, tuple[float, ...]], str]:
    """Each key's series (in KEY_SERIES order) by key name, and the whole scrape's text."""
    status, _, body = await asyncio.to_thread(fetch, c.ready_info()["metrics_addr"])
    assert status == 200
    out: Samples = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    keys = {labels["key"] for name in KEY_SERIES for labels in series(out, name)}
    return {k: tuple(value(out, name, api="llm", key=k) for name in KEY_SERIES) for k in sorted(keys)}, body


async def test_api_key_pool_series_per_key_and_never_a_secret(metered, monkeypatch) -> None:
    for name, secret in KEY_SECRETS.items():
        monkeypatch.setenv(name, secret)
    c = await metered(apis=KEYED_APIS)
    before, _ = await scrape_keys(c)
    assert before == {"a": (0, 0, 0, 0, 0, 0), "b": (0, 0, 0, 0, 0, 0)}  # every key, before any lease
    bodies = []
    async with tangram.AsyncClient(c.submit_addr, name="keys") as tg:
        lease = await tg.api("llm", timeout=5, tokens=1000).acquire()
        assert (lease.key_name, lease.key) == ("a", KEY_SECRETS["TG_METRICS_KEY_A"])  # the most headroom: a
        held, body = await scrape_keys(c)
        bodies.append(body)
        # a: one request and its 1000-token charge in the minute, one lease in flight, granted once
        assert held == {"a": (1, 1000, 1, 1, 0, 0), "b": (0, 0, 0, 0, 0, 0)}
        lease.report(tokens=400, rate_limited=True, reset_s=30)  # the provider answered 429
        await lease.release()
        want = {"a": (1, 400, 0, 1, 1, 1), "b": (0, 0, 0, 0, 0, 0)}  # the report replaced the charge
        for _ in range(200):
            after, body = await scrape_keys(c)
            if after == want:
                break
            await asyncio.sleep(0.02)
        bodies.append(body)
        assert after == want
    for body in bodies:
        assert 'key="a"' in body
        for secret in KEY_SECRETS.values():
            assert secret not in body and secret[:12] not in body
