"""`python -m tangram_cli.bench.chaos_load`: one load client of `tangram bench chaos`.

It uses the real client library (`tangram.AsyncClient`) and keeps a steady load of mixed
actions going across faults (reconnecting is the library's job). Commands on stdin, one per
line, answers on stdout:

- `go PHASE`: start `--lanes` lanes, each with its own sandbox, each looping over the mix below
  with a short think time; prints `going`.
- `long SECONDS [setsid]`: one non-idempotent CPU burner of SECONDS in a sandbox of its own
  (with `setsid`, the burner leaves the action's process group, as a daemon would).
- `drain SECONDS [LATE]`: stop submitting, wait up to SECONDS for the actions in flight; those
  still unanswered then are *late*, and get up to LATE seconds more (at least their timeout, by
  which the controller owes them a final reply); those unanswered after that are cancelled and
  counted lost. Then read the evidence files, close the sandboxes, print one JSON report.
- `quit`: print one JSON line (final replies that came after a phase's report), close, exit.

The mix: `true` and `echo TOKEN` (idempotent, output checked), `sleep 0.5..2` (idempotent),
`evidence` (NOT idempotent: appends its token to `.chaos-evidence` in the sandbox, then sleeps
0.5 s, so the file says how many times each one ran), GPU calls to the emulated `reward`
service, and API leases on `search`. Every command carries `TANGRAM_CHAOS=RUN/CLIENT/TOKEN` in
its environment, so the bench can find its processes in /proc. Each finished action appends
`TOKEN TIME OUTCOME` to `--done FILE` (the bench reads it to tell leftover processes and to
time recoveries). Final replies are counted per request id on the wire (`FinalCounter`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import tangram
from tangram.errors import ErrorCode, TangramError
from tangram_cli.bench.burst import FinalCounter

MARKER = "TANGRAM_CHAOS"
EVIDENCE = ".chaos-evidence"
MIX = {"true": 25, "echo": 15, "sleep": 15, "evidence": 25, "gpu": 10, "api": 10}
IDEMPOTENT = {"true", "echo", "sleep", "gpu", "api"}
EVIDENT = {"evidence", "long"}  # leave one line per run in the sandbox's evidence file
# the lane opens a new sandbox (a new trajectory)
SANDBOX_GONE = {ErrorCode.SANDBOX_LOST.value, ErrorCode.BAD_REQUEST.value}
_CURRENT: contextvars.ContextVar[Op | None] = contextvars.ContextVar("chaos_op", default=None)


def burner(seconds: float, escape: bool = False) -> str:
    """A shell loop that keeps one core busy for about `seconds` (checks the clock every ~0.1 s).
    With `escape`, the loop runs in a session of its own (`setsid -w`, which waits for it): a kill
    of the action's process group does not reach it; only its cgroup (or a pid scan) can."""
    loop = (
        f"t=$(($(date +%s)+{max(1, round(seconds))})); while [ $(date +%s) -lt $t ]; do "
        "i=0; while [ $i -lt 50000 ]; do i=$((i+1)); done; done"
    )
    return f"setsid -w sh -c '{loop}'" if escape else loop


@dataclass
class Op:
    tok: str
    kind: str
    sandbox: str = ""
    t0: float = field(default_factory=time.time)
    t1: float | None = None
    outcome: str | None = None  # "ok", an error code, or None: no outcome (lost)
    rids: list[int] = field(default_factory=list)


@dataclass
class Lane:
    sandbox: Any = None
    used: list[tuple[Any, bool]] = field(default_factory=list)  # (sandbox, lost) for the evidence


class Load:
    def __init__(self, tg: Any, name: str, run: str, lanes: int, timeout: float, done: str) -> None:
        self.tg, self.name, self.run, self.timeout = tg, name, run, timeout
        self.nlanes = lanes
        self.counter = FinalCounter(tg._transport)
        self._wrap_request(tg._transport)
        self.done = open(done, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.phase = ""
        self.seq = 0
        self.ops: list[Op] = []
        self.lanes: list[Lane] = []
        self.long_lane = Lane()
        self.tasks: list[asyncio.Task[None]] = []
        self.stopping = False
        self.reported: dict[int, tuple[str, int]] = {}  # rid -> (phase, finals at the report)
        self.said: dict[int, list[str]] = {}  # rid -> the final replies it got (Result, Error:CODE)

    def _wrap_request(self, transport: Any) -> None:
        """Note every request id an action sends (retries under new ids included) on its Op."""
        request = transport.request

        def noted(*args: Any, **kwargs: Any) -> Any:
            pending = request(*args, **kwargs)
            op = _CURRENT.get()
            if op is not None:
                op.rids.append(pending.request_id)
            return pending

        transport.request = noted
        on_envelope = transport._on_envelope

        def described(env: Any) -> None:  # what each final said, for the report
            before = sum(self.counter.finals.values())
            on_envelope(env)
            if sum(self.counter.finals.values()) > before:
                self._note_final(env)

        transport._on_envelope = described

    def _note_final(self, env: Any) -> None:
        code = getattr(env.msg, "code", None)
        text = type(env.msg).__name__ + (f":{getattr(code, 'value', code)}" if code is not None else "")
        self.said.setdefault(env.request_id, []).append(text)

    # ------------------------------------------------------------ one action
    def _new_op(self, kind: str, sandbox: str = "") -> Op:
        self.seq += 1
        op = Op(f"{self.phase}-{self.seq}-{kind}", kind, sandbox)
        self.ops.append(op)
        return op

    async def _run(self, op: Op, body: Any) -> Any:
        token = _CURRENT.set(op)
        value = None
        try:
            value = await body
            op.outcome = op.outcome or "ok"
        except TangramError as exc:
            op.outcome = _code(exc)
        finally:
            _CURRENT.reset(token)
            op.t1 = time.time()
            self.done.write(f"{op.tok}\t{op.t1:.3f}\t{op.outcome or 'none'}\n")
            self.done.flush()
        return value

    async def _exec(self, op: Op, sb: Any, cmd: str, expect: str | None = None) -> None:
        env = {MARKER: f"{self.run}/{self.name}/{op.tok}"}
        idem = op.kind in IDEMPOTENT
        r = await sb.exec(cmd, env=env, timeout=self.timeout, idempotent=idem)
        if r.exit_code != 0:
            op.outcome = f"exit{r.exit_code}"
        elif expect is not None and r.stdout.strip() != expect:
            op.outcome = "WrongOutput"

    async def _api(self) -> None:
        async with self.tg.api("search", timeout=self.timeout):
            await asyncio.sleep(0.05)

    def _body(self, op: Op, sb: Any, rng: random.Random) -> Any:
        if op.kind == "gpu":
            return self.tg.call("reward", {"response": op.tok, "reference": op.tok}, timeout=self.timeout)
        if op.kind == "api":
            return self._api()
        cmd = {
            "true": "true",
            "echo": f"echo {op.tok}",
            "sleep": f"sleep {rng.choice(('0.5', '1', '1.5', '2'))}",
            "evidence": f"echo {op.tok} >> {EVIDENCE}; sleep 0.5",
        }[op.kind]
        return self._exec(op, sb, cmd, expect=op.tok if op.kind == "echo" else None)

    async def _open(self, lane: Lane) -> None:
        op = self._new_op("open")
        sb = await self._run(op, self.tg.open_sandbox(mem="64MiB"))
        if sb is not None:
            lane.sandbox = sb
            lane.used.append((sb, False))

    def _lost(self, lane: Lane, op: Op) -> None:
        if op.outcome in SANDBOX_GONE and op.sandbox and lane.sandbox is not None:
            lane.used = [(s, lost or s is lane.sandbox) for s, lost in lane.used]
            lane.sandbox = None

    # ------------------------------------------------------------ lanes
    async def _lane(self, k: int) -> None:
        lane = self.lanes[k]
        rng = random.Random(f"{self.name}/{self.phase}/{k}")
        kinds, weights = list(MIX), list(MIX.values())
        while not self.stopping:
            if lane.sandbox is None:
                await self._open(lane)
                if lane.sandbox is None:
                    await asyncio.sleep(0.3)
                continue
            kind = rng.choices(kinds, weights)[0]
            op = self._new_op(kind, "" if kind in ("gpu", "api") else lane.sandbox.id)
            await self._run(op, self._body(op, lane.sandbox, rng))
            self._lost(lane, op)
            await asyncio.sleep(rng.uniform(0.05, 0.2) if op.outcome == "ok" else 0.3)

    async def _long(self, seconds: float, escape: bool) -> None:
        lane = self.long_lane
        if lane.sandbox is None:
            await self._open(lane)
        if lane.sandbox is None:
            return
        op = self._new_op("long", lane.sandbox.id)
        await self._run(
            op, self._exec(op, lane.sandbox, f"echo {op.tok} >> {EVIDENCE}; {burner(seconds, escape)}")
        )
        self._lost(lane, op)

    def go(self, phase: str) -> None:
        self.phase, self.stopping, self.ops, self.tasks = phase, False, [], []
        self.lanes = [Lane() for _ in range(self.nlanes)]
        self.long_lane = Lane()
        self.tasks = [asyncio.ensure_future(self._lane(k)) for k in range(self.nlanes)]

    def long(self, seconds: float, escape: bool) -> None:
        self.tasks.append(asyncio.ensure_future(self._long(seconds, escape)))

    # ------------------------------------------------------------ the phase's report
    async def drain(self, wait_s: float, late_s: float = 0.0) -> dict[str, Any]:
        self.stopping = True
        t0 = time.monotonic()
        crashed: list[str] = []
        late: list[Op] = []
        if self.tasks:
            done, pending = await asyncio.wait(self.tasks, timeout=wait_s)
            late = [op for op in self.ops if op.t1 is None]
            if pending and late_s > 0:
                more, pending = await asyncio.wait(pending, timeout=late_s)
                done |= more
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            crashed = [repr(t.exception())[:200] for t in done if not t.cancelled() and t.exception()]
        evidence = await self._evidence()
        await self._close_all()
        report = self._report(evidence)
        report["lane_errors"] = crashed
        report["slow"] = [f"{_desc(op)} after {op.t1 - op.t0:.1f} s" for op in late if op.outcome is not None]
        report["drain_s"] = round(time.monotonic() - t0, 3)
        return report

    async def _evidence(self) -> dict[str, Any]:
        """Token counts from every sandbox of the phase that is not lost ({} per unreadable one)."""
        counts: Counter[str] = Counter()
        readable: set[str] = set()
        unreadable: Counter[str] = Counter()  # error code -> sandboxes with evidence that could not be read
        must = {op.sandbox for op in self.ops if op.kind in EVIDENT and op.outcome == "ok"}
        for lane in [*self.lanes, self.long_lane]:
            for sb, lost in lane.used:
                if lost:
                    continue
                try:
                    data = await asyncio.wait_for(sb.get(EVIDENCE, timeout=5), 8)
                except (TangramError, TimeoutError) as exc:
                    if sb.id in must:  # else no evidence action may have run there: no file
                        unreadable[_code(exc)] += 1
                    continue
                readable.add(sb.id)
                counts.update(data.decode("utf-8", "replace").split())
        return {"counts": counts, "readable": readable, "unreadable": dict(unreadable)}

    async def _close_all(self) -> None:
        for lane in [*self.lanes, self.long_lane]:
            for sb, _ in lane.used:
                with contextlib.suppress(TangramError, TimeoutError):
                    await asyncio.wait_for(sb.close(), 5)

    def _report(self, evidence: dict[str, Any]) -> dict[str, Any]:
        finals = self.counter.finals
        ops = self.ops
        answered = [op for op in ops if op.outcome is not None]
        no_reply = [op for op in answered if op.rids and not any(finals.get(r, 0) for r in op.rids)]
        gave_up = [op for op in no_reply if op.outcome == ErrorCode.TIMEOUT.value]  # the library gave up
        dups = self.counter.duplicates
        dup_rids = [r for op in ops for r in op.rids if dups(r)]
        dup_ops = [
            f"{_desc(op)}: {[self.said.get(r) for r in op.rids]}" for op in ops if any(map(dups, op.rids))
        ]
        replay_ops = [
            f"{_desc(op)}: {[self.said.get(r) for r in op.rids]}"
            for op in ops
            if any(self.counter.replays.get(r) for r in op.rids)
        ]
        for op in ops:
            for r in op.rids:
                self.reported[r] = (self.phase, finals.get(r, 0))
        counts, readable = evidence["counts"], evidence["readable"]
        evident = [op for op in ops if op.kind in EVIDENT and op.sandbox in readable]
        return {
            "name": self.name,
            "phase": self.phase,
            "requests": len(ops),
            "ok": sum(op.outcome == "ok" for op in ops),
            "by_kind": dict(Counter(op.kind for op in ops)),
            "errors": dict(Counter(op.outcome for op in answered if op.outcome != "ok")),
            "unanswered": [_desc(op) for op in ops if op.outcome is None],
            "gave_up": [_desc(op) for op in gave_up],
            "local_outcomes": dict(Counter(op.outcome for op in no_reply)),
            "duplicate_finals": len(dup_rids),
            "duplicate_final_ops": dup_ops[:10],
            "replayed_finals": sum(self.counter.replays.get(r, 0) for op in ops for r in op.rids),
            "replayed_final_ops": replay_ops[:10],
            "evidence": {
                "checked": len(evident),
                "ran_twice_or_more": sorted(t for t, n in counts.items() if n > 1),
                "ran_but_failed": sum(op.outcome != "ok" and counts.get(op.tok, 0) > 0 for op in evident),
                "ok_without_evidence": sum(
                    op.outcome == "ok" and counts.get(op.tok, 0) == 0 for op in evident
                ),
                "unreadable_sandboxes": sum(evidence["unreadable"].values()),
                "unreadable_by_code": evidence["unreadable"],
            },
            "resent": getattr(self.tg._transport, "resent", 0),
            "stray_replies": getattr(self.tg._transport, "stray_replies", 0),
        }

    def late(self) -> dict[str, Any]:
        """Final replies that came for a request after its phase was reported, per phase."""
        late: Counter[str] = Counter()
        for rid, (phase, n) in self.reported.items():
            if self.counter.finals.get(rid, 0) > max(n, 1) and self.counter.duplicates(rid):
                late[phase] += 1
        return {"name": self.name, "late_duplicate_finals": dict(late)}

    def close(self) -> None:
        self.done.close()


def _code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return str(code.value if code is not None else type(exc).__name__)


def _desc(op: Op) -> str:
    ended = f", ended {op.t1:.3f}" if op.t1 is not None else ""
    return f"{op.tok} ({op.outcome or 'no outcome'}, started {op.t0:.3f}{ended}, {len(op.rids)} request ids)"


async def _serve(ns: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    async with tangram.AsyncClient(ns.addr, name=ns.name, connect_timeout=60) as tg:
        load = Load(tg, ns.name, ns.run, ns.lanes, ns.timeout, ns.done)
        print("ready", flush=True)
        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                cmd, _, arg = line.strip().partition(" ")
                if cmd == "go":
                    load.go(arg)
                    print("going", flush=True)
                elif cmd == "long":
                    seconds, _, how = arg.partition(" ")
                    load.long(float(seconds), how == "setsid")
                elif cmd == "drain":
                    wait, _, late = arg.partition(" ")
                    print(json.dumps(await load.drain(float(wait), float(late or 0))), flush=True)
                elif cmd in ("quit", ""):
                    print(json.dumps(load.late()), flush=True)
                    return
        finally:
            load.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tangram_cli.bench.chaos_load", description=__doc__)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--run", required=True, help="the run id in every command's TANGRAM_CHAOS")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="each action's timeout (s)")
    ap.add_argument("--done", required=True, help="append `TOKEN TIME OUTCOME` per finished action")
    asyncio.run(_serve(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
