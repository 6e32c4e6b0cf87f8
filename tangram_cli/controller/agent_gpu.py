"""The GPU half of the agent link: `Load`, `Evict` and `Invoke` in the lanes of a node's GPUs.

Rule 4 of `agents.py`: per GPU, `Evict`/`Load` run one after another, and an `Invoke` waits
for those issued before it on its GPUs (`_chain`, `_before`): each GPU of a node has its own
lane, so a restore onto some GPUs never holds up a call or a restore on the others. (The agent
also runs what overlaps in arrival order: agent/gpu/host.py, rule 1.) `AgentLink` inherits these
methods; they use its `agents`, `request`, `post` and task set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from tangram import protocol
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.errors import NodeLost
from tangram.outcomes import CallOutcome
from tangram_cli.controller.state import ActionRecord, Outcome

log = logging.getLogger("tangram.controller.agents")


class GpuCommands:
    """Mixed into `AgentLink` (which provides the attributes below)."""

    agents: dict[str, Any]
    clock: Any
    epoch: int
    post: Callable[..., None]
    request: Callable[..., asyncio.Future[protocol.Envelope]]
    _spawn_task: Callable[[Any], None]

    def _before(self, node: str, start: int, end: int) -> list[asyncio.Future[None]]:
        """The last Load/Evict issued on each of GPUs [start, end) of `node` (distinct)."""
        agent = self.agents.get(node)
        if agent is None:
            return []
        tails = (agent.gpu_tails.get(g) for g in range(start, end))
        return list({id(t): t for t in tails if t is not None and not t.done()}.values())

    def _chain(self, node: str, start: int, end: int, coro_fn: Callable[[], Any]) -> asyncio.Future[None]:
        """Run `coro_fn` once the Loads/Evicts issued before on GPUs [start, end) are done."""
        prev = self._before(node, start, end)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def step() -> None:
            try:
                if prev:
                    await asyncio.shield(asyncio.gather(*prev, return_exceptions=True))
                await coro_fn()
            finally:
                if not done.done():
                    done.set_result(None)

        self._spawn_task(step())
        agent = self.agents.get(node)
        if agent is not None:
            for g in range(start, end):
                agent.gpu_tails[g] = done
        return done

    def load(self, c: cmd.Load) -> asyncio.Future[None]:
        failed: dict[str, str] = {}

        async def run() -> None:
            try:
                env = await self.request(c.node, protocol.Load(c.service, list(range(c.start, c.end))))
            except NodeLost as exc:  # its connection dropped (maybe before the node is declared lost)
                failed["why"] = f"node {c.node} lost during the load of {c.service}: {exc}"
                failed["lost"] = "1"
                return
            if isinstance(env.msg, protocol.Error):
                failed["why"] = f"load of {c.service} failed: {env.msg.message}"
                log.error("%s on %s", failed["why"], c.node)
                self.post(ev.ServiceEvicted(c.node, c.service, c.start))

        fut = self._chain(c.node, c.start, c.end, run)
        fut.failed = failed  # type: ignore[attr-defined]
        return fut

    def evict(self, c: cmd.Evict) -> None:
        async def run() -> None:
            with contextlib.suppress(NodeLost):
                env = await self.request(c.node, protocol.Evict(c.service, list(range(c.start, c.end))))
                if isinstance(env.msg, protocol.Error):
                    log.error("evict of %s on %s failed: %s", c.service, c.node, env.msg.message)

        self._chain(c.node, c.start, c.end, run)

    def invoke(self, c: cmd.Invoke, rec: ActionRecord, load: asyncio.Future[None] | None) -> None:
        self._spawn_task(self._invoke(c, rec, self._before(c.node, c.start, c.end), load))

    async def _invoke(
        self,
        c: cmd.Invoke,
        rec: ActionRecord,
        before: list[asyncio.Future[None]],
        load: asyncio.Future[None] | None,
    ) -> None:
        if before:
            await asyncio.shield(asyncio.gather(*before, return_exceptions=True))
        failed = getattr(load, "failed", {}) if load is not None else {}
        if failed.get("why"):  # a lost node is NODE_LOST (retryable), as for any action on it
            why = failed["why"]
            error = protocol.Error.from_exception(NodeLost(why)) if failed.get("lost") else None
            rec.outcome = Outcome(error=error or protocol.Error("INTERNAL", why, False))
            self.post(ev.ActionFinished(c.action_id, ok=False, reason="load failed"))
            return
        agent = self.agents.get(c.node)
        timeout_s = rec.run_budget(self.clock.now())
        msg = protocol.Invoke(
            c.action_id,
            c.service,
            list(range(c.start, c.end)),
            timeout_s,
            1,
            self.epoch,
            agent.agent_epoch if agent else 0,
        )
        try:
            env = await self.request(c.node, msg, [rec.payload])
        except NodeLost:
            return
        out = rec.outcome = Outcome.of_reply(CallOutcome, env)
        if out.error is not None:
            self.post(ev.ActionFinished(c.action_id, ok=False, reason=out.error.code))
            return
        self.post(ev.ActionFinished(c.action_id, ok=True))

