"""A key pool from an inventory, live (issue 14, item 4): an inventory gives API ``llm`` two keys, the
controller is started as `tangram up` starts it (``controller_config`` of the loaded inventory written to
``controller.json``, `tangram controller` as a detached process on loopback ports, in a private
TANGRAM_HOME, secrets in its environment), a real client takes leases, reports a 429 and tokens, and
`tangram status` (a subprocess reading the real status socket) shows both keys with their counts, while
no secret appears in its output, its JSON, ``controller.json`` or the controller's log.

`tangram up INVENTORY` itself needs SSH for an inventory's hosts (tests/e2e covers that path); the
controller is the same process either way, and it needs no agent to grant leases."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cli import tangram

import tangram as tg
from tangram_cli import state as st
from tangram_cli.bootstrap import procs
from tangram_cli.inventory import load_inventory
from tangram_cli.inventory.configs import controller_config

pytestmark = pytest.mark.timeout(120)

SECRETS = {"TG_LIVE_KEY_A": "sk-live-aaaa-5151", "TG_LIVE_KEY_B": "sk-live-bbbb-6262"}
INVENTORY = """\
version: 1
cluster: keys-live
controller: {bind: 127.0.0.1, ports: {agents: 0, submit: 0, status: 0}}
groups:
  cpu:
    role: cpu
    hosts: [cpu-01.internal]
apis:
  search: {mode: concurrency, limit: 4}
  llm:
    keys:
      - {name: a, key_env: TG_LIVE_KEY_A, rpm: 2, tpm: 10000, concurrency: 4}
      - {name: b, key_env: TG_LIVE_KEY_B, rpm: 1}
"""


@pytest.fixture
def controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, st.ClusterState]]:
    """The inventory's controller, started as `tangram up` starts it; stopped with `tangram down`."""
    home = tmp_path / "home"
    monkeypatch.setenv("TANGRAM_HOME", str(home))
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)  # the controller's environment: it inherits this process's
    inv = load_inventory(INVENTORY)
    ports = {"agents": 0, "submit": 0, "status": 0}
    config = controller_config(inv)
    proc, _argv, got = procs.start_controller(inv.cluster, bind="127.0.0.1", ports=ports, config=config)
    assert proc is not None
    state = st.ClusterState(name=inv.cluster, controller_pid=proc.pid, ports=got, inventory="inventory.yaml")
    try:
        with st.locked(inv.cluster):
            st.write(state)
        yield home, state
    finally:
        down = tangram("down", "-c", inv.cluster, home=home, timeout=60)
        procs.terminate(proc.pid, timeout_s=5)
        proc.wait(5)
    assert down.returncode == 0, down.stdout + down.stderr


async def take_leases(client: tg.AsyncClient) -> Any:
    """a, b, a by headroom (a: 2 requests a minute, b: 1); b's holder reports a 429, a's first lease
    400 tokens; the last lease, of a, stays held: it is returned for the caller to release."""
    got = []
    for report in ({"tokens": 400}, {"rate_limited": True, "reset_s": 600}):
        async with client.api("llm", timeout=10, tokens=1000) as lease:
            got.append((lease.key_name, lease.key))
            lease.report(**report)
    held = await client.api("llm", timeout=10, tokens=1000).acquire()
    got.append((held.key_name, held.key))
    a, b = ("a", SECRETS["TG_LIVE_KEY_A"]), ("b", SECRETS["TG_LIVE_KEY_B"])
    assert got == [a, b, a]
    return held


def row_of(out: str, first: str, second: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:2] == [first, second])


async def test_status_shows_both_keys_of_an_inventorys_pool_with_their_counts(
    controller: tuple[Path, st.ClusterState],
) -> None:
    home, state = controller
    async with tg.AsyncClient(state.address, name="keys-live", connect_timeout=10) as client:
        held = await take_leases(client)
        table = tangram("status", "--apis", home=home)
        raw = tangram("status", "-o", "json", home=home)
        await held.release()
    assert table.returncode == 0, table.stdout + table.stderr
    lines = table.stdout.splitlines()
    head = next(line.split() for line in lines if line.split()[:2] == ["API", "KEY"])
    assert head == ["API", "KEY", "INFLIGHT", "REQ/MIN", "TOKENS/MIN", "COOLDOWN", "GRANTED", "429S"]
    # a: one lease held of 4, its minute's 2 requests used, 400 reported + 1000 charged of 10000 tokens
    assert row_of(table.stdout, "llm", "a") == ["llm", "a", "1/4", "2/2", "1400/10000", "-", "2", "0"]
    llm_b = row_of(table.stdout, "llm", "b")  # no tokens limit: the count alone; cooling for ~10 min
    assert llm_b[:5] == ["llm", "b", "0", "1/1", "1000"] and llm_b[6:] == ["1", "1"]
    assert llm_b[5].startswith("9m") or llm_b[5] == "10m00s", llm_b
    assert row_of(table.stdout, "search", "concurrency")[:3] == ["search", "concurrency", "0/4"]  # no keys
    llm = " ".join(row_of(table.stdout, "llm", "concurrency"))
    assert llm.startswith("llm concurrency 1 in flight (per-key limits)"), llm

    assert raw.returncode == 0, raw.stdout + raw.stderr
    apis = {a["api"]: a for a in json.loads(raw.stdout)["records"]["apis"]}
    keys = {k["key"]: k for k in apis["llm"]["keys"]}
    assert (keys["a"]["in_flight"], keys["a"]["rpm_used"], keys["a"]["tpm_used"]) == (1, 2, 1400)
    assert (keys["b"]["limited"], keys["b"]["granted"]) == (1, 1) and keys["b"]["cooling_s"] > 0
    assert apis["search"]["keys"] == []

    written = st.controller_config_path(state.name).read_text()
    assert '"key_env": "TG_LIVE_KEY_A"' in written  # the variable's name, as the inventory gave it
    log = (st.logs_dir(state.name) / "controller.log").read_text()
    for secret in SECRETS.values():
        for text in (table.stdout, table.stderr, raw.stdout, written, log):
            assert secret not in text
