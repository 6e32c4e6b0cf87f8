"""Read, check and resolve an inventory file.

Steps: YAML through ``StrictLoader`` (duplicate keys rejected with line numbers, no YAML 1.1
sexagesimal numbers), the top level and then every section and host entry validated on its
own so that one bad section does not hide the others, host lists expanded, layers merged
(built-in defaults < ``defaults`` < group ``ssh``/``vars`` < host mapping < CLI overrides),
and cross-node checks (a host in two groups, duplicate ``host:port``, overlapping cpusets,
chunks larger than the node, unknown profiles). Every problem is collected; if there are any,
one ``InventoryError`` lists them all, one ``path: problem`` per line.

Layout: this module reads the YAML, validates the sections and builds the ``Inventory``;
``problems.py`` words each problem (``Problem``, ``validate``), ``nodes.py`` turns the groups'
host entries into checked ``Node`` values. Their public names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tangram.errors import ConfigError
from tangram_cli.controller.jobs_config import parse_jobs
from tangram_cli.controller.pools import parse_policy
from tangram_cli.errors import InventoryError
from tangram_cli.inventory import model as m
from tangram_cli.inventory.nodes import OverrideSpec, resolve_nodes
from tangram_cli.inventory.problems import Problem, describe, did_you_mean, fmt_path, validate

__all__ = [
    "OverrideSpec",
    "Problem",
    "did_you_mean",
    "fmt_path",
    "load_inventory",
    "local_default",
    "local_inventory_text",
    "parse_yaml",
    "to_dict",
    "to_json",
    "validate",
]

HINT = (
    "fix the entries above (see inventory/README.md for every field), then rerun `tangram inventory validate`"
)


# --------------------------------------------------------------------------------------------
# YAML


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate mapping keys instead of silently keeping the last."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.duplicates: list[Problem] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    self.duplicates.append(
                        Problem(f"line {line}", f"duplicate key {key!r} (first at line {seen[key]})")
                    )
                else:
                    seen[key] = line
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"unhashable key {key!r}", key_node.start_mark
                ) from None
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads 22:22 as the base-60 integer 1342; keep ints decimal/hex/octal only.
StrictLoader.yaml_implicit_resolvers = {
    ch: [
        (tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> tuple[Any, list[Problem]]:
    loader = StrictLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        return None, [Problem(where, f"YAML syntax: {exc.problem or exc}")]
    except yaml.YAMLError as exc:
        return None, [Problem("YAML", str(exc))]
    finally:
        loader.dispose()
    return data, list(loader.duplicates)


# --------------------------------------------------------------------------------------------
# Sections


def _mapping_section(data: dict[str, Any], key: str, problems: list[Problem]) -> dict[str, Any]:
    raw = data.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(Problem(key, f"expected a mapping of names, got {describe(raw)}"))
        return {}
    for name in raw:
        if not isinstance(name, str) or not m.ID_RE.match(name):
            problems.append(
                Problem(f"{key}.{name}", "invalid name (letters, digits, '_', '.', '-'; quote numbers)")
            )
    return {k: v for k, v in raw.items() if isinstance(k, str) and m.ID_RE.match(k)}


def _resolve(
    data: Any, overrides: Mapping[str, Any] | None, source: str, problems: list[Problem]
) -> m.Inventory | None:
    if not isinstance(data, dict):
        problems.append(
            Problem("", f"the inventory must be a mapping with 'version: 1', got {describe(data)}")
        )
        return None
    top = validate(m.InventorySpec, data, (), problems)
    defaults = validate(m.DefaultsSpec, data.get("defaults"), ("defaults",), problems)
    ctl = validate(m.ControllerSpec, data.get("controller"), ("controller",), problems)
    sched = validate(m.SchedulerSpec, data.get("scheduler"), ("scheduler",), problems)
    flags = validate(OverrideSpec, dict(overrides or {}), ("flags",), problems)
    groups_raw = _mapping_section(data, "groups", problems)
    if not groups_raw and not any(p.path.startswith("groups") for p in problems):
        problems.append(Problem("groups", "no groups: add at least one group with hosts"))
    pairs = resolve_nodes(groups_raw, defaults, flags, problems)
    apis = {
        k: validate(m.ApiSpec, v, ("apis", k), problems)
        for k, v in _mapping_section(data, "apis", problems).items()
    }
    profiles = {
        k: validate(m.ProfileSpec, v, ("profiles", k), problems)
        for k, v in _mapping_section(data, "profiles", problems).items()
    }
    _check_default_profile(data, profiles, problems)
    jobs = _jobs(data.get("jobs"), problems)
    pool = _sandbox_pool(data.get("sandbox_pool"), problems)
    if problems or top is None or ctl is None or sched is None:
        return None
    return m.Inventory(
        version=top.version,
        cluster=top.cluster,
        controller=m.Controller(ctl.bind, ctl.advertise or ctl.bind, m.Ports(**ctl.ports.model_dump())),
        scheduler=m.Scheduler(sched.depth, sched.client_grace, sched.default_profile, sched.stage_starts),
        nodes=tuple(n for _, n in pairs),
        apis=tuple(_api(k, a) for k, a in apis.items() if a),
        profiles=tuple(m.Profile(k, p.efficiency, p.serial_fraction) for k, p in profiles.items() if p),
        source=source,
        groups={g: tuple(n.name for e, n in pairs if e.group == g) for g in groups_raw},
        jobs=jobs,
        sandbox_pool=pool,
    )


def _api(name: str, a: m.ApiSpec) -> m.Api:
    """A checked ``apis.NAME``; with keys only: no API-wide limit (mode concurrency, limit 0), and
    each unnamed key is ``k<position>``, as the controller's config names it."""
    keys = tuple(
        m.ApiKey(k.name or f"k{i}", k.key_env, k.rpm, k.tpm, k.concurrency)
        for i, k in enumerate(a.keys or ())
    )
    return m.Api(name, a.mode or "concurrency", a.limit or 0, a.period, a.key_env, keys)


def _jobs(raw: Any, problems: list[Problem]) -> tuple[Any, ...]:
    """The ``jobs`` section, as the controller's config reads it (jobs_config.parse_jobs)."""
    try:
        return parse_jobs(raw)
    except ConfigError as exc:
        path, _, message = exc.message.partition(": ")
        problems.append(Problem(path, message + (f" ({exc.hint})" if exc.hint else "")))
        return ()


def _sandbox_pool(raw: Any, problems: list[Problem]) -> Any:
    """The ``sandbox_pool`` section, as the controller's config reads it (pools.parse_policy)."""
    try:
        return parse_policy(raw)
    except ConfigError as exc:
        path, _, message = exc.message.partition(": ")
        problems.append(Problem(path, message + (f" ({exc.hint})" if exc.hint else "")))
        return None


def _check_default_profile(
    data: dict[str, Any], profiles: Mapping[str, Any], problems: list[Problem]
) -> None:
    """``scheduler.default_profile`` must name one of the profiles."""
    wanted = (
        (data.get("scheduler") or {}).get("default_profile")
        if isinstance(data.get("scheduler"), dict)
        else None
    )
    if isinstance(wanted, str) and wanted not in profiles:
        problems.append(
            Problem(
                "scheduler.default_profile",
                f"unknown profile {wanted!r}" + did_you_mean(wanted, list(profiles)),
            )
        )


# --------------------------------------------------------------------------------------------
# Public API


def load_inventory(
    path_or_text: str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None
) -> m.Inventory:
    """Load and resolve an inventory from a path or from YAML text.

    A ``Path`` (or a one-line string naming an existing file or ending in .yaml/.yml) is read
    as a file; any other string is YAML text. ``overrides`` are CLI flags, applied last:
    ``{"ssh": {"user": "ops"}, "vars": {"executor": "process"}, "connection": "local"}``.
    Raises ``InventoryError`` (exit 2) listing every problem; ``.problems`` holds them.
    """
    source, text = _read(path_or_text)
    data, problems = parse_yaml(text)
    inv = None
    if not (problems and data is None):
        inv = _resolve(data, overrides, source, problems)
    if problems or inv is None:
        lines = "\n".join(f"  {p}" for p in problems)
        n = len(problems)
        err = InventoryError(
            f"invalid inventory {source}: {n} problem{'s' if n != 1 else ''}\n{lines}", hint=HINT
        )
        err.problems = problems  # type: ignore[attr-defined]
        raise err
    return inv


def _read(path_or_text: str | os.PathLike[str]) -> tuple[str, str]:
    is_path = isinstance(path_or_text, os.PathLike) or (
        "\n" not in path_or_text
        and (path_or_text.endswith((".yaml", ".yml")) or os.path.isfile(path_or_text))
    )
    if not is_path:
        return "<string>", str(path_or_text)
    path = Path(path_or_text).expanduser()
    try:
        return str(path_or_text), path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(
            f"cannot read inventory {path_or_text}: {getattr(exc, 'strerror', None) or exc}",
            hint="pass an existing YAML file, set TANGRAM_INVENTORY, or omit it for the local default",
        ) from None


def local_inventory_text() -> str:
    """The embedded ``local.yaml`` (package data ``tangram_cli/data/local.yaml``)."""
    return resources.files("tangram_cli").joinpath("data/local.yaml").read_text(encoding="utf-8")


def local_default(*, overrides: Mapping[str, Any] | None = None) -> m.Inventory:
    """Cluster ``local``: one node on this machine, no SSH, free loopback ports, emulated GPUs."""
    inv = load_inventory(local_inventory_text(), overrides=overrides)
    return dataclasses.replace(inv, source="<local default>")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def to_dict(inv: m.Inventory) -> dict[str, Any]:
    """The resolved inventory as plain JSON data; cpusets rendered as strings ("2-127")."""
    out = _jsonable(inv)
    for node, raw in zip(out["nodes"], inv.nodes, strict=True):
        node["cpus"] = m.format_cpuset(raw.cpus)
        node["idle_cpus"] = m.format_cpuset(raw.idle_cpus) or ""
        node["address"] = raw.address
    return out


def to_json(inv: m.Inventory, *, indent: int | None = 2) -> str:
    return json.dumps(to_dict(inv), indent=indent, sort_keys=False)
