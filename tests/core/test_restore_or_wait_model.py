"""The restore-or-wait cost model of ``gpu_pass._wait_for_resident``, checked against its
docstring on random GPU states (the mutation run of docs/testing.md found the scenario tests
of test_gpu_restore_cost.py pin its outcomes, not its arithmetic).

A call whose service is resident only on busy chunks waits for the first of them to free
(after the calls already waiting for it in this pass) when that comes sooner than the cost of
a restore on the free chunk ``pl``:

    cost = load * (1 + queued / G)      queued = max(0, window - (free - pl.size))
         + for each evicted instance a call in the window wants and no other free chunk holds:
               min(its next busy copy's wait, load + own estimate + its own restore)
"""

from __future__ import annotations

import random

import pytest
from sched_util import call_spec, node

from tangram.core import events as ev
from tangram.core import gpu_pass
from tangram.core.managers.gpu import Placement
from tangram.core.scheduler import CoreConfig, Scheduler
from tangram.core.state import Waiting

SERVICES = ("rm", "v1", "v2")


def _state(rng: random.Random) -> tuple[Scheduler, dict[str, int]]:
    """1-2 nodes of 2 or 4 GPUs; calls of the three services running on some GPUs (their
    ends at whole seconds, so that a wait can equal a cost exactly); a busy mask for the pass."""
    s = Scheduler(CoreConfig(prewake=False))  # the model as it stands without pre-wake (prewake.py)
    for i in range(rng.randint(1, 2)):
        s.handle(node(f"n{i}", 1, gpus=rng.choice((2, 4)), gpu_mem=80_000), 0.0)
    for name in SERVICES:
        per_size = ((2, 1_000, float(rng.randint(1, 3))),) if rng.random() < 0.5 else ()
        s.handle(
            ev.ServiceDefined(
                name,
                1_000,
                (1, 2),
                load_s=float(rng.randint(0, 3)),
                t_ori=float(rng.randint(1, 6)),
                per_size=per_size,
            ),
            0.0,
        )
    for k in range(rng.randint(0, 4)):
        size = rng.choice((1, 1, 2))
        s.handle(
            ev.ActionSubmitted(call_spec(f"r{k}", rng.choice(SERVICES), (size,))), float(rng.randint(0, 2))
        )
    busy = {
        name: gn.busy | (rng.getrandbits(gn.count) & rng.getrandbits(gn.count))
        for name, gn in s.gpu.nodes.items()
    }
    return s, busy


def _reference(
    s: Scheduler, w: Waiting, size: int, pl: Placement, window: gpu_pass._Window, busy: dict[str, int]
) -> tuple[bool, list[float]]:
    ctx, now = s._ctx, s.now

    def frees(service: str, z: int) -> list[float]:
        return sorted(r.est_end for r in s.running.values() if r.spec.service == service and r.chunk[1] == z)

    mine_frees = frees(w.spec.service, size)
    if not mine_frees:
        return False, mine_frees
    load = s.gpu.services[w.spec.service].load(size)
    mine = ctx.estimate(w.spec, size)
    gpus = sum(gn.count for gn in s.gpu.nodes.values())
    free = sum(gn.count - busy[name].bit_count() for name, gn in s.gpu.nodes.items())
    cost = load * (1.0 + max(0, window.total - (free - pl.size)) / gpus)
    for victim in pl.evict:
        service, _, vsize = victim
        if (service, vsize) not in window.count or gpu_pass._free_copy(ctx, victim, pl.node, busy):
            continue
        later = load + mine + s.gpu.services[service].load(vsize)
        vf = frees(service, vsize)
        cost += min(vf[0] - now, later) if vf else later
    if mine_frees[0] - now >= cost:
        return False, mine_frees
    return True, sorted([mine_frees[0] + mine, *mine_frees[1:]])


@pytest.mark.parametrize("seed", range(300))
def test_the_restore_or_wait_choice_follows_its_cost_model(seed):
    rng = random.Random(seed)
    s, busy = _state(rng)
    name = rng.choice(sorted(s.gpu.nodes))
    gn = s.gpu.nodes[name]
    size = rng.choice((1, 2)) if gn.count >= 2 else 1
    start = rng.randrange(0, gn.count, size)
    victims = []
    for service in ("v1", "v2", "rm"):
        if rng.random() < 0.6:  # resident instances on the chunk (restored earlier), maybe copies elsewhere
            vsize = rng.choice((1, 2)) if size == 2 else 1
            victims.append((service, start, vsize))
            other = (start + size) % gn.count
            if rng.random() < 0.5 and other % vsize == 0 and other + vsize <= gn.count:
                gn.add_resident((service, other, vsize), 10, 0.0)
    spec = call_spec("w", "rm", (size,), serial=rng.choice((None, 0.2)))
    queue = [Waiting(spec, 0, 0.0, None)]
    queue += [
        Waiting(call_spec(f"q{i}", rng.choice(SERVICES), (rng.choice((1, 2)),)), i + 1, 0.0, None)
        for i in range(rng.randint(0, 6))
    ]
    window = gpu_pass._Window(queue, rng.randint(1, 6))
    window.advance(0)
    s.now = float(rng.randint(0, 3))
    pl = Placement(name, start, size, tuple(victims), False)
    want_wait, want_frees = _reference(s, queue[0], size, pl, window, busy)
    soon: gpu_pass.Soon = {}
    assert gpu_pass._wait_for_resident(s._ctx, queue[0], size, pl, window, soon, busy) is want_wait
    assert sorted(soon.get(("rm", size), [])) == want_frees
