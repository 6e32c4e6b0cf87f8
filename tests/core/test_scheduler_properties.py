"""Random event sequences: no over-commit, everyone starts or is rejected, seeds replay."""
from __future__ import annotations

from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_util import Ledger, call_spec, exec_spec, lease_spec, node

from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.core.scheduler import CoreConfig, Scheduler


def run_trace(seed: int, policy: str = "tangram", steps: int = 120) -> tuple[list[str], Ledger, set[str]]:
    rng = Random(seed)
    sched = Scheduler(CoreConfig(policy=policy, fixed_dop=2), seed=seed)
    led = Ledger(sched)
    log: list[str] = []
    now = 0.0

    def feed(event: ev.Event) -> None:
        out = sched.handle(event, now)
        log.append(f"{now:.3f} {event!r} -> {out!r}")
        led.apply(out)
        if len(log) % 7 == 0:  # status with a limit: the FCFS head of the full view, the same count
            full, head = sched.snapshot(), sched.snapshot(limit=3)
            assert head.queue == full.queue[:3] and head.queued == full.queued == len(full.queue)

    for i in range(rng.randint(1, 3)):
        feed(node(f"n{i}", rng.choice([1, 2, 4, 8]), mem=rng.choice([2000, 8000]), gpus=rng.choice([0, 2, 4, 8]),
                  gpu_mem=40_000, numa=rng.choice([1, 2])))
    feed(ev.ServiceDefined("rm", 30_000, (1, 2, 4), load_s=0.5, t_ori=1.0))
    feed(ev.ServiceDefined("judge", 20_000, (1,), load_s=0.2, t_ori=0.5))
    feed(ev.ApiDefined("search", "concurrency", rng.randint(1, 3)))
    feed(ev.ApiDefined("pdf", "quota", rng.randint(1, 3), period_s=5.0))
    sandboxes: list[str] = []
    submitted: set[str] = set()
    for step in range(steps):
        now += rng.choice([0.0, 0.05, 0.5, 2.0])
        roll = rng.random()
        running = sorted(sched.running)
        if roll < 0.15 or not sandboxes:
            name = f"sb{step}"
            sandboxes.append(name)
            feed(ev.SandboxOpened(name, client="c", mem_mib=rng.choice([0, 100, 1000, 3000]),
                                  reserve=rng.choice([0, 0, 0, 1])))
        elif roll < 0.55:
            aid = f"a{step}"
            submitted.add(aid)
            kind = rng.random()
            if kind < 0.6:
                lo = rng.randint(1, 3)
                hi = lo + rng.choice([0, 0, 2, 6])
                feed(ev.ActionSubmitted(exec_spec(aid, rng.choice(sandboxes), lo, hi, t_ori=rng.choice([None, 2.0]),
                                                  serial=rng.choice([None, 0.1]), timeout_s=rng.choice([0, 0, 8]))))
            elif kind < 0.85:
                svc = rng.choice(["rm", "judge"])
                sizes = (1, 2, 4) if svc == "rm" and rng.random() < 0.5 else (1,)
                feed(ev.ActionSubmitted(call_spec(aid, svc, sizes, serial=0.1)))
            else:
                feed(ev.ActionSubmitted(lease_spec(aid, rng.choice(["search", "pdf"]), timeout_s=rng.choice([0, 6]))))
        elif roll < 0.85 and running:
            feed(ev.ActionFinished(rng.choice(running), ok=rng.random() < 0.9))
        elif roll < 0.9 and submitted:
            feed(ev.ActionCancelled(rng.choice(sorted(submitted))))
        elif roll < 0.93 and sandboxes:
            feed(ev.SandboxClosed(sandboxes.pop(rng.randrange(len(sandboxes)))))
        else:
            feed(ev.Tick())
    # drain: finish whatever runs, let quotas roll, until nothing is left
    for _ in range(2000):
        if not sched.running and not any(sched.queues.values()):
            break
        now += 1.0
        running = sorted(aid for aid, r in sched.running.items() if r.spec.kind.value != "open")
        if running:
            feed(ev.ActionFinished(running[0]))
        elif sched.running:  # only reservations left: close their sandboxes
            for sb in sorted({r.spec.sandbox for r in sched.running.values()}):
                feed(ev.SandboxClosed(sb))
        elif sched.queues.get("cpu") and sandboxes:
            feed(ev.SandboxClosed(sandboxes.pop(0)))  # trajectories end and free their memory
        else:
            feed(ev.Tick())
    return log, led, submitted


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["tangram", "min", "max", "fixed"]))
def test_random_traces_never_overcommit_and_everyone_is_answered(seed: int, policy: str) -> None:
    _, led, submitted = run_trace(seed, policy)  # Ledger.check asserts after every event
    for aid in submitted:
        assert aid in led.started or aid in led.rejected, f"{aid} was neither started nor rejected"
    assert not led.cores and not led.chunks and not led.leases


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10**6))
def test_same_seed_same_decisions(seed: int) -> None:
    assert run_trace(seed)[0] == run_trace(seed)[0]


def test_every_start_command_is_followed_by_exactly_one_done() -> None:
    log, led, _ = run_trace(7, steps=200)
    assert led.started <= led.done | set(led.rejected)
    assert isinstance(cmd.Done("x", True), cmd.Done)
