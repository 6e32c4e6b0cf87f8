"""Inventory nodes: each group's host entries expanded, resolved into ``Node`` values and checked.

Host strings are ``[user@]pattern[:port]`` with hostlist patterns (``gpu[01-16]``) or IPv6
literals; host mappings (``{host: ..., ssh: ..., vars: ...}``) are validated one by one. Layers
are merged per node: built-in defaults < ``defaults`` < group ``ssh``/``vars`` < host mapping <
CLI flags (``OverrideSpec``). Then each node's own consistency (cpus against idle_cpus, GPUs
against role and services) and the checks across nodes (a host in two groups, duplicate
``host:port`` or node names) add problems; ``resolve_nodes`` runs all of it for ``load.py``.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tangram_cli import hostlist
from tangram_cli.inventory import model as m
from tangram_cli.inventory.problems import Problem, describe, validate

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
        problems.append(Problem(path, f"expected a host name or a mapping with 'host', got {describe(text)}"))
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
    "trusted_code_only": False,
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
    except Exception:  # noqa: BLE001 - no passwd entry in some containers (KeyError, OSError)
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
        trusted_code_only=bool(vs["trusted_code_only"]),
    )


# --------------------------------------------------------------------------------------------
# Checks


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


def resolve_nodes(
    groups_raw: dict[str, Any],
    defaults: m.DefaultsSpec | None,
    flags: OverrideSpec | None,
    problems: list[Problem],
) -> list[tuple[_Entry, m.Node]]:
    """Every group's hosts as resolved nodes, in file order; problems of entries, nodes and
    groups are appended to ``problems`` (a node is resolved only when its layers validated)."""
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
    return pairs
