"""Inventory loading: every bad-input class names its path and problem; all errors at once."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tangram_cli.errors import InventoryError
from tangram_cli.inventory import load_inventory, local_default, local_inventory_text, to_dict, to_json
from tangram_cli.inventory.model import parse_destination, parse_duration_ms, parse_size_mib

ROOT = Path(__file__).resolve().parents[2]

BASE = """
version: 1
cluster: c1
defaults:
  ssh: {user: ubuntu, port: 22, host_key_policy: accept-new, connect_timeout: 10s}
controller: {bind: 10.0.0.10, ports: {agents: 7700, submit: 7701, status: 7702}}
scheduler: {depth: 2, client_grace: 60s}
groups:
  sandbox-cpu:
    role: cpu
    hosts: ["cpu-[01-02].internal", {host: 10.0.1.17, ssh: {user: ops, port: 2222}}]
    vars: {cpus: "2-15", idle_cpus: "0-1", mem: 64GiB, executor: auto, image: "swe:1"}
  reward-gpu:
    role: gpu
    hosts: ["gpu-01.internal"]
    vars:
      gpus: all
      gpu_mem: 80GiB
      services: [{name: rm-7b, runtime: vllm, model: /models/rm-7b, gpus: [1, 2], gpu_mem: 18GiB}]
apis:
  search: {mode: concurrency, limit: 64, key_env: SEARCH_API_KEY}
  pdf: {mode: quota, limit: 3000, period: 60s}
profiles:
  pytest: {efficiency: {1: 1.0, 2: 0.9}}
"""


def problems(text: str, **kw) -> list[str]:
    with pytest.raises(InventoryError) as info:
        load_inventory(textwrap.dedent(text), **kw)
    err = info.value
    assert err.exit_code == 2 and err.hint
    lines = [str(p) for p in err.problems]
    assert err.message.count("\n") == len(lines)  # one per line
    return lines


def edit(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new, 1)


def one(text: str, path: str, fragment: str) -> None:
    found = problems(text)
    assert any(p.startswith(path) and fragment in p for p in found), found


def test_base_resolves():
    inv = load_inventory(BASE)
    names = [n.name for n in inv.nodes]
    assert names == ["cpu-01.internal", "cpu-02.internal", "10.0.1.17", "gpu-01.internal"]
    legacy = inv.node("10.0.1.17")
    assert (legacy.user, legacy.port, legacy.mem_mib, legacy.cpus) == (
        "ops",
        2222,
        65536,
        tuple(range(2, 16)),
    )
    gpu = inv.node("gpu-01.internal")
    assert gpu.gpus == "all" and gpu.services[0].gpus == (1, 2) and gpu.services[0].gpu_mem_mib == 18432
    assert gpu.connect_timeout_ms == 10_000 and gpu.host_key_policy == "accept-new"
    assert inv.apis[1].period_ms == 60_000 and inv.scheduler.client_grace_ms == 60_000
    assert inv.groups == {
        "sandbox-cpu": ("cpu-01.internal", "cpu-02.internal", "10.0.1.17"),
        "reward-gpu": ("gpu-01.internal",),
    }


@pytest.mark.parametrize(
    ("old", "new", "path", "fragment"),
    [
        # unknown keys, one typo per section, with did-you-mean
        ("cluster: c1", "cluster: c1\nclustre: x", "clustre", "did you mean 'cluster'?"),
        ("port: 22,", "prot: 22,", "defaults.ssh.prot", "did you mean 'port'?"),
        ("bind: 10.0.0.10,", "bnd: 10.0.0.10,", "controller.bnd", "did you mean 'bind'?"),
        ("depth: 2,", "dept: 2,", "scheduler.dept", "did you mean 'depth'?"),
        ("role: cpu", "rol: cpu", "groups.sandbox-cpu.rol", "did you mean 'role'?"),
        ("idle_cpus:", "idle_cpu:", "groups.sandbox-cpu.vars.idle_cpu", "did you mean 'idle_cpus'?"),
        (
            "{user: ops, port: 2222}",
            "{user: ops, prot: 2222}",
            "groups.sandbox-cpu.hosts[1].ssh.prot",
            "unknown key (did you mean 'port'?)",
        ),
        (
            "gpus: [1, 2], gpu_mem",
            "gpu: [1, 2], gpu_mem",
            "groups.reward-gpu.vars.services[0].gpu",
            "did you mean 'gpus'?",
        ),
        ("limit: 64,", "limt: 64,", "apis.search.limt", "did you mean 'limit'?"),
        ("{efficiency:", "{eficiency:", "profiles.pytest.eficiency", "did you mean 'efficiency'?"),
        (
            "host_key_policy: accept-new",
            "host_key_policy: acept-new",
            "defaults.ssh.host_key_policy",
            "did you mean 'accept-new'?",
        ),
        (
            "runtime: vllm",
            "runtime: vlm",
            "groups.reward-gpu.vars.services[0].runtime",
            "did you mean 'vllm'?",
        ),
        # YAML booleans where strings belong
        ('image: "swe:1"', "image: no", "groups.sandbox-cpu.vars.image", "quote it"),
        ("user: ubuntu", "user: yes", "defaults.ssh.user", "quote it"),
        ("user: ops", "user: on", "groups.sandbox-cpu.hosts[1].ssh.user", "quote it"),
        # units
        ("mem: 64GiB", "mem: 64G", "groups.sandbox-cpu.vars.mem", "ambiguous unit 'G'"),
        ("mem: 64GiB", "mem: 64XB", "groups.sandbox-cpu.vars.mem", "unknown unit 'XB'"),
        ("mem: 64GiB", "mem: 64", "groups.sandbox-cpu.vars.mem", "unit"),
        ("client_grace: 60s", "client_grace: 60 parsecs", "scheduler.client_grace", "duration"),
        ("connect_timeout: 10s", "connect_timeout: 10", "defaults.ssh.connect_timeout", "duration"),
        # cores and cpusets
        ('cpus: "2-15"', "cpus: -1", "groups.sandbox-cpu.vars.cpus", "cpulist"),
        ('cpus: "2-15"', "cpus: 0", "groups.sandbox-cpu.vars.cpus", "cpulist"),
        ('cpus: "2-15"', "cpus: 1.5", "groups.sandbox-cpu.vars.cpus", "cpulist"),
        ('cpus: "2-15"', 'cpus: "15-2"', "groups.sandbox-cpu.vars.cpus", "reversed"),
        ('cpus: "2-15"', 'cpus: "1,1"', "groups.sandbox-cpu.vars.cpus", "twice"),
        ('cpus: "2-15"', 'cpus: "0-"', "groups.sandbox-cpu.vars.cpus", "not N or N-M"),
        ('cpus: "2-15"', 'cpus: "007"', "groups.sandbox-cpu.vars.cpus", "no leading zeros"),
        ('cpus: "2-15"', 'cpus: ""', "groups.sandbox-cpu.vars.cpus", "empty cpulist"),
        (
            'cpus: "2-15"',
            'cpus: "0-15"',
            "groups.sandbox-cpu.hosts[0] (cpu-[01-02].internal)",
            "overlap idle_cpus",
        ),
        # GPUs and chunks
        ("gpus: all", "gpus: 3", "groups.reward-gpu.vars.gpus", "0, 1, 2, 4 or 8"),
        ("gpus: all", "gpus: 16", "groups.reward-gpu.vars.gpus", "0, 1, 2, 4 or 8"),
        ("gpus: all", "gpus: [0, 1]", "groups.reward-gpu.vars.gpus", "bare GPU indices"),
        ("gpus: all", "gpus: 8", "groups.reward-gpu.hosts[0] (gpu-01.internal)", "emulated_gpus: true"),
        (
            "gpus: [1, 2], gpu_mem",
            "gpus: [1, 3], gpu_mem",
            "groups.reward-gpu.vars.services[0].gpus",
            "{1, 2, 4, 8}",
        ),
        ("gpu_mem: 18GiB", "gpu_mem: 90GiB", "groups.reward-gpu.hosts[0]", "more than the GPU's"),
        # controller
        ("bind: 10.0.0.10", "bind: 0.0.0.0", "controller.bind", "every interface"),
        ("bind: 10.0.0.10", "bind: '*'", "controller.bind", "every interface"),
        ("agents: 7700", "agents: 0", "controller", "loopback"),
        ("agents: 7700", "agents: 70000", "controller.ports.agents", "outside 1-65535"),
        ("submit: 7701", "submit: 7700", "controller", "must differ"),
        ("port: 2222", "port: 0", "groups.sandbox-cpu.hosts[1].ssh.port", "outside 1-65535"),
        ("port: 2222", "port: 65536", "groups.sandbox-cpu.hosts[1].ssh.port", "outside 1-65535"),
        # secrets
        (
            "key_env: SEARCH_API_KEY}",
            "key_env: SEARCH_API_KEY, api_key: sk-123}",
            "apis.search.api_key",
            "inline secrets",
        ),
        ("key_env: SEARCH_API_KEY}", "key_env: sk-live-123}", "apis.search.key_env", "environment variable"),
        ("user: ubuntu,", "user: ubuntu, password: hunter2,", "defaults.ssh.password", "inline secrets"),
        # profiles
        (
            "scheduler: {depth: 2,",
            "scheduler: {default_profile: pytst, depth: 2,",
            "scheduler.default_profile",
            "unknown profile 'pytst' (did you mean 'pytest'?)",
        ),
        (
            "{efficiency: {1: 1.0, 2: 0.9}}",
            "{efficiency: {1: 1.0}, serial_fraction: 0.1}",
            "profiles.pytest",
            "exactly one",
        ),
        # apis
        (
            "{mode: quota, limit: 3000, period: 60s}",
            "{mode: quota, limit: 3000}",
            "apis.pdf",
            "needs 'period'",
        ),
        ("limit: 64,", "limit: 0,", "apis.search.limit", "between 1"),
        # models
        ("model: /models/rm-7b", "model: /models/../etc", "groups.reward-gpu.vars.services[0].model", "'..'"),
    ],
)
def test_bad_values(old, new, path, fragment):
    one(edit(old, new), path, fragment)


@pytest.mark.parametrize(
    "host",
    [
        "host;rm -rf ~",
        "$(id)",
        "`id`",
        "a b",
        "-oProxyCommand=evil",
        "ho\nst",
        "host|cat",
        "..",
        "a..b",
        "under_score",
        "x" * 64 + ".com",
        "[nope]",
        "1.2.3.999",
    ],
)
def test_hostile_host_names(host):
    text = edit('hosts: ["gpu-01.internal"]', f"hosts: [{host!r}]".replace("'\\n'", "\\n"))
    if "\n" in host:
        text = edit('hosts: ["gpu-01.internal"]', 'hosts: ["ho\\nst"]')
    found = problems(text)
    assert any(p.startswith("groups.reward-gpu.hosts[0]") for p in found), found


def test_hostile_mapping_host_and_user():
    text = edit("{host: 10.0.1.17,", "{host: '$(reboot)',").replace("user: ops", "user: '-oops'")
    found = problems(text)
    assert any(p.startswith("groups.sandbox-cpu.hosts[1].host") for p in found)
    assert any(p.startswith("groups.sandbox-cpu.hosts[1].ssh.user") for p in found)


def test_all_errors_at_once():
    text = (
        BASE.replace("port: 22,", "prot: 22,")
        .replace("bind: 10.0.0.10", "bind: 0.0.0.0")
        .replace("mem: 64GiB", "mem: 64G")
        .replace("gpus: all", "gpus: 3")
        .replace("limit: 64,", "limt: 64,")
    )
    found = problems(text)
    assert len(found) == 5, found
    for path in (
        "defaults.ssh.prot",
        "controller.bind",
        "groups.sandbox-cpu.vars.mem",
        "groups.reward-gpu.vars.gpus",
        "apis.search.limt",
    ):
        assert any(p.startswith(path) for p in found), (path, found)


def test_duplicate_yaml_keys_with_line_numbers():
    found = problems(
        "version: 1\ncluster: a\ncluster: b\ngroups:\n  g: {role: cpu, hosts: [h1], role: gpu}\n"
    )
    assert "line 3: duplicate key 'cluster' (first at line 2)" in found
    assert any("duplicate key 'role'" in p and p.startswith("line 5") for p in found)


def test_yaml_syntax_error_has_a_position():
    found = problems("version: 1\ncluster: [a\n")
    assert found[0].startswith("line ") and "YAML syntax" in found[0]


def test_sexagesimal_is_not_a_number():
    one(edit("port: 2222", "port: 22:22"), "groups.sandbox-cpu.hosts[1].ssh.port", "")


def test_host_in_two_groups_and_duplicates():
    one(
        edit('hosts: ["gpu-01.internal"]', 'hosts: ["gpu-01.internal", "cpu-02.internal"]'),
        "groups.reward-gpu.hosts[1]",
        "also in group 'sandbox-cpu'",
    )
    one(
        edit('"cpu-[01-02].internal", {host', '"cpu-[01-02].internal", "10.0.1.17:2222", {host'),
        "groups.sandbox-cpu.hosts[2]",
        "duplicate host:port 10.0.1.17:2222",
    )
    one(
        edit("{host: 10.0.1.17,", "{host: 10.0.1.17, name: cpu-01.internal,"),
        "groups.sandbox-cpu.hosts[1]",
        "duplicate node name 'cpu-01.internal'",
    )


def test_missing_and_wrong_top_level():
    found = problems("cluster: a\ngroups: {}\n")
    assert "version: required key missing" in found
    found = problems("version: 2\ncluster: 'a b'\ngroups: {g: {role: cpu, hosts: []}}\n")
    assert any(p.startswith("version:") for p in found) and any(p.startswith("cluster:") for p in found)
    assert "groups.g.hosts: no hosts listed" in found
    assert problems("- just\n- a list\n")[0].startswith("the inventory must be a mapping")


def test_hostlists_and_destinations_in_host_strings():
    inv = load_inventory(
        edit(
            'hosts: ["gpu-01.internal"]',
            'hosts: ["ops@gpu-[01-02,05].internal:2200", "[fd00::1]:2201", "fd00::2"]',
        )
    )
    gpus = [n for n in inv.nodes if n.group == "reward-gpu"]
    assert [n.name for n in gpus] == [
        "gpu-01.internal",
        "gpu-02.internal",
        "gpu-05.internal",
        "fd00::1",
        "fd00::2",
    ]
    assert {(n.user, n.port) for n in gpus[:3]} == {("ops", 2200)}
    assert gpus[3].host == "fd00::1" and gpus[3].port == 2201 and gpus[3].address == "[fd00::1]:2201"
    assert gpus[4].port == 22


def test_precedence_defaults_group_host_flags():
    text = edit(
        'hosts: ["cpu-[01-02].internal", {host: 10.0.1.17, ssh: {user: ops, port: 2222}}]',
        'ssh: {user: grp}\n    hosts: ["cpu-01.internal", {host: 10.0.1.17, ssh: {user: ops, port: 2222},'
        " vars: {executor: docker}}]",
    )
    inv = load_inventory(text)
    assert inv.node("cpu-01.internal").user == "grp"  # group beats defaults
    assert inv.node("gpu-01.internal").user == "ubuntu"  # defaults
    assert (
        inv.node("10.0.1.17").user == "ops" and inv.node("10.0.1.17").executor == "docker"
    )  # host beats group
    assert inv.node("cpu-01.internal").executor == "auto"
    flagged = load_inventory(text, overrides={"ssh": {"user": "cli"}, "vars": {"executor": "process"}})
    assert {n.user for n in flagged.nodes} == {"cli"} and {n.executor for n in flagged.nodes} == {"process"}
    assert flagged.node("10.0.1.17").port == 2222  # untouched by the flags


def test_bad_overrides_are_reported_as_flags():
    with pytest.raises(InventoryError) as info:
        load_inventory(BASE, overrides={"vars": {"gpus": 3, "executr": "x"}})
    found = [str(p) for p in info.value.problems]
    assert any(p.startswith("flags.vars.gpus") for p in found)
    assert any(p.startswith("flags.vars.executr") and "did you mean 'executor'" in p for p in found)


def test_units_agree_with_the_client_and_the_agent():
    """The same strings mean the same in an inventory as in `sandbox(mem=...)` and an agent's config."""
    from agent.config import AgentConfig
    from tangram.client.aio import parse_mem

    inv = load_inventory(edit('cpus: "2-15", idle_cpus: "0-1", mem: 64GiB', 'cpus: "2-9, 12", mem: 2GB'))
    node = inv.node("cpu-01.internal")
    agent = AgentConfig.from_dict({"controller": "tcp://127.0.0.1:7700", "cpus": "2-9, 12", "mem_mib": "2GB"})
    assert node.mem_mib == agent.mem_mib == parse_mem("2GB") == 1907
    assert node.cpus == tuple(agent.cpus) == (2, 3, 4, 5, 6, 7, 8, 9, 12)


def test_units():
    assert (
        parse_size_mib("4GiB") == 4096 and parse_size_mib("1.5GiB") == 1536 and parse_size_mib("2048KiB") == 2
    )
    assert parse_duration_ms("10s") == 10_000 and parse_duration_ms("500ms") == 500
    assert parse_duration_ms("1.5m") == 90_000 and parse_duration_ms("2h") == 7_200_000
    assert parse_size_mib("4GB") == 3814 and parse_size_mib("4 gib") == 4096  # one rule: tangram.units
    for bad in ("4G", "4", "-1GiB", True, 4, "1KiB"):  # the inventory requires a unit
        with pytest.raises(ValueError):
            parse_size_mib(bad)
    for bad in ("10", "10sec", "0.1ms", False, 10):
        with pytest.raises(ValueError):
            parse_duration_ms(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("host", (None, "host", None)),
        ("u@host:22", ("u", "host", 22)),
        ("10.0.0.1:2222", (None, "10.0.0.1", 2222)),
        ("[::1]:22", (None, "::1", 22)),
        ("[::1]", (None, "::1", None)),
        ("::1", (None, "::1", None)),
        ("ops@[fd00::1]:2222", ("ops", "fd00::1", 2222)),
    ],
)
def test_parse_destination(text, expected):
    assert parse_destination(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "a@b@c",
        "@host",
        "host:",
        "host:0",
        "host:99999",
        "[host]:22",
        "[::1]x",
        "-host",
        "host:22:33x",
        "[::1",
        "u;x@host",
        "fe80::1%eth0",
    ],
)
def test_parse_destination_rejects(text):
    with pytest.raises(ValueError):
        parse_destination(text)


def test_shipped_inventories_validate():
    example = load_inventory(ROOT / "inventory" / "example.yaml")
    assert len(example.nodes) == 7 and example.cluster == "rl-exp-42"
    local = load_inventory(ROOT / "inventory" / "local.yaml")
    assert local.cluster == "local"


def test_local_default():
    inv = local_default()
    assert (ROOT / "inventory" / "local.yaml").read_text() == local_inventory_text()  # package copy in sync
    (node,) = inv.nodes
    assert (node.name, node.host, node.connection, node.executor) == ("local", "localhost", "local", "auto")
    assert node.gpus == 8 and node.emulated_gpus and node.gpu_mem_mib == 80 * 1024
    assert node.services and inv.apis[0].name == "search" and inv.apis[0].mode == "concurrency"
    assert inv.controller.bind == "127.0.0.1" and inv.controller.ports.agents == 0
    data = to_dict(inv)
    assert data["nodes"][0]["cpus"] is None and to_json(inv).startswith("{")


def test_unreadable_file(tmp_path):
    with pytest.raises(InventoryError, match="cannot read inventory"):
        load_inventory(tmp_path / "missing.yaml")


def test_trusted_code_only_reaches_the_agent_config(tmp_path: Path) -> None:
    """A node that cannot contain sandboxes (non-root SSH user) opts out in the inventory; the flag
    reaches its agent's config, and nodes that did not ask keep the default (contain or refuse)."""
    from agent.config import AgentConfig
    from tangram_cli.inventory.configs import agent_config

    text = edit("executor: auto, image", "executor: process, trusted_code_only: true, image")
    inv = load_inventory(textwrap.dedent(text))
    by_group = {n.group: n for n in inv.nodes}
    assert by_group["sandbox-cpu"].trusted_code_only is True
    assert by_group["reward-gpu"].trusted_code_only is False
    kw = dict(cluster="c1", controller="tcp://127.0.0.1:5", workdir=str(tmp_path), executor="process",
              emulated_gpus=0, gpu_mem_mib=None, cpus=[0, 1], idle_cpus=[0])
    raw = json.loads(agent_config(by_group["sandbox-cpu"], **kw).to_json())
    assert AgentConfig.from_dict(raw).trusted_code_only is True
    assert "trusted_code_only" not in json.loads(agent_config(by_group["reward-gpu"], **kw).to_json())
    one(edit("executor: auto, image", "executor: auto, trusted_code_only: maybe, image"),
        "groups.sandbox-cpu.vars.trusted_code_only", "")
