"""The controller's record of a connected agent (`Agent`), and an agent's facts (its Hello) as the
core's `NodeJoined`, checked: a bad fact is a `Reject`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tangram import protocol
from tangram.core import events as ev

# what gets an agent's reply: its envelope (Result or Error), or NodeLost (exactly once)
Reply = Callable[[protocol.Envelope | BaseException], None]


@dataclass
class Agent:
    name: str
    ident: bytes
    facts: dict[str, Any]
    agent_epoch: int
    joined: float = 0.0  # controller clock
    last_seen: float = 0.0
    last_sent: float = 0.0
    state: str = "up"  # up | lost | down (said Bye)
    reason: str = ""
    load: dict[str, Any] = field(default_factory=dict)
    pending: dict[int, tuple[str, Reply]] = field(default_factory=dict)  # request id -> (kind, on_reply)
    gpu_tails: dict[int, asyncio.Future[None]] = field(default_factory=dict)  # GPU -> its last Load/Evict
    restarts: int = 0
    batches: bool = False  # its Hello said minor >= BATCH_MINOR: what one decision sends it goes in one
    staged: bool = False  # its Hello said minor >= STAGED_MINOR: it starts a Spawn(after=A) when A ends

    @property
    def live(self) -> bool:
        return self.state == "up"


def _ints(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 16 for v in value
    ):
        raise ValueError(f"facts.{where} must be a list of core numbers")
    if len(set(value)) != len(value):
        raise ValueError(f"facts.{where} repeats a core")
    return tuple(value)


def node_event(name: str, facts: dict[str, Any]) -> ev.NodeJoined:
    """The core's NodeJoined for an agent's facts; raises ValueError naming a bad fact."""
    cpus = _ints(facts.get("cpus", []), "cpus")
    numa_raw = facts.get("numa") or []
    if not isinstance(numa_raw, list):
        raise ValueError("facts.numa must be a list of core lists")
    numa = tuple(tuple(c for c in _ints(d, "numa[]") if c in cpus) for d in numa_raw)
    numa = tuple(d for d in numa if d)
    covered = {c for d in numa for c in d}
    if set(cpus) - covered:
        numa = (*numa, tuple(sorted(set(cpus) - covered)))
    ints = {}
    for key in ("mem_mib", "gpus", "gpu_mem_mib"):
        v = facts.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"facts.{key} must be an integer >= 0")
        ints[key] = v
    if ints["gpus"] > 64:
        raise ValueError("facts.gpus above 64")
    return ev.NodeJoined(
        name,
        cpus=cpus,
        numa=numa,
        mem_mib=ints["mem_mib"],
        gpus=ints["gpus"],
        gpu_mem_mib=ints["gpu_mem_mib"],
    )
