"""Staged starts: a CPU action decided before the cores it will run on are free.

Every exec holds its cores from its start until the core hears that it ended. Live, that hold
is the agent's run plus a round trip: the agent reports the exit, the controller decides, the
next ``Spawn`` travels back. For short actions the round trip is as long as the run itself, and
the cores idle through it. A staged start takes it out: when a node's queue is blocked (its
head does not fit in the free cores), the CPU pass may already decide the head's start on the
cores of a running action ``A`` of the same size, and send ``Spawn(after=A)`` at once. The
agent starts it the moment ``A``'s process is gone, whatever ``A``'s outcome; the core moves
it to running when ``ActionFinished(A)`` arrives, on ``A``'s cores, which never return to the
free pool in between. Both sides follow the agent's order of reports, so they agree in every
race:

- ``A`` ends, then the follower ``B`` is killed (cancel, deadline, sandbox closed): ``B`` ran,
  the agent kills it, ``ActionFinished(B)`` comes after ``ActionFinished(A)``;
- ``B`` is killed while staged: the agent drops it unstarted and reports it first;
  ``ActionFinished(B)`` then only unstages it, and ``A``'s cores are given back as usual;
- ``A``'s node is lost: its staged followers fail with it (``SANDBOX_LOST``), never started.

What is staged, and where (``stage``): only fixed-size execs whose sandbox lives on the
blocked node (an elastic one could get more cores from the passes at ``A``'s end), in FCFS
order, each behind the running exec of the same size expected to end first that has no
follower yet (one follower per running action), and only while that slot is expected to end
no later than the earliest staged chain (``A``'s end plus its follower's estimate): a core that
frees sooner behind a staged chain would serve the next action better than a long runner's.
And only behind a run expected to end within ``CoreConfig.stage_within_s`` (50 ms): the gain is
one round trip per start, which matters for short actions only, while a guess at a long run's
end can be off by seconds (another core may free first; the staged action still waits for its
predecessor). ``tangram sim -p tangram+staged`` measures that cost.
Staging is off with several RL jobs waiting or a job cap in force (the fair-share merge decides
at each end who is next), and for the fixed and maximum baselines. ``CoreConfig.stage``
switches it on (the live controller; the simulator's ``+staged`` policy).

A staged action is neither queued nor running: ``Stages`` owns it (one record per action, by
id, by predecessor and by sandbox) until it is promoted or ends.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core.actions import Kind
from tangram.core.state import MIN, TANGRAM, Running, Waiting, expected_left

if TYPE_CHECKING:
    from tangram.core.context import PassContext


@dataclass
class Staged:
    """An exec decided to start on ``after``'s cores when ``after`` ends."""

    w: Waiting
    after: str
    node: str
    cores: tuple[int, ...]
    units: int
    est: float
    killed: bool = False


class Stages:
    """The staged actions (the one owner): by id, by predecessor and by sandbox."""

    def __init__(self) -> None:
        self.by_id: dict[str, Staged] = {}
        self._behind: dict[str, str] = {}  # predecessor -> its follower
        self._by_sandbox: dict[str, dict[str, None]] = {}
        self.overran: set[str] = set()  # running actions a staged start was given back from: none behind them

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, aid: object) -> bool:
        return aid in self.by_id

    def get(self, aid: str) -> Staged | None:
        return self.by_id.get(aid)

    def has_follower(self, aid: str) -> bool:
        return aid in self._behind

    def add(self, s: Staged) -> None:
        aid = s.w.spec.action_id
        self.by_id[aid] = s
        self._behind[s.after] = aid
        self._by_sandbox.setdefault(s.w.spec.sandbox, {})[aid] = None

    def pop(self, aid: str) -> Staged:
        s = self.by_id.pop(aid)
        del self._behind[s.after]
        mine = self._by_sandbox[s.w.spec.sandbox]
        del mine[aid]
        if not mine:
            del self._by_sandbox[s.w.spec.sandbox]
        return s

    def peek(self, after: str) -> Staged | None:
        """The staged action that starts when ``after`` ends (left in place)."""
        aid = self._behind.get(after)
        return None if aid is None else self.by_id[aid]

    def follower(self, after: str) -> Staged | None:
        """The staged action that starts when ``after`` ends, taken out of the stages."""
        aid = self._behind.get(after)
        return None if aid is None else self.pop(aid)

    def relink(self, gone: str, after: str) -> None:
        """``gone`` left the stages: its follower, if any, follows ``after`` instead."""
        aid = self._behind.pop(gone, None)
        if aid is not None:
            self.by_id[aid].after = after
            self._behind[after] = aid

    def chain_s(self, after: str) -> float:
        """The estimated run time of the chain staged behind ``after``."""
        total = 0.0
        while (f := self.peek(after)) is not None:
            total, after = total + f.est, f.w.spec.action_id
        return total

    def of_sandbox(self, sandbox: str) -> list[Staged]:
        return [self.by_id[a] for a in self._by_sandbox.get(sandbox, {})]

    def on_node(self, node: str) -> list[Staged]:
        """The node's staged actions, in submission order (node loss only: a scan)."""
        return sorted((s for s in self.by_id.values() if s.node == node), key=lambda s: s.w.seq)

    def kill(self, aid: str, reason: str, out: list[cmd.Command]) -> bool:
        """Kill a staged action (the agent drops it unstarted, or kills it if it just started);
        False when ``aid`` is not staged."""
        s = self.by_id.get(aid)
        if s is None:
            return False
        if not s.killed:
            s.killed = True
            out.append(cmd.Kill(aid, s.node, reason))
        return True

    def deadline_live(self, aid: str, t: float) -> bool | None:
        """Whether ``aid``'s deadline ``t`` still applies; None when ``aid`` is not staged."""
        s = self.by_id.get(aid)
        return None if s is None else (s.w.deadline == t and not s.killed)


def promote(stages: Stages, ended: Running, now: float) -> Running | None:
    """``ended`` left the running table: its follower's record as a running action on the same
    cores (they stay taken), or None when it has none."""
    s = stages.follower(ended.spec.action_id)
    if s is None:
        return None
    return Running(s.w.spec, ended.node, s.units, now, now + s.est, cores=ended.cores,
                   deadline=s.w.deadline, killed=s.killed)


def allowed(ctx: PassContext, jobs_waiting: int, limited: bool) -> bool:
    """Whether this CPU pass may stage (see the module docstring)."""
    return ctx.config.stage and ctx.config.policy in (TANGRAM, MIN) and jobs_waiting <= 1 and not limited


def stage(ctx: PassContext, stages: Stages, node: str, queue: list[Waiting], out: list[cmd.Command]) -> None:
    """Stage the FCFS head of ``node``'s blocked ``queue`` (and the ones after it) behind the
    node's running execs and their chains (see the module docstring)."""
    if not queue:
        return
    now, cfg = ctx.now, ctx.config
    # (end, order, chain tail, cores, units, depth) per chain that may grow
    slots: list[tuple[float, int, str, tuple[int, ...], int, int]] = []
    full = float("inf")  # the earliest end of a chain that may not grow (``stage_depth``)
    for i, r in enumerate(ctx.running.on(node, Kind.EXEC).values()):
        if not r.units or r.spec.action_id in stages.overran:
            continue
        end = now if r.killed else now + expected_left(r, now)
        tail, depth = r.spec.action_id, 0
        while (f := stages.peek(tail)) is not None:
            end, tail, depth = end + f.est, f.w.spec.action_id, depth + 1
        if depth < cfg.stage_depth:
            slots.append((end, i, tail, r.cores, r.units, depth))
        else:
            full = min(full, end)
    heapq.heapify(slots)
    for w in queue:
        if not slots or not _stageable(ctx, w, node):
            return
        end, i, tail, cores, units, depth = slots[0]
        if units != w.need or end > full or end - now > cfg.stage_within_s:
            return  # FCFS: nothing behind it is staged either
        est = ctx.estimate(w.spec, w.need)
        ctx.dequeue(w.spec.action_id)
        stages.add(Staged(w, tail, node, cores, w.need, est))
        ctx.count("staged")
        if depth + 1 < cfg.stage_depth:
            heapq.heapreplace(slots, (end + est, i, w.spec.action_id, cores, units, depth + 1))
        else:
            heapq.heappop(slots)
            full = min(full, end + est)
        out.append(cmd.Spawn(w.spec.action_id, node, w.spec.sandbox, cores, w.need, est, after=tail))


def worth(ctx: PassContext, node: str, head: Waiting) -> bool:
    """Whether reading ``node``'s blocked queue for staging is worth it: its head could be staged
    (fixed-size exec; its sandbox may still be bound in this pass) and an exec runs on the node."""
    return _fixed_exec(ctx, head) and bool(ctx.running.on(node, Kind.EXEC))


def _fixed_exec(ctx: PassContext, w: Waiting) -> bool:
    """An exec whose units the passes would not change at its start (fixed, or the ``min`` policy)."""
    return w.spec.kind is Kind.EXEC and (not w.spec.key_demand.elastic or ctx.config.policy == MIN)


def _stageable(ctx: PassContext, w: Waiting, node: str) -> bool:
    if not _fixed_exec(ctx, w):
        return False
    sb = ctx.sandboxes.get(w.spec.sandbox)
    return sb is not None and sb.node == node and not sb.lost


def lose_node(stages: Stages, node: str, reason: str, out: list[cmd.Command],
              count: Callable[[str], None]) -> None:
    """``node`` is lost: its staged actions fail with it, never started."""
    for s in stages.on_node(node):
        aid = s.w.spec.action_id
        stages.pop(aid)
        count("failed")
        out.append(cmd.Done(aid, False, reason))
        out.append(cmd.Reject(aid, "SANDBOX_LOST", f"{node}: {reason}"))


def end_unstarted(stages: Stages, aid: str, ok: bool, reason: str, out: list[cmd.Command],
                  count: Callable[[str], None]) -> None:
    """The agent reported a staged action before its predecessor (it dropped it unstarted, on
    a kill): it leaves the stages, its own follower now follows its predecessor (the agent
    holds it until the predecessor is gone too), and the cores pass on when that one ends."""
    s = stages.pop(aid)
    stages.relink(aid, s.after)
    count("finished" if ok else "failed")
    out.append(cmd.Done(aid, ok, reason))


def give_back(stages: Stages, aid: str, requeue: Callable[[Waiting], None], out: list[cmd.Command],
              count: Callable[[str], None]) -> None:
    """The agent gave staged ``aid`` back unstarted: its predecessor overran the guess. It
    leaves the stages and queues again in its place (its seq: FCFS holds); what followed it now
    follows its predecessor, and nothing more is staged behind that predecessor (``overran``,
    until it ends). One killed meanwhile (its Kill crossed the give-back) ends here, unstarted.
    Nothing changes when ``aid`` is not staged (a lost node ended it first)."""
    s = stages.by_id.get(aid)
    if s is None:
        return
    stages.overran.add(s.after)
    if s.killed:
        end_unstarted(stages, aid, False, "killed while staged", out, count)
        return
    stages.pop(aid)
    stages.relink(aid, s.after)
    requeue(s.w)
    count("unstaged")
