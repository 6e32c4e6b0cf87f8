"""The API pass of the scheduler: FCFS grants per API, with key pools (the basic manager
of docs/scheduler.md; key pools: its "API key pools").

Plain functions over the ``Scheduler`` (its ``basic`` manager, queues, running table and
deadlines), called from ``Scheduler._schedule`` (``run``), ``Scheduler.next_deadline``
(``deadlines``) and the ``ApiReported`` handler (``report``). Rules:

1. Each API's queue is FCFS: its head gets a ``Grant`` while the API-wide limit allows and,
   for an API with keys, a key has room for the lease's requests and tokens
   (``managers/keys.py``); the ``Grant`` names the key. Otherwise the head waits, with the
   shortfall as its status, and nothing behind it overtakes it. With several RL jobs the
   head is that of the job furthest below its weighted share of the API (``jobs.py``).
2. A waiting head makes a deadline: the next quota window, or the first time a key's
   sliding minute (or cool-down) leaves room for it.
3. A lease whose requests or tokens exceed what any key allows in a minute can never be
   granted: ``never_fits`` says so at admission (NO_CAPACITY).
4. After a controller restart, ``KeyUsed`` puts a key's minute and cool-down back
   (``on_key_used``; unknown APIs and keys are ignored: the config may have changed), and a
   lease restored with ``api_key`` is granted again on the key it held, whatever that key's
   room: its holder is already using it (``managers/keys.py`` rule 6).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core import jobs
from tangram.core.managers.basic import Api
from tangram.core.state import Running, Waiting
from tangram.core.status import Shortfall, Status, never, wait

if TYPE_CHECKING:
    from tangram.core.actions import ActionSpec
    from tangram.core.scheduler import Scheduler


def pool_of(api: str) -> str:
    return "api:" + api


def run(s: Scheduler, pool: str, out: list[cmd.Command]) -> None:
    """Grant the head of one API's queue while the API and its keys allow (rule 1)."""
    api = s.basic.apis[pool[len("api:") :]]
    fair, lane = jobs.ordered(s.jobs, s.pending.lanes(pool), pool)  # one job: its FCFS lane
    while (w := lane.head()) is not None:
        s.examined[pool] = s.examined.get(pool, 0) + 1
        units, tokens = w.spec.key_demand.min, w.spec.tokens
        if fair.over_cap(w, units):  # its job waits at its cap; the next job's head is looked at
            continue
        free = api.free(s.now)
        if free < units:
            w.status = wait(Shortfall(pool, units, free, api.limit, api.name))
            return
        bound = api.keys.named(w.spec.api_key) if w.spec.api_key else None  # rule 4
        key = bound or (api.keys.pick(s.now, units, tokens) if api.keys else None)
        if api.keys and key is None:
            w.status = _no_key(api, pool, units, tokens, s.now)
            return
        s.pending.remove(w.spec.action_id)
        _grant(s, api, w, "" if key is None else key.spec.name, out)
        if key is not None:
            api.keys.take(key, w.spec.action_id, units, tokens, s.now, restored=bound is not None)


def _grant(s: Scheduler, api: Api, w: Waiting, key: str, out: list[cmd.Command]) -> None:
    aid, units = w.spec.action_id, w.spec.key_demand.min
    api.take(aid, units, s.now)
    expires = s.now + (w.spec.timeout_s or s.config.lease_ttl_s)
    s.running[aid] = Running(w.spec, api.name, units, s.now, expires, deadline=expires)
    s._seq += 1
    heapq.heappush(s._deadlines, (expires, s._seq, aid))
    out.append(cmd.Grant(aid, api.name, expires, key))


def _no_key(api: Api, pool: str, units: int, tokens: int, now: float) -> Status:
    """Why no key takes the head: the key closest to room, as a shortfall."""
    keys = api.keys.keys
    if all(k.cool_until > now for k in keys):
        return wait(message=f"every key of {api.name} is cooling down after a rate-limit answer")
    k = min((k for k in keys if k.cool_until <= now), key=lambda k: k.used())
    spec = k.spec
    if spec.tpm > 0 and k.tokens + tokens > spec.tpm:
        return wait(
            Shortfall(pool + ":tokens", tokens, max(0, spec.tpm - k.tokens), spec.tpm, f"key {spec.name}")
        )
    if spec.rpm > 0 and k.requests + units > spec.rpm:
        return wait(
            Shortfall(pool + ":requests", units, max(0, spec.rpm - k.requests), spec.rpm, f"key {spec.name}")
        )
    cap = spec.concurrency
    return wait(Shortfall(pool + ":in_flight", 1, max(0, cap - len(k.in_flight)), cap, f"key {spec.name}"))


def deadlines(s: Scheduler) -> list[float]:
    """Rule 2: for each API whose queue waits, when it may grant again."""
    times: list[float] = []
    for name, api in s.basic.apis.items():
        lanes = s.pending.lanes(pool_of(name)) if s.queues.get(pool_of(name)) else None
        head = jobs.ordered(s.jobs, lanes, pool_of(name))[1].head() if lanes else None
        if head is None:
            continue
        if (t := api.next_window()) is not None:
            times.append(t)
        if api.keys:
            t = api.keys.next_room(s.now, head.spec.key_demand.min, head.spec.tokens)
            if s.now < t < math.inf:
                times.append(t)
    return times


def report(s: Scheduler, aid: str, tokens: int, limited: bool, reset_s: float) -> None:
    """The holder's report of a lease granted a key (``ApiReported``; it may come just after
    the release): the key's window and cool-down change, and the API's queue is decided again."""
    for name in sorted(s.basic.apis):
        api = s.basic.apis[name]
        if api.keys and api.keys.knows(aid):
            api.keys.report(aid, tokens if tokens >= 0 else None, limited, reset_s, s.now)
            s._dirty.add(pool_of(name))
            return


def on_key_used(s: Scheduler, e: ev.KeyUsed, out: list[cmd.Command]) -> None:
    """Rule 4: a key's minute and cool-down from before a controller restart."""
    api = s.basic.apis.get(e.api)
    if api is not None and api.keys.restore(e.key, e.charges, e.cool_left_s, s.now):
        s._dirty.add(pool_of(e.api))


def never_fits(s: Scheduler, spec: ActionSpec) -> Status | None:
    """Rule 3: NO_CAPACITY status if no key (or the API-wide limit) could ever grant it."""
    api = s.basic.apis[spec.api]
    units = spec.key_demand.min
    if (api.limit > 0 or not api.keys) and units > api.limit:
        return never(
            Shortfall(spec.key, units, api.limit, api.limit, spec.api), message="above the API limit"
        )
    cap = api.keys.max_tokens() if api.keys else None
    if cap is not None and spec.tokens > cap:
        short = Shortfall(spec.key + ":tokens", spec.tokens, cap, cap, spec.api)
        return never(short, message="above every key's tokens per minute")
    cap = api.keys.max_units() if api.keys else None
    if cap is not None and units > cap:
        return never(
            Shortfall(spec.key, units, cap, cap, spec.api), message="above every key's requests per minute"
        )
    return None
