"""The agents ROUTER: handshake, liveness, command routing, matching agent replies.

Rules (docs/protocol.md, "Controller <-> agent contract" and "Controller behaviour"):

1. An agent's first message is `Hello(role="agent")`; the controller answers `Welcome` (new
   `agent_epoch`) or `Reject` (other major, bad facts, a second live agent with that name
   from another connection). A re-Hello of a live name on the same connection is a restart:
   `NodeLost` then `NodeJoined`. Sandboxes the agent lists that the controller does not hold
   on that node are destroyed.
2. Any message counts as a heartbeat. Silent for 3 heartbeat intervals -> `NodeLost`; its
   pending requests fail with `NodeLost` (the core already answered the actions).
3. Every request carries a fresh id; the agent answers exactly once (`Result`/`Error`; `Ack`
   for `Kill`). A reply to no pending request is dropped and counted (`stale_replies`).
4. Per node, commands keep the core's order where it matters: a sandbox's `Spawn`, `PutFile`
   and `GetFile` wait until its `CreateSandbox` (and the puts queued before placement) are
   done; per GPU, `Evict`/`Load` run one after another, and an `Invoke` waits for those issued
   before it on its GPUs (a restore on GPUs 4-7 does not hold up a call on GPUs 0-1).
5. An agent's result becomes `ActionFinished` for the core; the client reply is sent when the
   core answers with `Done` (so cores are free again before the client hears back).
6. A staged `Spawn` (`after` set: tangram/core/staging.py) goes to the agent at once; the agent
   starts it when `after` ends there. An agent older than protocol 1.6 cannot: its staged Spawns
   wait here for `after`'s result (`agent_cpu.py`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tangram import protocol
from tangram.aiotasks import cancel_tasks
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.errors import NodeLost, ProtocolError, SandboxLost
from tangram_cli.controller.agent_cpu import CpuCommands
from tangram_cli.controller.agent_gpu import GpuCommands
from tangram_cli.controller.config import ControllerConfig
from tangram_cli.controller.facts import Agent, Reply, node_event
from tangram_cli.controller.state import ActionRecord, Registry, encode_to
from tangram_cli.controller.wire import Batcher, send_now, serve, unread

log = logging.getLogger("tangram.controller.agents")

Post = Callable[..., None]


class AgentLink(CpuCommands, GpuCommands):
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        post: Post,
        registry: Registry,
        config: ControllerConfig,
        controller_epoch: int,
    ) -> None:
        self.sock = sock
        self.post = post  # Driver.post
        self.registry = registry
        self.clock = registry.clock
        self.config = config
        self.epoch = controller_epoch
        self.hb = config.heartbeat_s
        self.agents: dict[str, Agent] = {}
        self.by_ident: dict[bytes, str] = {}
        self._rid = 0
        self._epochs = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._byes: dict[str, asyncio.Future[None]] = {}
        self.counters: dict[str, int] = {
            "stale_replies": 0,
            "bad_frames": 0,
            "rejected_hellos": 0,
            "impostor_frames": 0,
            "agents_lost": 0,  # agents declared lost or gone (silence, restart, bye)
            "liveness_deferred": 0,  # liveness rounds that judged nobody: unread messages or a late wake-up
            "killed_on_hello": 0,  # actions an agent still ran when it said Hello, stopped
            "hello_asked": 0,  # heartbeats from agents this controller did not know, answered Bye
        }
        # CURVE: (routing identity, User-Id) -> whether that key belongs to that node; None: plain TCP
        self.peer_check: Callable[[bytes, str], bool] | None = None
        self._impostors_logged: set[tuple[bytes, str]] = set()
        self._asked: dict[bytes, float] = {}  # unknown agent identity -> when it was told to say Hello
        # what one driver batch sends an agent goes in one message (`wire.Batcher`)
        self.batcher = Batcher(sock, self._batches_to, self._undelivered)
        # (node, the sandboxes its Hello lists): adoption after a controller restart (recovery.py)
        self.on_hello: Callable[[str, set[str]], None] | None = None
        # node: every action its Hello listed is now stopped (recovery answers what ran there)
        self.on_cleared: Callable[[str], None] | None = None
        self.pipelined: set[str] = set()  # sandboxes whose first Spawn may follow their CreateSandbox
        self.deferred: dict[str, tuple[cmd.Spawn, ActionRecord]] = {}  # staged Spawns held (agent_cpu.py)

    # ------------------------------------------------------------ plumbing
    def _next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("agent task failed: %r", exc, exc_info=exc)

    def _send(
        self, agent: Agent, msg: protocol.Message, rid: int = 0, blobs: tuple[bytes, ...] | list[bytes] = ()
    ) -> bool:
        if isinstance(msg, protocol.Spawn):  # built from a decoded Exec: checked already
            frames = protocol.encode_trusted(msg, rid, blobs)
        else:
            frames = protocol.encode(msg, rid, blobs)
        ok = self.batcher.send(agent.ident, frames)
        agent.last_sent = self.clock.now()
        return ok

    def _agent_of(self, ident: bytes) -> Agent | None:
        name = self.by_ident.get(ident)
        return self.agents.get(name) if name is not None else None

    def _batches_to(self, ident: bytes) -> bool:
        agent = self._agent_of(ident)
        return agent is not None and agent.batches and agent.live

    def _undelivered(self, ident: bytes, frames: list[bytes]) -> None:
        """A held message the agent's socket did not take: its request fails as an unsent one."""
        lost = NodeLost(f"node {self.by_ident.get(ident)}: message could not be delivered")
        self._fail_pending(ident, int.from_bytes(frames[2][:8], "big"), lost)

    def _fail_pending(self, ident: bytes, rid: int, exc: BaseException) -> None:
        agent = self._agent_of(ident)
        entry = agent.pending.pop(rid, None) if agent is not None else None
        if entry is not None:
            entry[1](exc)

    def request(
        self, node: str, msg: protocol.Message, blobs: tuple[bytes, ...] | list[bytes] = ()
    ) -> asyncio.Future[protocol.Envelope]:
        """Send `msg` to `node`; the future resolves with the agent's reply envelope (Result or
        Error) or fails with NodeLost."""
        fut: asyncio.Future[protocol.Envelope] = asyncio.get_running_loop().create_future()

        def settle(reply: protocol.Envelope | BaseException) -> None:
            if fut.done():
                return
            if isinstance(reply, BaseException):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # callers may not wait
        self.send_request(node, msg, blobs, settle)
        return fut

    def send_request(
        self, node: str, msg: protocol.Message, blobs: tuple[bytes, ...] | list[bytes], on_reply: Reply
    ) -> None:
        """Send `msg` to `node`; `on_reply` gets the agent's reply envelope (Result or Error) or a
        NodeLost exception, exactly once. No future or task: the dispatch hot path."""
        agent = self.agents.get(node)
        if agent is None or not agent.live:
            on_reply(NodeLost(f"node {node} is not connected"))
            return
        rid = self._next_rid()
        agent.pending[rid] = (msg.NAME, on_reply)
        if not self._send(agent, msg, rid, blobs):
            agent.pending.pop(rid, None)
            on_reply(NodeLost(f"node {node}: message could not be delivered"))

    # ------------------------------------------------------------ receive
    async def run(self) -> None:
        if self.peer_check is None:
            await serve(self.sock, self._on_frames)
        else:
            await serve(self.sock, self._on_checked, copy=False)

    def _on_checked(self, raw: list[Any]) -> int:
        frames = [f.bytes for f in raw]
        user = raw[-1].get("User-Id") if len(raw) > 1 else ""
        if not self.peer_check(frames[0], user):  # type: ignore[misc]
            self._impostor(frames[0], user)
            return 1
        return self._on_frames(frames)

    def _impostor(self, ident: bytes, user: str) -> None:
        """A message whose CURVE key is not the key of the node it claims to be: dropped."""
        self.counters["impostor_frames"] += 1
        if (ident, user) not in self._impostors_logged and len(self._impostors_logged) < 1000:
            self._impostors_logged.add((ident, user))
            log.warning(
                "dropped a message from key %s claiming node %r (not that node's key)",
                user,
                ident.decode(errors="replace"),
            )

    def _on_frames(self, frames: list[bytes]) -> int:
        """One message from an agent (a batch: each item); returns how many messages it carried."""
        if len(frames) < 2:
            self.counters["bad_frames"] += 1
            return 1
        ident = frames[0]
        try:
            envs = protocol.decode_all(frames[1:])
        except ProtocolError as exc:
            self.counters["bad_frames"] += 1
            log.warning("bad frames from agent %r: %s", ident[:64], exc)
            send_now(self.sock, encode_to(ident, protocol.Error.from_exception(exc), 0))
            return 1
        for env in envs:  # one, or the items of a batch
            if isinstance(env, protocol.BadItem):
                self._bad_item(ident, env)
            else:
                self._on_envelope(ident, env)
        return len(envs)

    def _bad_item(self, ident: bytes, item: protocol.BadItem) -> None:
        """An item of an agent's batch that does not decode: its request fails with the reason."""
        self.counters["bad_frames"] += 1
        log.warning("bad message from agent %r (request %d): %s", ident[:64], item.request_id, item.error)
        self._fail_pending(ident, item.request_id, item.error)

    def _on_envelope(self, ident: bytes, env: protocol.Envelope) -> None:
        msg = env.msg
        if isinstance(msg, protocol.Hello):
            self._on_hello(ident, env.request_id, msg)
            return
        agent = self._agent_of(ident)
        if agent is None or agent.ident != ident or not agent.live:
            if isinstance(msg, protocol.Heartbeat):
                self._ask_hello(ident)
            else:
                log.info("message %s from an unregistered agent %r dropped", msg.NAME, ident[:64])
            return
        agent.last_seen = self.clock.now()
        if isinstance(msg, protocol.Heartbeat):
            agent.load = dict(msg.load)
        elif isinstance(msg, (protocol.Result, protocol.Error, protocol.Ack)):
            self._on_reply(agent, env)
        elif isinstance(msg, protocol.Bye):
            fut = self._byes.get(agent.name)
            if fut is not None and not fut.done():
                fut.set_result(None)
            self._lose(
                agent, f"agent said bye: {msg.reason}" if msg.reason else "agent said bye", state="down"
            )
        else:
            log.info("unexpected %s from agent %s", msg.NAME, agent.name)

    def _ask_hello(self, ident: bytes) -> None:
        """An agent this controller does not know keeps heartbeating (the controller restarted,
        or had declared it lost): `Bye` ends its session, and it says Hello at once instead of
        after three silent heartbeats. At most once a second per identity."""
        now = self.clock.now()
        if now - self._asked.get(ident, -1.0) < 1.0:
            return
        if len(self._asked) > 4096:
            self._asked.clear()
        self._asked[ident] = now
        self.counters["hello_asked"] += 1
        send_now(self.sock, encode_to(ident, protocol.Bye("unknown to this controller: say Hello again"), 0))

    def _on_reply(self, agent: Agent, env: protocol.Envelope) -> None:
        entry = agent.pending.get(env.request_id)
        if entry is None:
            self.counters["stale_replies"] += 1
            return
        kind, on_reply = entry
        if isinstance(env.msg, protocol.Ack) and kind not in ("KILL", "SHUTDOWN"):
            return  # a dispatch acknowledgement; the Result follows
        agent.pending.pop(env.request_id, None)
        on_reply(env)

    def _on_hello(self, ident: bytes, rid: int, hello: protocol.Hello) -> None:
        def reject(reason: str) -> None:
            self.counters["rejected_hellos"] += 1
            log.warning("agent %s rejected: %s", hello.name, reason)
            send_now(self.sock, encode_to(ident, protocol.Reject(reason[: protocol.MAX_TEXT]), rid))

        if (problem := protocol.version_problem(hello)) is not None:
            return reject(problem)
        if hello.role != "agent":
            return reject(f"role {hello.role!r} on the agents socket: connect to the submit or status port")
        try:
            joined = node_event(hello.name, dict(hello.facts))
        except ValueError as exc:
            return reject(f"bad facts: {exc}")
        old = self.agents.get(hello.name)
        if old is not None and old.live:
            if old.ident != ident:
                return reject(f"an agent named {hello.name} is already connected")
            old.restarts += 1
            self._lose(old, "agent restarted")
        self._epochs += 1
        agent = Agent(
            hello.name,
            ident,
            dict(hello.facts),
            self._epochs,
            joined=self.clock.now(),
            last_seen=self.clock.now(),
            last_sent=self.clock.now(),
            restarts=old.restarts if old is not None else 0,
            batches=hello.minor >= protocol.BATCH_MINOR,
            staged=hello.minor >= protocol.STAGED_MINOR,
        )
        if old is not None and old.ident != ident:
            self.by_ident.pop(old.ident, None)
        self.agents[hello.name] = agent
        self.by_ident[ident] = hello.name
        self._send(
            agent,
            protocol.Welcome(
                protocol.PROTOCOL_MAJOR, protocol.PROTOCOL_MINOR, self.epoch, agent.agent_epoch, self.hb
            ),
            rid,
        )
        log.info(
            "agent %s joined (epoch %d): %d cpus, %d gpus",
            hello.name,
            agent.agent_epoch,
            len(joined.cpus),
            joined.gpus,
        )
        self.post(joined)
        self._after_hello(hello, joined)

    def _after_hello(self, hello: protocol.Hello, joined: ev.NodeJoined) -> None:
        """A node's session started: adopt or destroy the sandboxes and actions its Hello lists,
        and load the configured services onto its GPUs."""
        if self.on_hello is not None:
            self.on_hello(hello.name, set(hello.sandboxes))
        self._kill_leftovers(hello.name, hello.actions)
        for sandbox in hello.sandboxes:
            rec = self.registry.sandboxes.get(sandbox)
            if rec is None or rec.closed or rec.lost or rec.node != hello.name:
                self.request(hello.name, protocol.DestroySandbox(sandbox))
        if joined.gpus:
            for svc in self.config.services:  # in every GPU's lane: loads wait for the host copies
                prepare = lambda s=svc: self._prepare(hello.name, s.name, s.spec)  # noqa: E731
                self._chain(hello.name, 0, joined.gpus, prepare)

    def _kill_leftovers(self, node: str, actions: list[dict[str, Any]]) -> None:
        """Whatever ran before this Hello is no one's now: stop it, then say the node is clear."""
        aids = [a for x in actions if isinstance(a := x.get("action"), str) and a]
        left = len(aids)

        def one_done(_reply: protocol.Envelope | BaseException) -> None:
            nonlocal left
            left -= 1
            if left == 0 and self.on_cleared is not None:
                self.on_cleared(node)

        for aid in aids:
            self.counters["killed_on_hello"] += 1
            self.send_request(node, protocol.Kill(aid, 0, self.epoch), (), one_done)
        if not aids and self.on_cleared is not None:
            self.on_cleared(node)

    async def _prepare(self, node: str, service: str, spec: dict[str, Any]) -> None:
        try:
            env = await self.request(node, protocol.Prepare(service, spec))
        except NodeLost:
            return
        if isinstance(env.msg, protocol.Error):
            log.error("prepare of %s on %s failed: %s", service, node, env.msg.message)
        else:
            log.info("service %s prepared on %s", service, node)

    # ------------------------------------------------------------ liveness
    async def liveness(self) -> None:
        """Heartbeats to agents, and NodeLost for an agent silent for 3 intervals. Silence is
        judged only on what the controller has read: while messages wait unread on the agents
        socket, or right after this task itself woke up late (a busy loop), nobody is declared
        lost: a busy controller must not drop a healthy agent."""
        period = min(self.hb / 2, 0.5)
        expected = self.clock.now() + period
        while True:
            await asyncio.sleep(period)
            now = self.clock.now()
            late, expected = now - expected, now + period
            for agent in list(self.agents.values()):
                if agent.live and now - agent.last_sent >= self.hb:
                    self._send(agent, protocol.Heartbeat())
            if late > self.hb or unread(self.sock):  # (which has the reader read it next)
                self.counters["liveness_deferred"] += 1
                continue
            for agent in list(self.agents.values()):
                if agent.live and now - agent.last_seen > 3 * self.hb:
                    self._lose(agent, f"no heartbeat for {now - agent.last_seen:.1f}s")

    def _lose(self, agent: Agent, reason: str, state: str = "lost") -> None:
        if not agent.live:
            return
        agent.state, agent.reason = state, reason
        (log.info if state == "down" else log.warning)("agent %s lost: %s", agent.name, reason)
        for rec in self.registry.sandboxes.values():
            if rec.node == agent.name and not rec.closed:
                rec.lost = True
        self.counters["agents_lost"] += 1
        pending, agent.pending = agent.pending, {}
        for _, on_reply in pending.values():
            try:
                on_reply(NodeLost(f"node {agent.name}: {reason}"))
            except Exception:
                log.exception("reply callback failed")
        self.post(ev.NodeLost(agent.name, reason))

    # ------------------------------------------------------------ commands from the core
    def create_sandbox(self, c: cmd.CreateSandbox) -> None:
        rec = self.registry.sandboxes.get(c.sandbox)
        if rec is None:
            return
        rec.node = c.node
        rec.ready = asyncio.get_running_loop().create_future()
        rec.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        labels = {"tangram.cluster": self.config.cluster[:256], "tangram.sandbox": c.sandbox}
        labels.update({"tangram.cluster-id": self.config.cluster_id} if self.config.cluster_id else {})
        msg = protocol.CreateSandbox(c.sandbox, c.image or rec.image, c.mem_mib, labels)
        sent = self.request(c.node, msg)
        agent = self.agents.get(c.node)
        if not rec.pending_puts and agent is not None and agent.facts.get("spawn_after_create") is True:
            self.pipelined.add(c.sandbox)  # its first Spawn goes right behind (see `spawn`)
        self._spawn_task(self._create(c, rec, sent))

    async def _create(self, c: cmd.CreateSandbox, rec: Any, sent: asyncio.Future[protocol.Envelope]) -> None:
        try:
            env = await sent
            self.pipelined.discard(c.sandbox)
            if isinstance(env.msg, protocol.Error):
                raise SandboxLost(f"sandbox {c.sandbox} could not be created on {c.node}: {env.msg.message}")
            puts, rec.pending_puts, rec.pending_bytes = rec.pending_puts, [], 0
            for path, data in puts:
                env = await self.request(c.node, protocol.PutFile(c.sandbox, path), [data])
                if isinstance(env.msg, protocol.Error):
                    log.warning("queued put %s into %s failed: %s", path, c.sandbox, env.msg.message)
        except Exception as exc:
            self.pipelined.discard(c.sandbox)
            if not rec.ready.done():
                rec.ready.set_exception(
                    exc if isinstance(exc, (SandboxLost, NodeLost)) else SandboxLost(str(exc))
                )
            return
        if not rec.ready.done():
            rec.ready.set_result(None)

    def destroy_sandbox(self, c: cmd.DestroySandbox) -> None:
        self.send_request(c.node, protocol.DestroySandbox(c.sandbox), (), _ignore)

    def kill(self, c: cmd.Kill) -> None:
        rec = self.registry.actions.get(c.action_id)
        if rec is not None and rec.kind == "call":
            return  # calls end by their own timeout on the agent; nothing to kill
        if self.kill_deferred(c.action_id):
            return
        self.send_request(c.node, protocol.Kill(c.action_id, 0, self.epoch), (), _ignore)

    # ------------------------------------------------------------ files
    async def file_request(
        self, sandbox: str, msg: protocol.Message, blobs: list[bytes] = ()
    ) -> protocol.Envelope:  # type: ignore[assignment]
        rec = self.registry.sandboxes[sandbox]
        if rec.ready is not None:
            await asyncio.shield(rec.ready)
        return await self.request(rec.node, msg, blobs)

    # ------------------------------------------------------------ shutdown
    async def shutdown_agents(self, reason: str, timeout: float = 5.0) -> None:
        waits = []
        for agent in self.agents.values():
            if agent.live:
                fut = asyncio.get_running_loop().create_future()
                self._byes[agent.name] = fut
                self._send(agent, protocol.Shutdown(reason), self._next_rid())
                waits.append(fut)
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    async def close(self) -> None:
        await cancel_tasks(self._tasks)

    def rows(self) -> list[dict[str, Any]]:
        now = self.clock.now()
        out = []
        for a in sorted(self.agents.values(), key=lambda a: a.name):
            f = a.facts
            out.append(
                {
                    "node": a.name,
                    "agent_state": a.state,
                    "heartbeat_age_s": round(now - a.last_seen, 3),
                    "connected_s": round(now - a.joined, 3),
                    "agent_epoch": a.agent_epoch,
                    "restarts": a.restarts,
                    "reason": a.reason,
                    "executor": str(f.get("executor", "")),
                    "docker": bool(f.get("docker", False)),
                    "cgroup": str(f.get("cgroup", "")),
                    "hostname": str(f.get("hostname", "")),
                    "pid": f.get("pid") if isinstance(f.get("pid"), int) else None,
                    "version": str(f.get("version", "")),
                    "numa": f.get("numa") if isinstance(f.get("numa"), list) else [],
                    "idle_cpus": f.get("idle_cpus") if isinstance(f.get("idle_cpus"), list) else [],
                    "gpu_uuids": f.get("gpu_uuids") if isinstance(f.get("gpu_uuids"), list) else [],
                    "inflight_requests": len(a.pending),
                    "pool_idle": a.load.get("pool_idle", 0),  # idle pooled sandboxes (pools.py)
                    "pool_mem_mib": a.load.get("pool_mem_mib", 0),
                }
            )
        return out


def _ignore(reply: protocol.Envelope | BaseException) -> None:
    """For fire-and-forget requests (Kill, DestroySandbox): the outcome changes nothing here."""


def new_epoch() -> int:
    return secrets.randbits(62)
