"""The CPU half of the agent link: `Spawn`s, their results, and staged starts for old agents.

A `Spawn` goes out at once when its sandbox exists, or right behind its `CreateSandbox` to an
agent that orders them itself (`spawn_after_create`); otherwise it waits for the creation. A
staged `Spawn` (`after` set: tangram/core/staging.py) goes out at once too, and the agent starts
it when `after` has ended there, or gives it back unstarted when `after` overruns (1.7: the
action queues again, `ActionUnstaged`); an agent whose Hello said a minor below 1.6 (`STAGED_MINOR`)
would start it at once instead, so for such an agent it waits here (`deferred`) until `after`'s
result has come in. `AgentLink` inherits these methods; they use its `agents`, `registry`,
`post`, `send_request` and task set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tangram import protocol
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.errors import NodeLost, SandboxLost
from tangram.outcomes import ExecOutcome
from tangram_cli.controller.state import ActionRecord, Outcome


class CpuCommands:
    """Mixed into `AgentLink` (which provides the attributes below)."""

    agents: dict[str, Any]
    registry: Any
    clock: Any
    epoch: int
    pipelined: set[str]
    deferred: dict[str, tuple[cmd.Spawn, ActionRecord]]
    post: Callable[..., None]
    send_request: Callable[..., None]
    _spawn_task: Callable[[Any], None]

    def spawn(self, c: cmd.Spawn, rec: ActionRecord) -> None:
        """Send `Spawn` now when the sandbox exists (the hot path: no task, no future), or when its
        `CreateSandbox` went to an agent that runs a Spawn only after the CreateSandbox before it
        (its facts say `spawn_after_create`; no puts waited for the sandbox): it saves a round trip
        on every open. Otherwise wait for the creation first."""
        sb = self.registry.sandboxes.get(c.sandbox)
        ready = sb.ready if sb is not None else None
        if ready is not None and not (ready.done() and not ready.cancelled() and ready.exception() is None):
            if c.sandbox not in self.pipelined:
                self._spawn_task(self._spawn_when_ready(c, rec, ready))
                return
        self._send_spawn(c, rec)

    async def _spawn_when_ready(self, c: cmd.Spawn, rec: ActionRecord, ready: asyncio.Future[None]) -> None:
        try:
            await asyncio.shield(ready)
        except NodeLost:
            return  # the core already failed the action (NodeLost event)
        except SandboxLost as exc:
            rec.outcome = Outcome(error=protocol.Error.from_exception(exc))
            self.post(ev.ActionFinished(c.action_id, ok=False, reason="sandbox lost"))
            return
        self._send_spawn(c, rec)

    def _send_spawn(self, c: cmd.Spawn, rec: ActionRecord) -> None:
        if rec.kill_reason:  # killed before it was sent: nothing ran
            rec.outcome = Outcome(result=ExecOutcome(killed=True))
            self.post(ev.ActionFinished(c.action_id, ok=False, reason=rec.kill_reason))
            return
        agent = self.agents.get(c.node)
        before = self.registry.actions.get(c.after) if c.after else None
        if before is not None and before.outcome is None and agent is not None and not agent.staged:
            self.deferred[c.after] = (c, rec)  # an agent before 1.6 would start it at once: hold it here
            return
        sb = self.registry.sandboxes.get(c.sandbox)
        msg = protocol.Spawn(
            c.action_id,
            c.sandbox,
            rec.cmd,
            list(c.cores),
            c.dop,
            rec.env,
            rec.run_budget(self.clock.now()),
            1,
            self.epoch,
            agent.agent_epoch if agent else 0,
            c.after if agent is not None and agent.staged else "",
        )
        if sb is not None:
            sb.busy += 1

        def on_reply(reply: protocol.Envelope | BaseException) -> None:
            if sb is not None:
                sb.busy -= 1
            self._spawn_ended(c.action_id, rec, reply)

        self.send_request(c.node, msg, [rec.stdin] if rec.stdin is not None else [], on_reply)

    def _spawn_ended(
        self, action_id: str, rec: ActionRecord, reply: protocol.Envelope | BaseException
    ) -> None:
        follower = self.deferred.pop(action_id, None)
        self._spawn_result(action_id, rec, reply)
        if follower is not None and not isinstance(reply, NodeLost):  # its cores are free on the node now
            self._send_spawn(*follower)

    def kill_deferred(self, action_id: str) -> bool:
        """A staged Spawn still held here is killed: it ends unstarted at once. False: none held."""
        for after, (c, rec) in self.deferred.items():
            if c.action_id == action_id:
                del self.deferred[after]
                rec.outcome = Outcome(result=ExecOutcome(killed=True))
                self.post(ev.ActionFinished(action_id, ok=False, reason=rec.kill_reason or "killed"))
                return True
        return False

    def _spawn_result(
        self, action_id: str, rec: ActionRecord, reply: protocol.Envelope | BaseException
    ) -> None:
        if isinstance(reply, NodeLost):
            return  # the core already failed the action (NodeLost event)
        if isinstance(reply, BaseException):
            rec.outcome = Outcome(error=protocol.Error.from_exception(reply))
            self.post(ev.ActionFinished(action_id, ok=False, reason=type(reply).__name__))
            return
        out = rec.outcome = Outcome.of_reply(ExecOutcome, reply)
        if out.error is not None:
            self.post(ev.ActionFinished(action_id, ok=False, reason=out.error.code))
            return
        res: ExecOutcome = out.result  # type: ignore[assignment]
        if res.unstaged:  # a staged start given back unstarted (agent/staged.py): it queues again
            rec.outcome = None
            self.post(ev.ActionUnstaged(action_id))
            return
        ok = not (res.killed or res.timed_out)
        self.post(ev.ActionFinished(action_id, ok=ok, reason=f"exit {res.exit_code}"))
