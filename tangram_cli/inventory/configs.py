"""What an inventory makes: the controller's configuration and each node agent's, as typed objects.

One schema per configuration, each checked once, where it is read:

* ``controller_config(inv)`` is a ``tangram_cli.controller.config.ControllerConfig``; `tangram up`
  writes ``ControllerConfig.to_dict()`` into ``controller.json`` and the controller reads it back with
  ``parse_config`` (the same file may be written by hand for `tangram controller --config`).
* ``agent_config(node, ...)`` is an ``agent.config.AgentConfig`` holding only what `up` decides
  (``AgentConfig.given``); ``to_json()`` is the node's ``agent.json``, which the agent checks with
  ``AgentConfig.from_dict`` where it runs (the agent bundle carries no pydantic: its config is a
  stdlib dataclass).

The inventory itself was checked by its pydantic models (model.py) when it was loaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from agent.config import AgentConfig
from tangram.core.actions import Elasticity
from tangram_cli.controller.config import BUILTIN_PROFILES, ApiConf, ApiKeyConf, ControllerConfig, ServiceConf
from tangram_cli.inventory.model import Api, Inventory, Node, Service

REWARD_MODEL = "agent.gpu.demo_services:reward"
ECHO_MODEL = "agent.gpu.demo_services:echo"

# The local default's demo needs GPU service ``reward`` and API ``search`` (added when missing).
DEMO_REWARD = ServiceConf(
    name="reward",
    gpu_mem_mib=16 * 1024,
    chunk_sizes=(1,),
    load_s=1.0,
    t_ori=0.2,
    spec={
        "name": "reward",
        "runtime": "emulated",
        "model": REWARD_MODEL,
        "gpu_mem_mib": 16 * 1024,
        "host_mem_mib": 16 * 1024,
    },
)
DEMO_SEARCH = ApiConf("search", "concurrency", 4, 60.0)


def _service(s: Service, *, local_demo: bool) -> ServiceConf:
    model = s.model
    if model is None and s.runtime == "emulated":
        model = REWARD_MODEL if local_demo or s.name in ("reward", "demo-reward") else ECHO_MODEL
    mem = s.gpu_mem_mib or 0
    spec: dict[str, Any] = {"name": s.name, "runtime": s.runtime, "model": model, "gpu_mem_mib": mem}
    if s.host_mem_mib:
        spec["host_mem_mib"] = s.host_mem_mib
    return ServiceConf(
        name=s.name,
        gpu_mem_mib=mem,
        chunk_sizes=tuple(s.gpus),
        load_s=float(s.load_s or 0.0),
        t_ori=None if s.duration_ms is None else s.duration_ms / 1000,
        spec=spec,
    )


def _api(a: Api) -> ApiConf:
    """An API's limits and its key pool: each key's name, the variable that holds its secret on the
    controller's host, and its limits (the secret itself is read by the controller, never here).
    A single ``key_env`` is a pool of one key, ``k0``, with no limits of its own."""
    keys = tuple(ApiKeyConf(k.name, k.key_env, k.rpm, k.tpm, k.concurrency) for k in a.keys)
    if not keys and a.key_env:  # one key: a pool of one, `k0`, limited by the API's own limit only
        keys = (ApiKeyConf("k0", a.key_env, 0, 0, 0),)
    return ApiConf(a.name, a.mode, a.limit, (a.period_ms or 60_000) / 1000, keys)


def controller_config(inv: Inventory, *, local_demo: bool = False) -> ControllerConfig:
    """The controller's configuration from an inventory: its services (the first node that names one
    defines it), APIs, profiles and scheduler settings. ``local_demo`` (the local default) adds the
    demo's ``reward`` service and ``search`` API when the inventory does not define them."""
    services: dict[str, ServiceConf] = {}
    for node in inv.nodes:
        for s in node.services:
            services.setdefault(s.name, _service(s, local_demo=local_demo))
    apis = [_api(a) for a in inv.apis]
    if local_demo:
        services.setdefault(DEMO_REWARD.name, DEMO_REWARD)
        if not any(a.name == DEMO_SEARCH.name for a in apis):
            apis.append(DEMO_SEARCH)
    own: dict[str, Elasticity] = {}
    for p in inv.profiles:
        if p.efficiency is not None:
            own[p.name] = Elasticity.of_table(p.efficiency)
        else:
            own[p.name] = Elasticity.amdahl(p.serial_fraction or 0.0)
    return ControllerConfig(
        cluster=inv.cluster,
        depth=inv.scheduler.depth,
        client_grace_s=inv.scheduler.client_grace_ms / 1000,
        stage_starts=inv.scheduler.stage_starts,
        services=tuple(services.values()),
        apis=tuple(apis),
        profiles={**own, **{k: v for k, v in BUILTIN_PROFILES.items() if k not in own}},
        jobs=inv.jobs,
        **({"sandbox_pool": inv.sandbox_pool} if inv.sandbox_pool is not None else {}),
    )


def agent_config(
    node: Node,
    *,
    cluster: str,
    controller: str,
    workdir: str,
    executor: str,
    emulated_gpus: int,
    gpu_mem_mib: int | None,
    cpus: Iterable[int] | None = None,
    idle_cpus: Iterable[int] | None = None,
    allow_remote: bool = False,
    curve: Mapping[str, str] | None = None,
    cluster_id: str = "",
) -> AgentConfig:
    """The agent configuration of ``node``: what `up` decides (``cpus``/``idle_cpus`` default to the
    node's own; ``curve`` holds the paths of the agent's secret certificate and the controller's public
    key; ``cluster_id`` is the cluster's unique id, "" for a legacy cluster without one); the agent's
    defaults and probes fill in the rest on the node."""
    values: dict[str, Any] = {
        "controller": controller,
        "name": node.name,
        "cluster": cluster,
        "executor": executor,
        "workdir": workdir,
    }
    if cluster_id:
        values["cluster_id"] = cluster_id
    cores = list(cpus) if cpus is not None else list(node.cpus or ())
    idle = list(idle_cpus) if idle_cpus is not None else list(node.idle_cpus or ())
    if cores:
        values["cpus"] = cores
    if idle:
        values["idle_cpus"] = idle
    if node.mem_mib:
        values["mem_mib"] = node.mem_mib
    if node.image:
        values["image"] = node.image
    if node.trusted_code_only:
        values["trusted_code_only"] = True
    if emulated_gpus:
        values["emulated_gpus"] = emulated_gpus
        if gpu_mem_mib:
            values["gpu_mem_mib"] = gpu_mem_mib
    if curve:
        values["curve"] = dict(curve)
    elif allow_remote:
        values["allow_remote"] = True
    log_format = os.environ.get("TANGRAM_LOG_FORMAT", "").strip().lower()
    if log_format in ("text", "json"):  # agents over SSH do not inherit `up`'s environment
        values["log_format"] = log_format
    return AgentConfig.given(**values)
