"""Checks the gateway makes before it admits a request, for asks the core would only refuse later.

A sandbox opened with more memory than any node offers used to succeed and fail at its first exec
(`NO_CAPACITY` from the core's `never_fits`). `open_refusal` refuses it at open instead, with the
same rule the core uses: a node counts when it hands out cores, and its memory is what its agent
said it offers (`facts.mem_mib`, the core's `mem_total`). While no such node has joined (a
cluster still starting) nothing is refused here: the first exec decides, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tangram import protocol
from tangram.core.actions import Elasticity
from tangram.errors import BadRequest, NoCapacity
from tangram.units import format_size_mib


def open_refusal(mem_mib: int, agents: Iterable[Any]) -> NoCapacity | None:
    """`NoCapacity` when a sandbox of `mem_mib` fits no live CPU node; None when it fits one, when
    it asks for the agent's default (0), or when no CPU node is known yet."""
    if mem_mib <= 0:
        return None
    offers = [
        a.facts.get("mem_mib")
        for a in agents
        if a.live and a.facts.get("cpus") and isinstance(a.facts.get("mem_mib"), int)
    ]
    if not offers or mem_mib <= max(offers):
        return None
    return NoCapacity(
        f"sandbox mem {format_size_mib(mem_mib)} is more than any node offers "
        f"(the largest offers {format_size_mib(max(offers))})",
        hint="ask for less memory (sandbox(mem=...)), or add a node with more (see `tangram status`)",
    )


def elasticity_of(msg: protocol.Exec, profiles: dict[str, Elasticity]) -> Elasticity | None:
    """The exec's elasticity: its own efficiency table, else its named profile, else None."""
    if msg.efficiency:
        try:
            el = Elasticity.of_table({int(k): float(v) for k, v in msg.efficiency.items()})
        except ValueError as exc:
            raise BadRequest(f"efficiency: {exc}") from None
        if (problem := el.problem()) is not None:
            raise BadRequest(f"efficiency: {problem}")
        return el
    if msg.elastic:
        return profile_named(msg.elastic, profiles)
    return None


def profile_named(name: str, profiles: dict[str, Elasticity]) -> Elasticity:
    """A profile from the controller's config; `BadRequest` naming the known ones otherwise."""
    el = profiles.get(name)
    if el is None:
        known = ", ".join(sorted(profiles)) or "none"
        raise BadRequest(f"unknown elasticity profile {name!r} (known: {known})")
    return el
