"""Checks `tangram up --dry-run` makes on this machine, beyond what `inventory validate` checks
(which looks at the file alone): the controller's bind address must be an address of this
machine (the controller runs where `up` runs), and each ``ssh.identity_file`` must be a readable
file. Every problem names the inventory key that set the value (``defaults.ssh.identity_file``,
``groups.gpu.hosts[1].ssh.identity_file``, ``controller.bind``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tangram_cli.bootstrap import netaddr
from tangram_cli.errors import InventoryError
from tangram_cli.hostlist import compress
from tangram_cli.inventory.load import parse_yaml
from tangram_cli.inventory.problems import Problem, fmt_path

HINT = "fix the entries above, then rerun `tangram up --dry-run`"


def controller_problems(inv: Any) -> list[Problem]:
    """``controller.bind`` must resolve to addresses this machine may bind."""
    bind = inv.controller.bind
    if not netaddr.resolve(bind):
        return [Problem("controller.bind", f"{bind} resolves to no address")]
    missing = netaddr.not_local(bind)
    if not missing:
        return []
    return [
        Problem(
            "controller.bind",
            f"{netaddr.not_local_message(bind, missing)}, and the controller runs on the machine that runs "
            f"`tangram up`; use one of: {', '.join(netaddr.local_addresses())}",
        )
    ]


def _unreadable(value: str) -> str | None:
    """Why the private key file ``value`` cannot be used, or None."""
    path = Path(os.path.expanduser(value))
    if not path.exists():
        return "does not exist"
    if not path.is_file():
        return "is not a file"
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        return f"is not readable: {exc.strerror or exc}"
    return None


def _keys_with(raw: Any, key: str, value: str, loc: tuple[Any, ...] = ()) -> Iterator[str]:
    """Every path in the raw YAML where ``key`` is set to ``value``."""
    if isinstance(raw, dict):
        for k, v in raw.items():
            if k == key and str(v) == value:
                yield fmt_path((*loc, k))
            else:
                yield from _keys_with(v, key, value, (*loc, k))
    elif isinstance(raw, list):
        for i, v in enumerate(raw):
            yield from _keys_with(v, key, value, (*loc, i))


def _raw(inv: Any) -> Any:
    try:
        text = Path(inv.source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return parse_yaml(text)[0]


def identity_problems(inv: Any, nodes: Iterable[Any]) -> list[Problem]:
    """Each distinct ``identity_file`` of ``nodes`` that is missing or unreadable, at every key that
    sets it (or ``ssh.identity_file`` when the key cannot be found, e.g. set by a CLI flag)."""
    users: dict[str, list[str]] = {}
    for n in nodes:
        if n.identity_file:
            users.setdefault(str(n.identity_file), []).append(n.name)
    raw = _raw(inv) if users else None
    out = []
    for value, names in users.items():
        why = _unreadable(value)
        if why is None:
            continue
        keys = list(dict.fromkeys(_keys_with(raw, "identity_file", value))) or ["ssh.identity_file"]
        for key in keys:
            out.append(Problem(key, f"{value} {why} (used by {compress(names)}); give a private key file"))
    return out


def check(inv: Any, nodes: Iterable[Any]) -> None:
    """Raise InventoryError (exit 2) listing every problem the checks above find."""
    problems = controller_problems(inv) + identity_problems(inv, nodes)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        n = len(problems)
        err = InventoryError(
            f"inventory {inv.source} cannot start here: {n} problem{'s' if n != 1 else ''}\n{lines}",
            hint=HINT,
        )
        err.problems = problems  # type: ignore[attr-defined]
        raise err
