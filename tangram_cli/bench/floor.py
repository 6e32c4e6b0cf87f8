"""`tangram bench floor`: the floor of the process executor's layout, what `tangram bench dispatch`'s
throughput run would reach if every process on the path did almost nothing but pass the action on
(docs/performance.md, "Twelfth round"). `tangram bench dispatch --floor` runs it in the same run as its
own throughput and prints `ratio_to_floor`.

The same processes and hops as the throughput run: a client process holding one DEALER socket per
sandbox (`--clients`, each running its next no-op as soon as its reply comes), a controller process (two
ROUTER sockets on 127.0.0.1 TCP, msgpack frames, two starts per core: one running, one staged on the
agent), an agent process (a DEALER to the controller; three pipes per action, read after the exit), and
`/bin/sh -c true` pinned to the action's core. The logic is a deque and a dict in each. Variants:

- ``spawners``: one of the agent's real spawners per sandbox (``agent/executors/proc_spawner.py``, plain
  mode, as contained sandboxes have one each; they pin with ``sched_setaffinity`` and do not move between
  cgroups, which costs about 30 us per action more in Tangram, measured separately);
- ``direct``: no spawner: the agent ``posix_spawn``s itself with its thread pinned for the call and
  reaps through pidfds (what Tangram's agent does when it has no spawner).

Each round measures the dispatch bench's asyncio ``taskset -c N true`` baseline before and after the
variants and prints, per variant: the p50 latency of ``n / 4`` no-ops one after another from one sandbox
(the bench's latency figure), the throughput's actions/s, its ratio to the baseline's mean, and the CPU
per action of each process during the throughput (from ``/proc``). The child processes run this module
(``python -m tangram_cli.bench.floor ROLE ...``); loopback only.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import click
import msgpack
import zmq

from tangram_cli.bench.procs import pct, proc_cpu_s
from tangram_cli.bench.raw_spawn import cores_of, default_cpus, raw_spawn_asyncio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
ARGV = ["/bin/sh", "-c", "true"]
VARIANTS = ("spawners", "direct")


def controller(cores: list[int]) -> None:
    """Queue every request; hand the agent two per core; pass each result back to its client."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind("tcp://127.0.0.1:*")
    back.bind("tcp://127.0.0.1:*")
    print(json.dumps([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (front, back)]), flush=True)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    agent, slots, queue, who = None, [c for c in cores for _ in range(2)], collections.deque(), {}
    while True:
        ready = dict(poller.poll())
        for ident, body in _drain(front) if front in ready else ():
            req = msgpack.unpackb(body)
            who[req["id"]] = ident
            queue.append(req)
        for ident, body in _drain(back) if back in ready else ():
            agent = ident
            for res in msgpack.unpackb(body).get("results", ()):
                slots.append(res["core"])
                front.send_multipart([who.pop(res["id"]), msgpack.packb(res)])
        spawns = []
        while agent is not None and queue and slots:
            req = queue.popleft()
            req["core"] = slots.pop(0)
            spawns.append(req)
        if spawns:
            back.send_multipart([agent, msgpack.packb({"spawns": spawns})])


def _drain(sock: zmq.Socket) -> list[list[bytes]]:
    """Every message ready on ``sock``, each as its frames."""
    out = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out


class _Spawner:
    """One of the agent's real spawners (plain mode), over its SOCK_SEQPACKET protocol."""

    def __init__(self) -> None:
        from agent.executors.spawner import PROC_SCRIPT  # the agent's own; only the floor's agent needs it

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", PROC_SCRIPT, json.dumps({"mode": "plain"})],
                                     stdin=theirs, close_fds=True)
        theirs.close()
        if b"ready" not in self.sock.recv(4096):
            raise RuntimeError("the spawner did not start")
        self.sock.setblocking(False)

    def spawn(self, rid: int, core: int, fds: tuple[int, int, int]) -> None:
        req = {"op": "spawn", "id": rid, "argv": ARGV, "env": ENV, "cores": [core], "cwd": "/tmp"}
        socket.send_fds(self.sock, [json.dumps(req).encode()], list(fds))


class _Agent:
    """Run what the controller hands over, one action per core at a time, the next at the exit."""

    def __init__(self, endpoint: str, variant: str, cores: list[int], sandboxes: int) -> None:
        self.sock = zmq.Context().socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.spawners = [_Spawner() for _ in range(sandboxes)] if variant == "spawners" else []
        self.by_fd = {sp.sock.fileno(): sp for sp in self.spawners}
        for fd in self.by_fd:
            self.poller.register(fd, zmq.POLLIN)
        self.null = os.open(os.devnull, os.O_RDONLY)
        self.waiting: dict[int, collections.deque] = {c: collections.deque() for c in cores}
        self.busy: dict[int, dict] = {}
        self.jobs: dict[int, dict] = {}  # request id (spawners) or pidfd (direct) -> job
        self.cores = os.sched_getaffinity(0)
        print(json.dumps([sp.proc.pid for sp in self.spawners]), flush=True)
        self.sock.send(msgpack.packb({"hello": 1}))

    def start(self, core: int, req: dict) -> None:
        out_r, out_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        job = self.busy[core] = {"id": req["id"], "core": core, "pipes": (out_r, err_r)}
        if self.spawners:
            self.spawners[req["sandbox"]].spawn(req["id"], core, (self.null, out_w, err_w))
            self.jobs[req["id"]] = job
        else:
            os.sched_setaffinity(0, {core})  # the child inherits the calling thread's affinity
            try:
                stdio = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate((self.null, out_w, err_w))]
                job["pid"] = os.posix_spawn(ARGV[0], ARGV, ENV, setsid=True, file_actions=stdio)
            finally:
                os.sched_setaffinity(0, self.cores)
            pidfd = os.pidfd_open(job["pid"])
            self.jobs[pidfd] = job
            self.poller.register(pidfd, zmq.POLLIN)
        os.close(out_w)
        os.close(err_w)

    def finish(self, job: dict, code: int, results: list) -> None:
        output = b""
        for fd in job["pipes"]:
            try:
                output += os.read(fd, 1 << 16)
            except BlockingIOError:
                pass
            os.close(fd)
        del self.busy[job["core"]]
        results.append({"id": job["id"], "core": job["core"], "exit": code, "output": output})
        if self.waiting[job["core"]]:
            self.start(job["core"], self.waiting[job["core"]].popleft())

    def serve(self) -> None:
        while True:
            results: list = []
            for fd, _ in self.poller.poll():
                if fd in self.by_fd:
                    for data in _recv_all(self.by_fd[fd].sock):
                        msg = json.loads(data)
                        self.finish(self.jobs.pop(msg["id"]), msg.get("exit", -1), results)  # -1: "error"
                elif fd in self.jobs:
                    job = self.jobs.pop(fd)
                    self.poller.unregister(fd)
                    os.close(fd)
                    self.finish(job, os.waitstatus_to_exitcode(os.waitpid(job["pid"], 0)[1]), results)
            for (body,) in _drain(self.sock):
                for req in msgpack.unpackb(body)["spawns"]:
                    if req["core"] in self.busy:
                        self.waiting[req["core"]].append(req)
                    else:
                        self.start(req["core"], req)
            if results:
                self.sock.send(msgpack.packb({"results": results}))


def _recv_all(sock: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out


def clients(endpoint: str, n: int, sandboxes: int) -> None:
    """Sequential no-ops per sandbox; says "ready", waits for a line, measures the latency, prints it,
    waits for a line, runs the throughput, prints its wall and CPU time."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(sandboxes)]
    poller, index = zmq.Poller(), {s: k for k, s in enumerate(socks)}
    for s in socks:
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
    print("ready", flush=True)
    sys.stdin.readline()
    latency = []  # first one after another, one in flight: the dispatch bench's latency figure
    for i in range(max(1, n // 4)):
        t = time.perf_counter()
        socks[0].send(msgpack.packb({"id": i, "sandbox": 0, "cmd": "true"}))
        socks[0].recv()
        latency.append(time.perf_counter() - t)
    print(json.dumps({"p50_ms": (pct(latency, 0.5) or 0.0) * 1e3}), flush=True)
    sys.stdin.readline()
    t0, c0, sent, done = time.perf_counter(), time.process_time(), 0, 0

    def submit(k: int) -> None:
        nonlocal sent
        socks[k].send(msgpack.packb({"id": sent, "sandbox": k, "cmd": "true"}))
        sent += 1

    for k in range(min(sandboxes, n)):
        submit(k)
    while done < n:
        for s, _ in poller.poll():
            for _ in _drain(s):
                done += 1
                if sent < n:
                    submit(index[s])
    print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}), flush=True)
    sys.stdin.readline()


def _cpu_s(pid: int) -> float:
    """``proc_cpu_s`` of a process that must still run (every floor process does until the end)."""
    cpu = proc_cpu_s(pid)
    if cpu is None:
        raise RuntimeError(f"floor process {pid} ended early")
    return cpu


def run_variant(variant: str, n: int, sandboxes: int, cores: list[int],
                timeout_s: float = 300.0) -> dict[str, Any]:
    """One variant's run: start the three processes, time the clients' no-ops (latency, then throughput),
    read everyone's CPU. Every process is killed after ``timeout_s`` (a RuntimeError then)."""
    me = [sys.executable, "-m", "tangram_cli.bench.floor"]
    pipe: dict[str, Any] = {"stdout": subprocess.PIPE, "text": True, "cwd": ROOT}
    cpus = ",".join(map(str, cores))
    procs = [subprocess.Popen([*me, "_controller", cpus], stdin=subprocess.DEVNULL, **pipe)]
    watchdog = threading.Timer(timeout_s, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        ctl = procs[0]
        front, back = json.loads(_line(ctl))
        procs.append(subprocess.Popen([*me, "_agent", back, variant, cpus, str(sandboxes)],
                                      stdin=subprocess.DEVNULL, **pipe))
        agent = procs[-1]
        spawners = json.loads(_line(agent))
        procs.append(subprocess.Popen([*me, "_clients", front, str(n), str(sandboxes)], stdin=subprocess.PIPE,
                                      **pipe))
        cl = procs[-1]
        if _line(cl).strip() != "ready":
            raise RuntimeError("the floor's clients did not start")
        time.sleep(0.3)  # every DEALER connected
        _go(cl)
        p50 = json.loads(_line(cl))["p50_ms"]
        pids = {"controller": [ctl.pid], "agent": [agent.pid], "spawners": spawners}
        before = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
        _go(cl)
        done = json.loads(_line(cl))
        used = {k: sum(_cpu_s(p) for p in v) - before[k] for k, v in pids.items()}
    finally:
        watchdog.cancel()
        for p in procs:
            p.kill()
            p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
    used["clients"] = done["cpu_s"]
    row: dict[str, Any] = {"variant": variant, "n": n, "latency_p50_ms": p50}
    row["actions_per_s"] = n / done["wall_s"]
    row.update({f"{k}_cpu_ms_per_action": v / n * 1e3 for k, v in used.items()})
    row["floor_cpu_ms_per_action"] = sum(used.values()) / n * 1e3
    return row


def _line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise RuntimeError(f"a floor process ended early (exit {proc.poll()}), or ran past the timeout")
    return line


def _go(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


async def measure(n: int, variants: list[str], rounds: int, sandboxes: int,
                  cpus: str) -> list[dict[str, Any]]:
    """``rounds`` rounds of the variants, each round between two runs of the asyncio baseline."""
    cores = cores_of(cpus)

    async def raw() -> float:
        return float((await raw_spawn_asyncio(min(n, 2000), sandboxes, cpus))["actions_per_s"])

    rows = []
    for r in range(rounds):
        before = await raw()
        got = [await asyncio.to_thread(run_variant, v, n, sandboxes, cores) for v in variants]
        after = await raw()
        for row in got:
            row.update(round=r + 1, raw_before_actions_per_s=before, raw_after_actions_per_s=after,
                       ratio_to_raw_spawn=row["actions_per_s"] / ((before + after) / 2))
        rows.extend(got)
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        cpu = ", ".join(f"{k.split('_cpu')[0]} {v:.3f}" for k, v in row.items()
                        if k.endswith("_cpu_ms_per_action"))
        click.echo(f"round {row['round']} {row['variant']:>8}: p50 {row['latency_p50_ms']:.2f} ms, "
                   f"{row['actions_per_s']:6.0f} /s, "
                   f"{row['ratio_to_raw_spawn']:.2f}x raw (before {row['raw_before_actions_per_s']:.0f}, "
                   f"after {row['raw_after_actions_per_s']:.0f}); CPU ms per action: {cpu}")


@click.command("floor")
@click.option("-n", "n", type=click.IntRange(1, 1_000_000), default=4000, show_default=True,
              help="No-op actions per variant and round (the latency run takes a quarter as many).")
@click.option("--variant", "variants", type=click.Choice(VARIANTS), multiple=True,
              help="What starts the actions: one spawner per sandbox, or the agent itself (default: both).")
@click.option("--rounds", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Rounds, each between two runs of the raw baseline.")
@click.option("--clients", type=click.IntRange(1, 1024), default=16, show_default=True,
              help="Sandboxes, one client socket each (the dispatch bench's --clients).")
@click.option("--cpus", default=None, help="Cores the actions run on (default: 0-1, or 0 on one core).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def floor(n: int, variants: tuple[str, ...], rounds: int, clients: int, cpus: str | None,
          as_json: bool) -> None:
    """The process executor's layout with trivial logic in each process: what `bench dispatch` would
    reach if Tangram's own Python cost nothing, next to the same raw baseline."""
    cpus = cpus or default_cpus()
    try:
        missing = sorted(set(cores_of(cpus)) - os.sched_getaffinity(0))
    except ValueError:
        raise click.BadParameter(f"{cpus!r} is not a list of cores such as 0-1 or 0,2",
                                 param_hint="--cpus") from None
    if missing:
        raise click.BadParameter(f"cores {missing} are not this process's to use (it may use "
                                 f"{sorted(os.sched_getaffinity(0))})", param_hint="--cpus")
    rows = asyncio.run(measure(n, list(variants or VARIANTS), rounds, clients, cpus))
    if as_json:  # no goals of its own: it is what `bench dispatch --floor` divides by
        click.echo(json.dumps({"floor": rows, "met": {}}, indent=2))
    else:
        _print_rows(rows)
        click.echo("goals: none (the floor is what `tangram bench dispatch --floor` compares with)")


def _role(role: str, args: list[str]) -> None:
    """A child process of ``run_variant``."""
    if role == "_controller":
        controller(cores_of(args[0]))
    elif role == "_agent":
        _Agent(args[0], args[1], cores_of(args[2]), int(args[3])).serve()
    elif role == "_clients":
        clients(args[0], int(args[1]), int(args[2]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        _role(sys.argv[1], sys.argv[2:])
    else:  # pragma: no cover
        floor()
