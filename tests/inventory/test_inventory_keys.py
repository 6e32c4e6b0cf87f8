"""API key pools in the inventory (issue 14, item 4): `apis.NAME.keys` lists keys, each naming the
environment variable that holds its secret on the controller's host (`key_env`) and its limits
(`rpm`, `tpm`, `concurrency`). Bad entries are named by path with the fix, all at once; a secret
written into the file is refused; a good pool reaches the controller's config unchanged."""

from __future__ import annotations

import json

import pytest

from tangram_cli.controller.config import ApiKeyConf, parse_config
from tangram_cli.errors import InventoryError
from tangram_cli.inventory import load_inventory, to_dict
from tangram_cli.inventory.configs import controller_config
from tangram_cli.inventory.model import ApiKey

HEAD = """\
version: 1
cluster: pools
groups:
  cpu:
    role: cpu
    hosts: [cpu-01.internal]
apis:
"""
POOL = """\
  llm:
    keys:
      - {name: main, key_env: LLM_KEY_MAIN, rpm: 500, tpm: 400000, concurrency: 64}
      - {key_env: LLM_KEY_SPARE, rpm: 300}
"""


def problems(apis: str) -> list[str]:
    with pytest.raises(InventoryError) as info:
        load_inventory(HEAD + apis)
    assert info.value.exit_code == 2 and info.value.hint
    return [str(p) for p in info.value.problems]


def test_a_pool_of_two_keys_loads_shows_and_reaches_the_controller() -> None:
    inv = load_inventory(HEAD + POOL)
    (api,) = inv.apis
    assert (api.mode, api.limit, api.period_ms) == ("concurrency", 0, None)  # no API-wide limit
    assert api.keys == (
        ApiKey("main", "LLM_KEY_MAIN", rpm=500, tpm=400_000, concurrency=64),
        ApiKey("k1", "LLM_KEY_SPARE", rpm=300),  # unnamed: k<position>, as the controller names it
    )
    assert to_dict(inv)["apis"][0]["keys"][1] == {
        "name": "k1", "key_env": "LLM_KEY_SPARE", "rpm": 300, "tpm": 0, "concurrency": 0,
    }
    config = controller_config(inv)
    assert config.apis[0].keys == (
        ApiKeyConf("main", "LLM_KEY_MAIN", 500, 400_000, 64),
        ApiKeyConf("k1", "LLM_KEY_SPARE", 300),
    )
    assert parse_config(json.loads(json.dumps(config.to_dict()))) == config


def test_a_pool_under_an_api_wide_limit_keeps_both() -> None:
    (api,) = load_inventory(HEAD + "  llm: {mode: concurrency, limit: 8, keys: [{key_env: K}]}\n").apis
    assert (api.mode, api.limit, api.keys) == ("concurrency", 8, (ApiKey("k0", "K"),))
    (api,) = load_inventory(HEAD + "  llm: {limit: 8, keys: [{key_env: K}]}\n").apis  # mode: concurrency
    assert (api.mode, api.limit) == ("concurrency", 8)


@pytest.mark.parametrize(
    ("apis", "expected"),
    [
        # secrets: a field that looks like one, or a secret where the variable's name belongs
        (
            "  llm: {keys: [{key_env: LLM_KEY, key: sk-live-123}]}\n",
            "apis.llm.keys[0].key: inline secrets are not allowed; put the secret in an environment "
            "variable on the controller's host and name that variable with key_env",
        ),
        ("  llm: {keys: [{key_env: LLM_KEY, api_key: sk-1}]}\n", "apis.llm.keys[0].api_key: inline secrets"),
        ("  llm: {keys: [{key_env: LLM_KEY, secret: x}]}\n", "apis.llm.keys[0].secret: inline secrets"),
        ("  llm: {keys: [{key_env: LLM_KEY, token: x}]}\n", "apis.llm.keys[0].token: inline secrets"),
        (
            "  llm: {keys: [{key_env: sk-live-123}]}\n",
            "apis.llm.keys[0].key_env: key_env must name an environment variable (like SEARCH_API_KEY) "
            "that holds the secret on the controller's host, not the secret itself",
        ),
        # the entries themselves
        ("  llm: {keys: [{name: a, rpm: 3}]}\n", "apis.llm.keys[0].key_env: required key missing"),
        ("  llm: {keys: [{key_env: A, rmp: 3}]}\n", "apis.llm.keys[0].rmp: unknown key (did you mean 'rpm'"),
        ("  llm: {keys: [{key_env: A, rpm: -1}]}\n", "apis.llm.keys[0].rpm: must be between 0 (no limit)"),
        ("  llm: {keys: [{key_env: A, tpm: 1.5}]}\n", "apis.llm.keys[0].tpm: expected a whole number"),
        ("  llm: {keys: [{key_env: A, concurrency: '4'}]}\n", "apis.llm.keys[0].concurrency: expected a"),
        ("  llm: {keys: [{name: 'a b', key_env: A}]}\n", "apis.llm.keys[0].name: invalid key name 'a b'"),
        ("  llm: {keys: [{name: no, key_env: A}]}\n", "apis.llm.keys[0].name: expected a string"),
        ("  llm: {keys: [A_KEY]}\n", "apis.llm.keys[0]: expected a mapping, got str 'A_KEY'"),
        # the pool
        ("  llm: {keys: {key_env: A}}\n", "apis.llm.keys: expected a list, got a mapping"),
        ("  llm: {keys: []}\n", "apis.llm.keys: empty: list at least one key, or leave 'keys' out"),
        (
            "  llm: {keys: [{key_env: A}, {key_env: A}]}\n",
            "apis.llm.keys: key_env 'A' is given to two keys (one variable per key)",
        ),
        (
            "  llm: {keys: [{key_env: A}, {name: k0, key_env: B}]}\n",
            "apis.llm.keys: name 'k0' is given to two keys (unnamed keys are k0, k1, ...)",
        ),
        ("  llm: {key_env: A, keys: [{key_env: B}]}\n", "apis.llm: give 'key_env' (one key) or 'keys'"),
        ("  llm: {}\n", "apis.llm: give 'mode' and 'limit' (the API's limit), or 'keys' (a key pool)"),
        ("  llm: {mode: quota, keys: [{key_env: A}]}\n", "apis.llm: mode 'quota' needs 'limit'"),
        ("  llm: {period: 60s, keys: [{key_env: A}]}\n", "apis.llm: 'period' applies to mode 'quota' only"),
    ],
)
def test_a_bad_pool_names_the_path_the_problem_and_the_fix(apis: str, expected: str) -> None:
    found = problems(apis)
    assert any(p.startswith(expected) for p in found), found


def test_every_bad_key_is_reported_at_once_and_no_secret_is_echoed() -> None:
    found = problems(
        "  llm:\n    keys:\n"
        "      - {key_env: A, key: sk-live-very-secret}\n"
        "      - {rpm: -5}\n"
        "  search: {mode: concurrency, limit: 0}\n"
    )
    assert [p.split(":")[0] for p in found] == [
        "apis.llm.keys[0].key", "apis.llm.keys[1].key_env", "apis.llm.keys[1].rpm", "apis.search.limit",
    ]
    assert not any("sk-live-very-secret" in p for p in found)


def test_a_single_key_env_is_a_pool_of_one_key_under_the_apis_own_limit():
    inv = load_inventory(HEAD + "  search: {mode: concurrency, limit: 8, key_env: SEARCH_API_KEY}\n")
    (api,) = controller_config(inv).apis
    assert (api.mode, api.limit) == ("concurrency", 8)
    assert api.keys == (ApiKeyConf("k0", "SEARCH_API_KEY", 0, 0, 0),)
    assert parse_config(controller_config(inv).to_dict()) == controller_config(inv)
    (plain,) = controller_config(load_inventory(HEAD + "  search: {mode: concurrency, limit: 8}\n")).apis
    assert plain.keys == ()
