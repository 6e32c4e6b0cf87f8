"""Read, check and resolve an inventory file.

Steps: YAML through ``StrictLoader`` (duplicate keys rejected with line numbers, no YAML 1.1
sexagesimal numbers), the top level and then every section and host entry validated on its
own so that one bad section does not hide the others, host lists expanded, layers merged
(built-in defaults < ``defaults`` < group ``ssh``/``vars`` < host mapping < CLI overrides),
and cross-node checks (a host in two groups, duplicate ``host:port``, overlapping cpusets,
chunks larger than the node, unknown profiles). Every problem is collected; if there are any,
one ``InventoryError`` lists them all, one ``path: problem`` per line.
"""

from __future__ import annotations

import dataclasses
import difflib
import getpass
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tangram.errors import InventoryError
from tangram_cli import hostlist
from tangram_cli.inventory import model as m

__all__ = [
    "Problem",
    "load_inventory",
    "local_default",
    "local_inventory_text",
    "parse_yaml",
    "to_dict",
    "to_json",
]

HINT = (
    "fix the entries above (see inventory/README.md for every field), then rerun `tangram inventory validate`"
)


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


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
# Paths and pydantic errors


def fmt_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _unwrap(ann: Any) -> Any:
    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = args[0] if len(args) == 1 else ann
            if len(args) != 1:
                return ann
        else:
            return ann


def _fields_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid keys of the mapping at ``loc`` inside ``cls`` (for did-you-mean)."""
    ann: Any = cls
    for part in loc:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if part not in ann.model_fields:
                return []
            ann = ann.model_fields[part].annotation
        elif typing.get_origin(ann) in (list, dict, tuple):
            ann = typing.get_args(ann)[-1] if typing.get_args(ann) else Any
        else:
            return []
    ann = _unwrap(ann)
    return list(ann.model_fields) if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def did_you_mean(word: Any, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _looks_secret(key: str) -> bool:
    k = key.lower().replace("-", "_")
    return k != "key_env" and k.endswith(m.SECRET_WORDS)


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"


_QUOTE = "YAML reads unquoted yes/no/on/off/true/false, numbers and dates as non-strings; quote it"


def _message(err: Mapping[str, Any], cls: type[BaseModel]) -> str:
    kind, value, loc = err["type"], err.get("input"), tuple(err["loc"])
    if kind == "extra_forbidden":
        key = str(loc[-1])
        if _looks_secret(key):
            return (
                "inline secrets are not allowed; put the secret in an environment variable "
                "on the controller and name it with key_env"
            )
        return "unknown key" + did_you_mean(key, _fields_at(cls, loc[:-1]))
    if kind == "missing":
        return "required key missing"
    if kind == "string_type":
        why = (
            f"; {_QUOTE}"
            if isinstance(value, bool | int | float) or type(value).__name__ in ("date", "datetime")
            else ""
        )
        return f"expected a string, got {_describe(value)}{why}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"expected a whole number, got {_describe(value)}"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {_describe(value)}"
    if kind == "bool_type":
        return f"expected true or false, got {_describe(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {_describe(value)}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {_describe(value)}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        choices = re.findall(r"'([^']*)'", expected)
        hint = (
            did_you_mean(value, choices)
            if isinstance(value, str)
            else (f"; {_QUOTE}" if isinstance(value, bool) else "")
        )
        return f"must be one of {expected}, got {value!r}{hint}"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def validate(cls: type[BaseModel], data: Any, path: tuple[Any, ...], problems: list[Problem]) -> Any:
    """``cls.model_validate(data)``, or None with every error appended to ``problems``."""
    try:
        return cls.model_validate(data if data is not None else {})
    except ValidationError as exc:
        errors = exc.errors()
        found = [(tuple(err["loc"]), _message(err, cls), err["type"]) for err in errors]
        # a misspelt required key: keep "unknown key (did you mean 'limit'?)",
        # drop "limit: required key missing"
        suggested = {
            (*loc[:-1], msg.split("'")[-2])
            for loc, msg, kind in found
            if kind == "extra_forbidden" and "did you mean" in msg
        }
        for loc, msg, kind in found:
            if not (kind == "missing" and loc in suggested):
                problems.append(Problem(fmt_path(path + loc), msg))
        return None


# --------------------------------------------------------------------------------------------
# Host entries


@dataclass(frozen=True)
class _Entry:
    """One host of a group after expansion: where it came from and what it sets."""

    path: str
    group: str
    host: str
    name: str | None
    user: str | None
    port: int | None
    spec: m.HostSpec | None


def _split_destination(text: str) -> tuple[str | None, str, int | None]:
    """``[user@]pattern[:port]``; IPv6 literals (bracketed, or bare with several colons) kept whole."""
    user, at, rest = text.rpartition("@") if "@" in text else (None, "", text)
    if at and (not user or "@" in user):
        raise ValueError(f"ambiguous destination {text!r}")
    if user is not None:
        m.check_user(user)
    bracket = rest.startswith("[") and ":" in rest[: rest.find("]") + 1]
    if bracket or rest.count(":") > 1:
        _, host, port = m.parse_destination(rest)
        return user, f"[{host}]", port
    host, colon, port_s = rest.partition(":")
    return user, host, (m.check_port(port_s) if colon else None)


def _expand_entry(text: Any, path: str, problems: list[Problem]) -> list[tuple[str, str | None, int | None]]:
    if not isinstance(text, str):
        problems.append(
            Problem(path, f"expected a host name or a mapping with 'host', got {_describe(text)}")
        )
        return []
    try:
        user, pattern, port = _split_destination(text)
        if pattern.startswith("[") and ":" in pattern:
            return [(m.check_host(pattern), user, port)]
        return [(m.check_host(h), user, port) for h in hostlist.expand(pattern)]
    except ValueError as exc:  # HostlistError is a ValueError
        problems.append(Problem(path, str(exc)))
        return []


def _group_entries(gname: str, raw_hosts: list[Any], problems: list[Problem]) -> list[_Entry]:
    entries: list[_Entry] = []
    if not raw_hosts:
        problems.append(Problem(f"groups.{gname}.hosts", "no hosts listed"))
    for i, raw in enumerate(raw_hosts):
        path = f"groups.{gname}.hosts[{i}]"
        spec = None
        if isinstance(raw, dict):
            spec = validate(m.HostSpec, raw, ("groups", gname, "hosts", i), problems)
            if spec is None:
                if isinstance(raw.get("host"), str):  # still report a bad host name
                    _expand_entry(raw["host"], f"{path}.host", problems)
                continue
            raw = spec.host
        expanded = _expand_entry(raw, f"{path}.host" if spec else path, problems)
        if spec and spec.name and len(expanded) > 1:
            problems.append(
                Problem(f"{path}.name", f"'name' needs a single host, {raw!r} has {len(expanded)}")
            )
            continue
        for host, user, port in expanded:
            entries.append(_Entry(path, gname, host, spec.name if spec else None, user, port, spec))
    return entries


# --------------------------------------------------------------------------------------------
# Layers

_SSH_BASE = {"port": 22, "host_key_policy": "accept-new", "connect_timeout": 10_000, "identity_file": None}
_VARS_BASE: dict[str, Any] = {
    "cpus": None,
    "idle_cpus": (),
    "mem": None,
    "executor": "auto",
    "image": None,
    "emulated_gpus": False,
    "gpu_mem": None,
    "services": [],
    "python": "python3",
    "workdir": "~/.tangram",
}


def _set(spec: BaseModel | None) -> dict[str, Any]:
    return {k: getattr(spec, k) for k in spec.model_fields_set} if spec is not None else {}


def _default_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return "root"


class OverrideSpec(m.Spec):
    """CLI flags, applied to every node last: ``{"ssh": {...}, "vars": {...}, "connection": ...}``."""

    connection: m.Connection | None = None
    ssh: m.SshSpec = m.SshSpec()
    vars: m.VarsSpec = m.VarsSpec()


def _resolve_node(
    e: _Entry, role: str, defaults: m.DefaultsSpec, group: m.GroupSpec, flags: OverrideSpec
) -> m.Node:
    ssh = {**_SSH_BASE, "user": _default_user()}
    vs = dict(_VARS_BASE, gpus="all" if role == "gpu" else 0)
    conn = defaults.connection or "ssh"
    vs.update({k: v for k, v in (("python", defaults.python), ("workdir", defaults.workdir)) if v})
    for layer_ssh, layer_vars in (
        (defaults.ssh, None),
        (group.ssh, group.vars),
        *([(e.spec.ssh, e.spec.vars)] if e.spec else []),
        (flags.ssh, flags.vars),
    ):
        ssh.update(_set(layer_ssh))
        vs.update(_set(layer_vars))
    if e.user:
        ssh["user"] = e.user
    if e.port:
        ssh["port"] = e.port
    ssh.update(_set(flags.ssh))  # flags beat a user@host:port written in the host string
    if e.spec and e.spec.connection:
        conn = e.spec.connection
    conn = flags.connection or conn
    host = e.host.strip("[]")
    services = tuple(
        m.Service(s.name, s.runtime, s.model, tuple(s.gpus), s.gpu_mem, s.host_mem, s.duration, s.load_s)
        for s in vs["services"]
    )
    return m.Node(
        name=e.name or host,
        host=host,
        port=ssh["port"],
        user=ssh["user"],
        identity_file=ssh["identity_file"],
        role=role,
        cpus=vs["cpus"],
        idle_cpus=tuple(vs["idle_cpus"]),
        mem_mib=vs["mem"],
        executor=vs["executor"],
        image=vs["image"],
        gpus=vs["gpus"],
        services=services,
        workdir=vs["workdir"],
        python=vs["python"],
        host_key_policy=ssh["host_key_policy"],
        connect_timeout_ms=ssh["connect_timeout"],
        connection=conn,
        group=e.group,
        emulated_gpus=bool(vs["emulated_gpus"]),
        gpu_mem_mib=vs["gpu_mem"],
    )


def _node_problems(n: m.Node) -> list[str]:
    """Consistency of one resolved node; messages without the node's path."""
    out: list[str] = []
    if n.cpus is not None and set(n.cpus) & set(n.idle_cpus):
        both = m.format_cpuset(tuple(sorted(set(n.cpus) & set(n.idle_cpus))))
        out.append(
            f"cpus {m.format_cpuset(n.cpus)} overlap idle_cpus {m.format_cpuset(n.idle_cpus)} on {both}"
        )
    count = n.gpu_count
    if n.role == "cpu" and (n.services or (count or 0) > 0 or n.gpus == "all"):
        out.append("a cpu node has gpus or services; use role: gpu")
    if n.role == "gpu" and count == 0:
        out.append("role gpu needs gpus ('all', UUIDs, or a count with emulated_gpus: true)")
    if isinstance(n.gpus, int) and n.gpus > 0 and not n.emulated_gpus:
        out.append("a GPU count needs emulated_gpus: true; for real GPUs write 'all' or their UUIDs")
    if n.emulated_gpus and not isinstance(n.gpus, int):
        out.append("emulated_gpus needs a GPU count (gpus: 1, 2, 4 or 8)")
    if n.emulated_gpus and n.gpu_mem_mib is None:
        out.append("emulated GPUs need gpu_mem (e.g. '80GiB')")
    names = [s.name for s in n.services]
    for dup in sorted({x for x in names if names.count(x) > 1}):
        out.append(f"service {dup!r} is listed twice")
    for s in n.services:
        if count is not None and max(s.gpus) > count:
            out.append(f"service {s.name!r} asks for chunks of {max(s.gpus)} GPUs; the node has {count}")
        if s.gpu_mem_mib and n.gpu_mem_mib and s.gpu_mem_mib > n.gpu_mem_mib:
            out.append(
                f"service {s.name!r} gpu_mem {s.gpu_mem_mib}MiB is more than the GPU's {n.gpu_mem_mib}MiB"
            )
        if s.host_mem_mib and n.mem_mib and s.host_mem_mib > n.mem_mib:
            out.append(f"service {s.name!r} host_mem is more than the node's mem")
    if n.connection == "local" and not m.is_loopback(n.host):
        out.append(f"connection: local runs on this machine; host {n.host!r} must be localhost or 127.x")
    return out


def _group_overlap(entries: list[_Entry], problems: list[Problem]) -> None:
    first: dict[str, _Entry] = {}
    for e in entries:
        host = e.host.strip("[]")
        seen = first.setdefault(host, e)
        if seen.group != e.group:
            problems.append(
                Problem(e.path, f"host {host} is also in group {seen.group!r}; a host belongs to one group")
            )


def _cross_checks(pairs: list[tuple[_Entry, m.Node]], problems: list[Problem]) -> None:
    by_addr: dict[tuple[str, int], _Entry] = {}
    by_name: dict[str, _Entry] = {}
    grouped: dict[tuple[str, str], list[str]] = {}
    for e, n in pairs:
        for msg in _node_problems(n):
            grouped.setdefault((e.path, msg), []).append(n.name)
        other = by_addr.get((n.host, n.port)) or by_name.get(n.name)
        if other is not None and other.group == e.group:  # across groups: reported by _group_overlap
            what = f"host:port {n.address}" if (n.host, n.port) in by_addr else f"node name {n.name!r}"
            problems.append(Problem(e.path, f"duplicate {what} (also {other.path})"))
        by_addr.setdefault((n.host, n.port), e)
        by_name.setdefault(n.name, e)
    for (path, msg), names in grouped.items():
        problems.append(Problem(f"{path} ({hostlist.compress(names)})", msg))


# --------------------------------------------------------------------------------------------
# Sections


def _mapping_section(data: dict[str, Any], key: str, problems: list[Problem]) -> dict[str, Any]:
    raw = data.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(Problem(key, f"expected a mapping of names, got {_describe(raw)}"))
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
            Problem("", f"the inventory must be a mapping with 'version: 1', got {_describe(data)}")
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
    pairs: list[tuple[_Entry, m.Node]] = []
    everything: list[_Entry] = []
    for gname, graw in groups_raw.items():
        g = validate(m.GroupSpec, graw, ("groups", gname), problems)
        raw_hosts = graw.get("hosts") if isinstance(graw, dict) else None
        if not isinstance(raw_hosts, list):
            continue  # reported by validate()
        entries = _group_entries(gname, raw_hosts, problems)
        everything.extend(entries)
        if g is not None and defaults is not None and flags is not None:
            pairs.extend((e, _resolve_node(e, g.role, defaults, g, flags)) for e in entries)
    _group_overlap(everything, problems)
    _cross_checks(pairs, problems)
    apis = {
        k: validate(m.ApiSpec, v, ("apis", k), problems)
        for k, v in _mapping_section(data, "apis", problems).items()
    }
    profiles = {
        k: validate(m.ProfileSpec, v, ("profiles", k), problems)
        for k, v in _mapping_section(data, "profiles", problems).items()
    }
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
    if problems or top is None or ctl is None or sched is None:
        return None
    return m.Inventory(
        version=top.version,
        cluster=top.cluster,
        controller=m.Controller(ctl.bind, ctl.advertise or ctl.bind, m.Ports(**ctl.ports.model_dump())),
        scheduler=m.Scheduler(sched.depth, sched.client_grace, sched.default_profile),
        nodes=tuple(n for _, n in pairs),
        apis=tuple(m.Api(k, a.mode, a.limit, a.period, a.key_env) for k, a in apis.items() if a),
        profiles=tuple(m.Profile(k, p.efficiency, p.serial_fraction) for k, p in profiles.items() if p),
        source=source,
        groups={g: tuple(n.name for e, n in pairs if e.group == g) for g in groups_raw},
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
