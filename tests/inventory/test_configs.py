"""The configurations an inventory makes (tangram_cli/inventory/configs.py): typed objects, written as
the files `tangram up` leaves on disk and read back by the process that uses them."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from agent.config import AgentConfig
from tangram.errors import ConfigError
from tangram_cli.controller.config import (
    BUILTIN_PROFILES,
    ApiConf,
    ApiKeyConf,
    ControllerConfig,
    parse_config,
)
from tangram_cli.inventory import load_inventory, local_default
from tangram_cli.inventory.configs import DEMO_REWARD, agent_config, controller_config

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = [ROOT / "inventory" / "example.yaml", ROOT / "inventory" / "local.yaml"]

# Every setting of ControllerConfig away from its default, in the file's own words.
FULL = {
    "cluster": "full",
    "cluster_id": "0123456789ab",
    "scheduler": {
        "depth": 3,
        "client_grace_s": 30.0,
        "max_timeout_s": 600.0,
        "heartbeat_s": 0.5,
        "max_outstanding_per_client": 64,
        "max_queued": 500,
        "max_outbox": 32,
        "max_client_bytes": 1 << 21,
        "max_held_bytes": 1 << 22,
        "stage_starts": False,
    },
    "services": [
        {"name": "rm", "runtime": "torch", "model": "/m/rm", "gpu_mem_mib": 2048, "chunk_sizes": [1, 2],
         "load_s": 1.5, "host_mem_mib": 4096, "weight_bytes": 1000, "options": {"dtype": "bf16"},
         "t_ori": 0.3},
        {"name": "bare", "gpus": [4]},
    ],
    "apis": [
        {"name": "search", "mode": "quota", "limit": 10, "period_s": 2.0},
        {"name": "llm",
         "keys": [{"key_env": "K0", "rpm": 5}, {"name": "two", "key_env": "K1", "concurrency": 2}]},
    ],
    "profiles": {"mine": {"efficiency": {"1": 1.0, "4": 0.5}}, "pytest": {"serial_fraction": 0.3}},
    "certs": "/c/certs",
    "metrics_port": 0,
    "metrics_clients": 3,
    "sandbox_pool": {"min": 1, "max": 8, "window_s": 5.0, "history_s": 300.0, "mem_fraction": 0.5,
                     "shapes": [{"image": "img:1", "mem_mib": 512}]},
    "jobs": {"grpo": {"weight": 3, "caps": {"cores": 64, "api:llm": 4}, "keys": ["alice"]}, "eval": {}},
}


def _inventories() -> list:
    return [local_default(), *(load_inventory(str(p)) for p in INVENTORIES)]


@pytest.mark.parametrize("local_demo", [False, True])
def test_an_inventorys_controller_config_is_what_the_controller_reads_back(local_demo: bool) -> None:
    for inv in _inventories():
        config = controller_config(inv, local_demo=local_demo)
        text = json.dumps(config.to_dict(), indent=2)
        assert parse_config(json.loads(text)) == config, inv.source
        assert config.cluster == inv.cluster
        assert {s.name for n in inv.nodes for s in n.services} <= {s.name for s in config.services}
        assert (config.service("reward") is not None) == (local_demo or any(
            s.name == "reward" for n in inv.nodes for s in n.services))


def test_every_setting_survives_the_file() -> None:
    config = parse_config(FULL)
    default = ControllerConfig()
    left = [f.name for f in fields(config) if getattr(config, f.name) == getattr(default, f.name)]
    assert not left, f"FULL leaves {left} at their defaults: give them a value, and check to_dict writes them"
    again = parse_config(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.to_dict() == config.to_dict()
    assert config.to_dict()["apis"][1]["keys"][0] == {"name": "k0", "key_env": "K0", "rpm": 5}


def test_stage_starts_goes_from_the_inventory_to_the_controller_and_bad_values_are_named() -> None:
    text = (ROOT / "inventory" / "local.yaml").read_text()
    assert controller_config(load_inventory(text)).stage_starts is True  # the default: on
    off = load_inventory(text.replace("  depth: 2", "  depth: 2\n  stage_starts: false", 1))
    assert off.scheduler.stage_starts is False and controller_config(off).stage_starts is False
    assert parse_config({}).stage_starts is True
    with pytest.raises(ConfigError, match="scheduler.stage_starts: expected true or false"):
        parse_config({"scheduler": {"stage_starts": "no"}})


def test_an_inventorys_key_pool_reaches_the_controller_and_reads_back() -> None:
    """example.yaml's ``llm`` pool (two keys, no API-wide limit) beside APIs without keys; a pool under
    an API-wide quota; unnamed keys are k0, k1, ... as the controller's config names them."""
    config = controller_config(load_inventory(ROOT / "inventory" / "example.yaml"))
    apis = {a.name: a for a in config.apis}
    assert apis["llm"] == ApiConf("llm", "concurrency", 0, 60.0, (
        ApiKeyConf("k0", "LLM_KEY_0", rpm=500, tpm=400_000, concurrency=64),
        ApiKeyConf("k1", "LLM_KEY_1", rpm=300, tpm=200_000),
    ))
    assert apis["search"].keys == (ApiKeyConf("k0", "SEARCH_API_KEY"),)  # one key_env: a pool of one
    assert apis["search"].limit == 64
    written = json.loads(json.dumps(config.to_dict()))
    assert parse_config(written) == config
    assert [k["key_env"] for k in written["apis"][2]["keys"]] == ["LLM_KEY_0", "LLM_KEY_1"]
    text = (ROOT / "inventory" / "local.yaml").read_text().replace(
        "  search: {mode: concurrency, limit: 16}",
        "  search: {mode: quota, limit: 100, period: 30s, keys: [{key_env: S0, tpm: 9000}, {key_env: S1}]}",
    )
    pooled = controller_config(load_inventory(text))
    (search,) = pooled.apis
    keys = (ApiKeyConf("k0", "S0", tpm=9000), ApiKeyConf("k1", "S1"))
    assert search == ApiConf("search", "quota", 100, 30.0, keys)
    assert parse_config(json.loads(json.dumps(pooled.to_dict()))) == pooled


def test_only_the_configs_own_profiles_are_written() -> None:
    assert parse_config({}).to_dict()["profiles"] == {}
    assert parse_config({}).to_dict() == {
        "cluster": "local",
        "scheduler": {"depth": 2, "client_grace_s": 60.0},
        "services": [],
        "apis": [],
        "profiles": {},
    }
    same_as_builtin = {"pytest": {"efficiency": {"1": 1.0, "2": 0.97, "4": 0.92, "8": 0.8, "16": 0.6}}}
    config = parse_config({"profiles": same_as_builtin})
    assert config.profiles["pytest"] == BUILTIN_PROFILES["pytest"]
    assert config.to_dict()["profiles"] == same_as_builtin  # the config gave it: it stays in the file
    assert replace(config, cluster_id="").to_dict() == config.to_dict()


def test_the_local_demo_adds_its_service_and_api_once() -> None:
    inv = local_default()
    config = controller_config(inv, local_demo=True)
    assert config.service("reward") == DEMO_REWARD
    assert [a.name for a in config.apis].count("search") == 1
    plain = controller_config(inv)
    assert plain.service("reward") is None
    assert [s.name for s in config.services] == [*(s.name for s in plain.services), "reward"]


def test_agent_json_names_what_up_decided_in_a_fixed_order(tmp_path: Path) -> None:
    node = local_default().nodes[0]
    curve = {"controller_public": "/c/controller.key", "secret": "/c/agent.key_secret"}
    cfg = agent_config(node, cluster="local", controller="tcp://127.0.0.1:5", workdir=str(tmp_path),
                       executor="process", emulated_gpus=2, gpu_mem_mib=1024, cpus=[0, 1], idle_cpus=[0],
                       curve=curve, cluster_id="0123456789ab")
    raw = json.loads(cfg.to_json())
    assert node.image and not node.mem_mib
    assert list(raw) == ["controller", "name", "cluster", "executor", "workdir", "cluster_id", "cpus",
                         "idle_cpus", "image", "emulated_gpus", "gpu_mem_mib", "curve"]
    assert raw["gpu_mem_mib"] == 1024 and raw["curve"] == curve
    trusted = cfg.with_values(trusted_code_only=True)
    assert list(json.loads(trusted.to_json()))[-1] == "trusted_code_only"
    assert cfg.fields_set == trusted.fields_set[:-1]  # the first is unchanged


def test_agent_json_is_what_the_agent_reads_back(tmp_path: Path) -> None:
    node = local_default().nodes[0]
    cfg = agent_config(node, cluster="local", controller="tcp://127.0.0.1:5", workdir=str(tmp_path),
                       executor="process", emulated_gpus=0, gpu_mem_mib=None, cpus=[0, 1], idle_cpus=[0])
    text = cfg.to_json()
    read = AgentConfig.from_dict(json.loads(text))
    assert read.to_json() == text  # the keys the file named, in its order
    assert (read.cpus, read.idle_cpus, read.workdir, read.executor) == ([0, 1], [0], str(tmp_path), "process")
    assert "gpu_mem_mib" not in json.loads(text)  # no emulated GPUs: the agent's own default
    with pytest.raises(ConfigError, match="unknown keys") as caught:
        AgentConfig.from_dict({**json.loads(text), "fields_set": ["name"]})
    assert "fields_set" not in (caught.value.hint or "")
    assert "fields_set" not in read.to_dict()


def test_a_remote_plain_agent_allows_remote_only_without_curve() -> None:
    node = local_default().nodes[0]
    kw = dict(cluster="c", controller="tcp://10.0.0.1:7700", workdir="/w", executor="auto", emulated_gpus=0,
              gpu_mem_mib=None, allow_remote=True)
    assert json.loads(agent_config(node, **kw).to_json())["allow_remote"] is True
    with_curve = agent_config(node, **kw, curve={"controller_public": "a", "secret": "b"})
    assert "allow_remote" not in json.loads(with_curve.to_json())
