"""A controller's restart: facts into the ledger while it runs, facts back out when it starts.

`Recovery` is the one owner of the ledger (`ledger.py`) and of the sandboxes that wait to be
adopted. While the controller runs, `record` sees every handled event with its commands, and
writes what a successor needs: sandboxes opened, placed and gone, and every Spawn/Invoke
before it is sent (the gateway writes the final replies itself, through `ledger`).

At start `restore` puts back:

- **sandboxes**: the ones that never ran anything are open again at once; the ones placed on a
  node wait (``restoring``) for that node's agent to say Hello. An agent that lists one adopts
  it (`SandboxAdopted`: same node, same files, nothing created); one that does not, or no
  agent within `grace_s`, makes it lost (`SandboxLost` to its requests). Requests for a
  sandbox that waits are held by the gateway and handled once it is adopted or lost.
- **final replies** younger than the reply cache's TTL: a client that resends the request
  gets the original reply.
- **requests that were running** with no reply yet: a resend gets NODE_LOST (retryable); the
  action was stopped (the agent's Hello lists it and the controller kills it), never run twice.
- **leases** not yet released: granted again at once (the client still holds them), so an
  API's concurrency stays bounded; each quota-mode API's current **window** (`ApiUsed`), so a
  restart does not reset a quota.
- **API keys** (key pools): each key's charges of the last minute and its cool-down after a
  rate-limit answer (`KeyUsed`), and each restored lease goes back on the key it held (the one
  whose secret its holder still uses), counted in that key's in-flight (`ActionSpec.api_key`).
- the sandboxes' and leases' **owners** as known clients, so a client that never comes back is released
  after the client grace like any silent one.

Until every node that was up has said Hello again (or the grace ends), execs, calls and
reserving opens are held, so that a client that is faster than the agents does not get
NO_CAPACITY from a cluster that only seems empty.

Queued requests are not kept: they never ran, and the client resends them after it sees the
new controller epoch, so they are simply submitted again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tangram import protocol
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import Scheduler
from tangram_cli.controller.gateway import lease_spec
from tangram_cli.controller.ledger import ANSWER_TTL_S, ChargeFact, LeaseFact, Ledger, Restored
from tangram_cli.controller.sessions import client_key
from tangram_cli.controller.state import ActionRecord, Registry, SandboxRecord

if TYPE_CHECKING:
    from tangram_cli.controller.gateway import Gateway

Step = Callable[[ev.Event], object]
Held = tuple[bytes, int, Any, tuple[bytes, ...]]

log = logging.getLogger("tangram.controller.recovery")

RAN_TEXT = (
    "the controller restarted while this request ran; the action was stopped and not run again "
    "(resubmit it if it is safe to repeat)"
)
TOO_LARGE_TEXT = "the action finished before the controller restarted; its result was too large to keep"


class Recovery:
    def __init__(
        self,
        ledger: Ledger,
        core: Scheduler,
        registry: Registry,
        gateway: Gateway,
        post: Callable[..., None],
        grace_s: float,
    ) -> None:
        self.ledger = ledger
        self.core = core  # read only: an API's quota window, to record it
        self.registry = registry
        self.gateway = gateway
        self.post = post
        self.clock = registry.clock
        self.grace_s = grace_s
        self.restoring_until = 0.0
        self.ran_on: dict[str, list[tuple[bytes, int]]] = {}  # node -> requests that ran there
        self.waiting_nodes: set[str] = set()  # up before the restart, not back yet
        self.held: list[Held] = []  # requests held until they are
        self.counters = {
            "restored_sandboxes": 0,
            "restored_answers": 0,
            "restored_ran": 0,
            "restored_leases": 0,
            "adopted_sandboxes": 0,
            "unadopted_sandboxes": 0,
        }

    # ------------------------------------------------------------ start
    def restore(self, step: Step) -> Restored:
        """Replay the ledger into the registry, the gateway and (through `step`) the core."""
        r = self.ledger.restore()
        now, wall = self.clock.now(), self.ledger.wall()
        for key, (kind, t, frames) in r.answers.items():
            if frames is None:
                frames = protocol.encode(protocol.Error("NODE_LOST", TOO_LARGE_TEXT, False), key[1])
            self.gateway.restore_final(key, kind, frames, now + max(0.0, ANSWER_TTL_S - (wall - t)))
        for key, (kind, node, _action) in r.ran.items():
            if node:  # answered once that node's agent has stopped what it still ran (on_cleared)
                self.gateway.restore_waiting(key, kind)
                self.ran_on.setdefault(node, []).append(key)
            else:
                self._answer_ran(key)
        for s in r.sandboxes.values():
            rec = SandboxRecord(
                s.sandbox,
                s.ident,
                client_key(s.ident),
                s.image,
                s.mem_mib,
                s.reserve,
                opened=now,
                node=s.node,
                restoring=bool(s.node),
            )
            self.registry.sandboxes[s.sandbox] = rec
            self.gateway.restore_client(s.ident)
            step(ev.SandboxOpened(s.sandbox, rec.client, s.mem_mib, s.image, s.reserve))
        self._restore_apis(r, step, wall)
        self.counters.update(
            restored_sandboxes=len(r.sandboxes), restored_answers=len(r.answers), restored_ran=len(r.ran)
        )
        self.waiting_nodes = set(r.nodes)
        if self.waiting_nodes:
            self.gateway.hold = self.hold
        if not r.empty:
            self.restoring_until = now + self.grace_s
            log.info(
                "restored from %s: %d sandboxes, %d final replies, %d requests that were running%s",
                self.ledger.path,
                len(r.sandboxes),
                len(r.answers),
                len(r.ran),
                f" ({r.skipped} unreadable lines skipped)" if r.skipped else "",
            )
        return r

    def _restore_apis(self, r: Restored, step: Step, wall: float) -> None:
        live = [lf for lf in r.leases.values() if lf.expires > wall]
        for api, (used, start) in r.quotas.items():
            held = sum(lf.units for lf in live if lf.api == api)  # granted again below
            step(ev.ApiUsed(api, max(0, used - held), max(0.0, wall - start)))
        for e in key_events(r, {lf.action for lf in live}, wall):
            step(e)
        now = self.clock.now()
        for lf in live:
            left = lf.expires - wall
            self.registry.actions[lf.action] = ActionRecord(
                lf.action,
                "lease",
                lf.ident,
                lf.rid,
                client_key(lf.ident),
                now,
                now + left,
                units=lf.units,
                started=now,
                granted=True,
                final_sent=True,
            )
            self.gateway.restore_client(lf.ident)
            spec = lease_spec(lf.action, lf.api, lf.units, client_key(lf.ident), left)
            step(ev.ActionSubmitted(replace(spec, api_key=lf.key)))
        self.counters["restored_leases"] = len(live)

    # ------------------------------------------------------------ while running
    def record(self, event: ev.Event, commands: list[cmd.Command]) -> None:
        """Write the facts of one handled event (before its commands are sent)."""
        if not self.ledger.enabled:
            return
        sandboxes = self.registry.sandboxes
        if isinstance(event, (ev.NodeJoined, ev.NodeLost)):
            self.ledger.node(event.node, isinstance(event, ev.NodeJoined))
        if isinstance(event, ev.ApiReported):
            self._reported(event.action_id)
        if isinstance(event, ev.SandboxOpened):
            rec = sandboxes.get(event.sandbox)
            if rec is not None and not rec.restoring:
                self.ledger.opened(rec.sandbox, rec.ident, rec.image, rec.mem_mib, rec.reserve)
        elif isinstance(event, ev.SandboxClosed):
            self.ledger.gone([event.sandbox])
        elif isinstance(event, ev.ClientGone):
            self.ledger.gone([s for s, rec in sandboxes.items() if rec.client == event.client])
        elif isinstance(event, ev.NodeLost):
            self.ledger.gone([s for s, rec in sandboxes.items() if rec.node == event.node])
        for c in commands:
            if isinstance(c, cmd.CreateSandbox):
                self.ledger.placed(c.sandbox, c.node)
            elif isinstance(c, cmd.Grant):
                self._granted(c)
            elif isinstance(c, (cmd.Done, cmd.Reject)) and self.ledger.holds_lease(c.action_id):
                self.ledger.lease_end(c.action_id)
            elif isinstance(c, (cmd.Spawn, cmd.Invoke)):
                a = self.registry.actions.get(c.action_id)
                if a is not None:
                    self.ledger.ran(a.ident, a.request_id, a.kind, c.node, c.action_id)

    def _granted(self, c: cmd.Grant) -> None:
        a = self.registry.actions.get(c.action_id)
        wall, now = self.ledger.wall(), self.clock.now()
        if a is not None:
            expires = wall + max(0.0, a.deadline - now)
            lf = LeaseFact(c.action_id, c.api, a.units, a.ident, a.request_id, expires, c.key)
            self.ledger.lease(lf, self._charge(c.api, c.action_id, wall) if c.key else None)
        api = self.core.basic.apis.get(c.api)
        if api is not None and api.window_start is not None:
            self.ledger.quota(c.api, api.used, wall - (self.core.now - api.window_start))

    def _charge(self, api_name: str, lease: str, wall: float) -> ChargeFact | None:
        """The core's charge of a lease against its key (None: none in the key's minute)."""
        api = self.core.basic.apis.get(api_name)
        held = api.keys.held(lease) if api is not None else None
        if held is None or not held[1].live:
            return None
        key, c = held
        return ChargeFact(api_name, key.spec.name, wall - (self.core.now - c.at), c.units, c.tokens)

    def _reported(self, lease: str) -> None:
        """A holder's report changed its key's charge or cool-down in the core: write them."""
        for name in sorted(self.core.basic.apis):
            api = self.core.basic.apis[name]
            if (held := api.keys.held(lease)) is not None:
                key, c = held
                self.ledger.charged(lease, c.tokens)
                left = key.cool_until - self.core.now
                if left > 0:
                    self.ledger.cooled(name, key.spec.name, self.ledger.wall() + left)
                return

    # ------------------------------------------------------------ adoption
    def on_hello(self, node: str, listed: set[str]) -> None:
        """An agent said Hello listing ``listed``: adopt the waiting sandboxes it holds, lose the
        ones it should hold and does not."""
        for name, rec in list(self.registry.sandboxes.items()):
            if rec.restoring and rec.node == node:
                self._settle(rec, adopted=name in listed)
        if node in self.waiting_nodes:
            self.waiting_nodes.discard(node)
            if not self.waiting_nodes:
                self._release()

    def hold(self, item: Held) -> bool:
        """Whether to hold a request until the nodes are back: execs, calls, reserving opens."""
        msg = item[2]
        if not self.waiting_nodes or not isinstance(
            msg, (protocol.Exec, protocol.Call, protocol.SandboxOpen)
        ):
            return False
        if isinstance(msg, protocol.SandboxOpen) and msg.reserve <= 0:
            return False
        self.held.append(item)
        return True

    def _release(self) -> None:
        self.gateway.hold = None
        held, self.held = self.held, []
        if held:
            log.info("the nodes are back: handling %d held requests", len(held))
        self.gateway.handle_held(held)

    def on_cleared(self, node: str) -> None:
        """``node``'s agent stopped every action its Hello listed: what ran there before the
        restart can be answered now, with nothing of it left running."""
        for key in self.ran_on.pop(node, []):
            self._answer_ran(key)

    def _answer_ran(self, key: tuple[bytes, int]) -> None:
        self.gateway.final(key[0], key[1], protocol.Error("NODE_LOST", RAN_TEXT, True))

    def expire(self) -> None:
        """After the grace: the sandboxes no agent adopted are lost, and what ran on a node that
        did not come back is answered."""
        if not self.restoring_until or self.clock.now() < self.restoring_until:
            return
        self.restoring_until = 0.0
        for node in sorted(self.waiting_nodes):
            log.warning("node %s did not come back after the restart", node)
            self.ledger.node(node, False)
        self.waiting_nodes.clear()
        self._release()
        for node in list(self.ran_on):
            self.on_cleared(node)
        for rec in list(self.registry.sandboxes.values()):
            if rec.restoring:
                self._settle(rec, adopted=False)

    def _settle(self, rec: SandboxRecord, adopted: bool) -> None:
        rec.restoring = False
        if adopted:
            self.counters["adopted_sandboxes"] += 1
            log.info("sandbox %s adopted on %s", rec.sandbox, rec.node)
            self.post(ev.SandboxAdopted(rec.sandbox, rec.node))
        else:
            self.counters["unadopted_sandboxes"] += 1
            log.warning("sandbox %s was on %s, which no longer holds it: lost", rec.sandbox, rec.node)
            rec.lost = True
            self.post(ev.SandboxClosed(rec.sandbox))
        self.gateway.resume(rec.sandbox)


def key_events(r: Restored, live: set[str], wall: float) -> Iterator[ev.KeyUsed]:
    """One `KeyUsed` per key with charges in its last minute or a cool-down left: ages and the
    cool-down's rest relative to ``wall`` (the core knows no wall clock); a charge of a lease in
    ``live`` (granted again right after) names that lease."""
    charges: dict[tuple[str, str], list[tuple[float, int, int, str]]] = {}
    for action, c in r.charges.items():
        row = (max(0.0, wall - c.t), c.units, c.tokens, action if action in live else "")
        charges.setdefault((c.api, c.key), []).append(row)
    for api, key in sorted(set(charges) | set(r.cools)):
        cool = max(0.0, r.cools.get((api, key), 0.0) - wall)
        yield ev.KeyUsed(api, key, tuple(charges.get((api, key), [])), cool)
