"""The floor of the process executor's layout: what `tangram bench dispatch`'s throughput run would reach
if every process on the path did almost nothing but pass the action on (docs/performance.md, "Twelfth round").

    python3 scripts/path_floor.py [-n 4000] [--variant spawners] [--variant direct] [--rounds 1] [--json]

The same processes and hops as the throughput run: a client process holding 16 DEALER sockets (one per
sandbox, each running its next no-op as soon as its reply comes), a controller process (two ROUTER
sockets on 127.0.0.1 TCP, msgpack frames, two starts per core: one running, one staged on the agent), an
agent process (a DEALER to the controller; three pipes per action, read after the exit), and
`/bin/sh -c true` pinned to the action's core. The logic is a deque and a dict in each. Variants:

- ``spawners``: 16 of the agent's real spawners (``agent/executors/proc_spawner.py``, plain mode: one per
  sandbox, as contained sandboxes have; they pin with ``sched_setaffinity`` and do not move between
  cgroups, which costs about 30 us per action more in Tangram, measured separately);
- ``direct``: no spawner: the agent ``posix_spawn``s itself with its thread pinned for the call and
  reaps through pidfds (what Tangram's agent does when it has no spawner).

Each round measures the asyncio ``taskset -c N true`` baseline of the dispatch bench before and after
the variants and prints, per variant: actions/s, its ratio to the baseline's mean, and the CPU per
action of each process (from ``/proc``). Standard library plus pyzmq and msgpack; loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import subprocess
import sys
import time

import msgpack
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPAWNER = os.path.join(ROOT, "agent", "executors", "proc_spawner.py")
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
ARGV = ["/bin/sh", "-c", "true"]
SANDBOXES = 16
CORES = tuple(sorted(os.sched_getaffinity(0))[:2])  # the dispatch bench's two cores (one on one)


def controller() -> None:
    """Queue every request; hand the agent two per core; pass each result back to its client."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind("tcp://127.0.0.1:*")
    back.bind("tcp://127.0.0.1:*")
    print(json.dumps([s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (front, back)]), flush=True)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    agent, slots, queue, who = None, [c for c in CORES for _ in range(2)], collections.deque(), {}
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
    out = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out


class _Spawner:
    """One of the agent's real spawners (plain mode), over its SOCK_SEQPACKET protocol."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", SPAWNER, json.dumps({"mode": "plain"})],
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

    def __init__(self, endpoint: str, variant: str) -> None:
        self.sock = zmq.Context().socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.spawners = [_Spawner() for _ in range(SANDBOXES)] if variant == "spawners" else []
        self.by_fd = {sp.sock.fileno(): sp for sp in self.spawners}
        for fd in self.by_fd:
            self.poller.register(fd, zmq.POLLIN)
        self.null = os.open(os.devnull, os.O_RDONLY)
        self.waiting: dict[int, collections.deque] = {c: collections.deque() for c in CORES}
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
                        self.finish(self.jobs.pop(msg["id"]), msg["exit"], results)
                elif fd in self.jobs:
                    job = self.jobs.pop(fd)
                    self.poller.unregister(fd)
                    os.close(fd)
                    self.finish(job, os.waitstatus_to_exitcode(os.waitpid(job["pid"], 0)[1]), results)
            for body in _drain_one(self.sock):
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


def _drain_one(sock: zmq.Socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return out


def clients(endpoint: str, n: int) -> None:
    """16 sandboxes' worth of sequential no-ops; says "ready", waits for a line, runs, prints the rate."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(SANDBOXES)]
    poller, index = zmq.Poller(), {s: k for k, s in enumerate(socks)}
    for s in socks:
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
    print("ready", flush=True)
    sys.stdin.readline()
    t0, c0, sent, done = time.perf_counter(), time.process_time(), 0, 0

    def submit(k: int) -> None:
        nonlocal sent
        socks[k].send(msgpack.packb({"id": sent, "sandbox": k, "cmd": "true"}))
        sent += 1

    for k in range(min(SANDBOXES, n)):
        submit(k)
    while done < n:
        for s, _ in poller.poll():
            for _ in _drain_one(s):
                done += 1
                if sent < n:
                    submit(index[s])
    print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}), flush=True)
    sys.stdin.readline()


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_variant(variant: str, n: int) -> dict:
    """One variant's run: start the three processes, time the clients' n no-ops, read everyone's CPU."""
    me = [sys.executable, os.path.abspath(__file__)]
    pipe = {"stdout": subprocess.PIPE, "text": True}
    ctl = subprocess.Popen(me + ["_controller"], **pipe)
    procs = [ctl]
    try:
        front, back = json.loads(ctl.stdout.readline())
        agent = subprocess.Popen(me + ["_agent", back, variant], **pipe)
        procs.append(agent)
        spawners = json.loads(agent.stdout.readline())
        cl = subprocess.Popen(me + ["_clients", front, str(n)], stdin=subprocess.PIPE, **pipe)
        procs.append(cl)
        if cl.stdout.readline().strip() != "ready":
            raise RuntimeError("the clients did not start")
        time.sleep(0.3)  # every DEALER connected
        pids = {"controller": [ctl.pid], "agent": [agent.pid], "spawners": spawners}
        before = {k: sum(_cpu_s(p) for p in v) for k, v in pids.items()}
        cl.stdin.write("go\n")
        cl.stdin.flush()
        done = json.loads(cl.stdout.readline())
        used = {k: sum(_cpu_s(p) for p in v) - before[k] for k, v in pids.items()}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    used["clients"] = done["cpu_s"]
    row = {"variant": variant, "n": n, "actions_per_s": n / done["wall_s"]}
    row.update({f"{k}_cpu_ms_per_action": v / n * 1e3 for k, v in used.items()})
    row["floor_cpu_ms_per_action"] = sum(used.values()) / n * 1e3
    return row


def measure(n: int, variants: list[str], rounds: int) -> list[dict]:
    sys.path.insert(0, ROOT)
    from tangram_cli.bench.raw_spawn import raw_spawn_asyncio

    def raw() -> float:
        cpus = ",".join(map(str, CORES))
        return asyncio.run(raw_spawn_asyncio(min(n, 2000), SANDBOXES, cpus))["actions_per_s"]

    rows = []
    for r in range(rounds):
        before = raw()
        got = [run_variant(v, n) for v in variants]
        after = raw()
        for row in got:
            row.update(round=r + 1, raw_before_actions_per_s=before, raw_after_actions_per_s=after,
                       ratio_to_raw_spawn=row["actions_per_s"] / ((before + after) / 2))
        rows.extend(got)
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, args = sys.argv[1], sys.argv[2:]
        if role == "_controller":
            controller()
        elif role == "_agent":
            _Agent(args[0], args[1]).serve()
        elif role == "_clients":
            clients(args[0], int(args[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=4000, help="no-op actions per variant and round")
    ap.add_argument("--variant", action="append", choices=["spawners", "direct"],
                    help="what starts the actions (default: both)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each between two baseline runs")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of lines")
    a = ap.parse_args()
    rows = measure(a.n, a.variant or ["spawners", "direct"], a.rounds)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        cpu = ", ".join(f"{k.split('_cpu')[0]} {v:.3f}" for k, v in row.items()
                        if k.endswith("_cpu_ms_per_action"))
        print(f"round {row['round']} {row['variant']:>8}: {row['actions_per_s']:6.0f} /s, "
              f"{row['ratio_to_raw_spawn']:.2f}x raw (before {row['raw_before_actions_per_s']:.0f}, after "
              f"{row['raw_after_actions_per_s']:.0f}); CPU ms per action: {cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
