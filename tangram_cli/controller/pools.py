"""The controller's side of warm sandbox pools: sizes each agent's pools and tells it (`SandboxPool`).

The sizing itself is `tangram.core.pool.PoolSizer` (pure; the simulator drives it too). Rules:

1. Every `CreateSandbox` the core emits is an open of its shape (image, memory as the open named them)
   on its node (`on_create`, from `Controller.dispatch`).
2. Every `PERIOD_S`, the targets of every live agent that keeps pools (its Hello facts list `pool`) are
   computed with the node's memory as the core sees it (total, and what trajectories do not hold) and
   the agent's memory for a sandbox opened without one; a target that changed is sent.
3. After each Hello of such an agent every target is sent again: for the shapes wanted and for the
   shapes the agent says it holds (0 where none is wanted), so a restarted agent or controller
   converges and no adopted pool outlives its need.
4. Pools off (`max == 0`, the default): only those zeros are sent.

The config (`sandbox_pool` in the controller's config, `parse_policy`):

    "sandbox_pool": {"min": 0, "max": 32, "window_s": 10, "history_s": 600, "mem_fraction": 0.25,
                     "shapes": [{"image": "", "mem_mib": 0}]}

Every key is optional; giving the mapping turns pools on (`max` defaults to 32).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tangram import protocol
from tangram.core import commands as cmd
from tangram.core.pool import NodeRoom, PoolPolicy, PoolShape, PoolSizer
from tangram.errors import ConfigError

log = logging.getLogger("tangram.controller.pools")

PERIOD_S = 1.0
_KEYS = ("min", "max", "window_s", "history_s", "mem_fraction", "shapes")


def parse_policy(raw: object) -> PoolPolicy:
    """`sandbox_pool` of the controller's config; absent: pools off. Raises ConfigError naming the key."""
    if raw is None:
        return PoolPolicy(max=0)
    if not isinstance(raw, dict):
        raise ConfigError("sandbox_pool: expected a mapping", hint='e.g. "sandbox_pool": {"max": 32}')
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigError(f"sandbox_pool: unknown key {unknown[0]!r}", hint=f"known keys: {', '.join(_KEYS)}")
    kw: dict[str, Any] = {}
    for key in ("min", "max"):
        if key in raw:
            kw[key] = _count(raw[key], f"sandbox_pool.{key}")
    for key in ("window_s", "history_s", "mem_fraction"):
        if key in raw:
            kw[key] = _number(raw[key], f"sandbox_pool.{key}")
    if "shapes" in raw:
        kw["shapes"] = _shapes(raw["shapes"])
    policy = PoolPolicy(**kw)
    if (problem := policy.problem()) is not None:
        raise ConfigError(f"sandbox_pool: {problem}")
    return policy


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 16:
        raise ConfigError(f"{where}: expected an integer in [0, 65536], got {value!r}")
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{where}: expected a number >= 0, got {value!r}")
    return float(value)


def _shapes(raw: object) -> tuple[PoolShape, ...]:
    if not isinstance(raw, list):
        raise ConfigError("sandbox_pool.shapes: expected a list of {image, mem_mib}")
    out = []
    for i, s in enumerate(raw):
        where = f"sandbox_pool.shapes[{i}]"
        if not isinstance(s, dict) or set(s) - {"image", "mem_mib"}:
            raise ConfigError(f"{where}: expected a mapping of `image` and `mem_mib`")
        image = s.get("image", "")
        if not isinstance(image, str):
            raise ConfigError(f"{where}.image: expected a string, got {image!r}")
        out.append(PoolShape(image, _count(s.get("mem_mib", 0), f"{where}.mem_mib")))
    return tuple(out)


def shape_on(facts: dict[str, Any], image: str, mem_mib: int) -> PoolShape:
    """A shape as one node's agent makes it: its default image (`facts["image"]`) is written "", as an
    open that names no image asks for it, so both name one pool."""
    return PoolShape("" if image == facts.get("image") else image, mem_mib)


def _held(facts: dict[str, Any]) -> set[PoolShape]:
    """The shapes an agent says it holds pools of (its Hello facts)."""
    out = set()
    for row in facts.get("pool") or ():
        if isinstance(row, dict) and isinstance(row.get("image"), str) and type(row.get("mem_mib")) is int:
            out.add(shape_on(facts, row["image"], row["mem_mib"]))
    return out


class PoolKeeper:
    """Sizes and sends the pools of every agent (rules in the module doc). `core` is read, never called:
    only its nodes' memory (`core.cpu.nodes`)."""

    def __init__(self, policy: PoolPolicy, agents: Any, core: Any, clock: Any) -> None:
        self.policy = policy
        self.sizer = PoolSizer(policy)
        self.agents = agents  # AgentLink
        self.core = core
        self.clock = clock
        self.sent: dict[str, dict[PoolShape, int]] = {}
        self.counters = {"pool_targets_sent": 0, "pool_target_errors": 0}

    def on_create(self, c: cmd.CreateSandbox) -> None:
        agent = self.agents.agents.get(c.node)
        facts = agent.facts if agent is not None else {}
        self.sizer.opened(c.node, shape_on(facts, c.image, c.mem_mib), self.clock.now())

    def on_hello(self, node: str) -> None:
        """Rule 3."""
        agent = self.agents.agents.get(node)
        if agent is None or "pool" not in agent.facts:
            return
        self.sent[node] = {s: -1 for s in _held(agent.facts)}
        self._send_node(node, self.clock.now())

    def room(self, node: str) -> NodeRoom | None:
        n = self.core.cpu.nodes.get(node)
        agent = self.agents.agents.get(node)
        if n is None or agent is None:
            return None
        default = agent.facts.get("sandbox_mem_mib")
        return NodeRoom(n.mem_total, n.mem_free, default if isinstance(default, int) else 0)

    def tick(self) -> None:
        """Rule 2."""
        now = self.clock.now()
        for node, agent in sorted(self.agents.agents.items()):
            if agent.live and "pool" in agent.facts and node in self.sent:
                self._send_node(node, now)

    def _send_node(self, node: str, now: float) -> None:
        room = self.room(node)
        wanted = self.sizer.node_targets(node, now, room) if room is not None else {}
        sent = self.sent.setdefault(node, {})
        for shape in sorted(set(sent) | set(wanted)):
            count = wanted.get(shape, 0)
            if sent.get(shape) == count:
                continue
            sent[shape] = count
            msg = protocol.SandboxPool(count, shape.image, shape.mem_mib)
            self.agents.send_request(node, msg, (), lambda reply, n=node: self._answered(n, reply))
            self.counters["pool_targets_sent"] += 1

    def _answered(self, node: str, reply: Any) -> None:
        if isinstance(reply, protocol.Envelope) and isinstance(reply.msg, protocol.Error):
            self.counters["pool_target_errors"] += 1
            log.warning("node %s refused a sandbox pool target: %s", node, reply.msg.message)

    def rows(self) -> list[dict[str, Any]]:
        """What was last sent, per node and shape (for status and tests)."""
        return [
            {"node": node, "image": s.image, "mem_mib": s.mem_mib, "target": count}
            for node, shapes in sorted(self.sent.items())
            for s, count in sorted(shapes.items())
            if count >= 0
        ]

    def node_targets(self) -> dict[str, int]:
        """Each node's target as last sent, summed over its shapes (status's NODES `pool_target`)."""
        out: dict[str, int] = {}
        for row in self.rows():
            out[row["node"]] = out.get(row["node"], 0) + row["target"]
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PERIOD_S)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - sizing must never take the controller down
                log.exception("sandbox pool sizing failed")
