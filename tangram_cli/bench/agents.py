"""The bench agent: many agent identities in one process (`python -m tangram_cli.bench.agents`).

One DEALER socket per identity, speaking the agent side of docs/contract.md, served by one
blocking poll loop. Its executor does not run commands: mode `instant` answers every `Spawn`
with a `Result` at once (the reply is prebuilt; the Spawn body is not even decoded), so a run
measures the controller alone; mode `model` sleeps for the action's modelled duration, read
from the command `NAME T_ORI SERIAL` as `T_ORI / (E(dop) * dop)` with Amdahl's E (the
simulator's model); a staged `Spawn` (`after` set) starts when that action ends, and a `Kill`
drops it unstarted, as the real agent does (agent/staged.py). Like the real agent, an identity that hears nothing from the controller for
three heartbeat intervals says `Hello` again. On SIGTERM it writes its counters as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import zmq

from tangram import protocol as p
from tangram.sockio import recv_frames, send_frames
from tangram_cli.bench.procs import proc_cpu_s, stop_proc

_RID = struct.Struct(">Q")


def model_seconds(cmd: str, dop: int) -> float:
    """Seconds an action `NAME T_ORI SERIAL` runs on `dop` cores: T_ORI / (E(dop) dop), Amdahl E."""
    parts = cmd.split()
    t_ori = float(parts[1]) if len(parts) > 1 else 0.0
    serial = float(parts[2]) if len(parts) > 2 else 1.0
    m = max(1, dop)
    return t_ori * (serial + (1.0 - serial) / m)  # = T / (E(m) m) with E(m) = 1 / (s m + 1 - s)


class BenchAgent:
    """Many agent identities in one process, served by one blocking poll loop (no asyncio)."""

    def __init__(
        self, controller: str, names: list[str], cores: int, mem_mib: int, mode: str, numa: int = 2
    ) -> None:
        self.controller, self.names, self.mode = controller, names, mode
        self.ctx = zmq.Context()
        per = max(1, math.ceil(cores / max(1, numa)))
        cpus = list(range(cores))
        self.facts = {
            "cpus": cpus,
            "idle_cpus": [],
            "numa": [cpus[i : i + per] for i in range(0, cores, per)],
            "mem_mib": mem_mib,
            "gpus": 0,
            "gpu_mem_mib": 0,
            "gpu_uuids": [],
            "executor": "process",
            "docker": False,
            "cgroup": "v2",
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "version": "bench",
        }
        self.socks: dict[zmq.Socket[bytes], str] = {}
        self.last_in: dict[str, float] = {}
        self.last_out: dict[str, float] = {}
        self.hb = 1.0
        self.timers: list[tuple[float, int, str]] = []
        self.running: dict[str, tuple[zmq.Socket[bytes], bytes, float]] = {}  # action -> (sock, rid, start)
        self.killed: set[str] = set()
        # staged starts (agent/staged.py): what waits for an action's end -> (action, sock, rid, seconds)
        self.behind: dict[str, tuple[str, zmq.Socket[bytes], bytes, float]] = {}
        self.outq: dict[zmq.Socket[bytes], list[list[bytes]]] = {}  # results of this wake-up, per socket
        self.stats = {
            "spawns": 0,
            "results": 0,
            "kills": 0,
            "rehellos": 0,
            "other_requests": 0,
            "welcomes": 0,
        }
        self._seq = 0
        self.halt = False
        body = {
            "exit_code": 0,
            "truncated": False,
            "timed_out": False,
            "killed": False,
            "run_s": 0.0,
            "setup_s": 0.0,
            "cores": [],
        }
        self._instant = p.encode(p.Result(body), 0, [b"", b""])

    def _send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.Again):
            send_frames(sock, frames)
        self.last_out[self.socks[sock]] = time.monotonic()

    def _hello(self, sock: zmq.Socket[bytes]) -> None:
        name = self.socks[sock]
        self._send(sock, p.encode(p.Hello("agent", name, p.PROTOCOL_MAJOR, p.PROTOCOL_MINOR, self.facts), 0))

    def connect(self) -> None:
        for name in self.names:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, name.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.connect(self.controller)
            self.socks[sock] = name
            self.last_in[name] = time.monotonic()
            self._hello(sock)

    def _queue(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """A result, sent with the others of this wake-up in one batch (`_flush`)."""
        self.outq.setdefault(sock, []).append(frames)

    def _flush(self) -> None:
        outq, self.outq = self.outq, {}
        for sock, items in outq.items():
            for message in p.pack(items):
                self._send(sock, message)

    def _on(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        name = self.socks[sock]
        self.last_in[name] = time.monotonic()
        if len(frames) < 4:
            return
        kind = frames[1][:1]
        if kind == bytes((p.Spawn.TYPE,)) and self.mode == "instant":
            self._instant_result(sock, frames[2])
            return
        if kind == bytes((p.Heartbeat.TYPE,)):
            return
        for env in p.decode_all(frames):
            if isinstance(env, p.BadItem):
                continue
            if isinstance(env.msg, p.Spawn) and self.mode == "instant":
                self._instant_result(sock, _RID.pack(env.request_id))
            else:
                self._handle(sock, env)

    def _instant_result(self, sock: zmq.Socket[bytes], rid: bytes) -> None:
        self.stats["spawns"] += 1
        self.stats["results"] += 1
        self._queue(sock, [self._instant[0], self._instant[1], rid, *self._instant[3:]])

    def _handle(self, sock: zmq.Socket[bytes], env: p.Envelope) -> None:
        msg, rid = env.msg, env.request_id
        if isinstance(msg, p.Welcome):
            self.stats["welcomes"] += 1
            self.hb = msg.heartbeat_s
        elif isinstance(msg, p.Spawn):
            self.stats["spawns"] += 1
            run = (msg.action, sock, _RID.pack(rid), model_seconds(msg.cmd, msg.dop))
            if msg.after and (msg.after in self.running or self._waiting(msg.after)):
                self.behind[msg.after] = run  # a staged start: at that action's end, on its cores
            else:
                self._start(*run)
        elif isinstance(msg, p.Kill):
            self.stats["kills"] += 1
            self._send(sock, p.encode(p.Ack(), rid))
            if self._drop_staged(msg.action):
                return
            if msg.action in self.running:
                self.killed.add(msg.action)
                self._finish(msg.action)
        elif isinstance(msg, p.Shutdown):
            self._send(sock, p.encode(p.Bye(msg.reason), rid))
            self.halt = True
        elif isinstance(msg, (p.CreateSandbox, p.DestroySandbox, p.PutFile, p.Prepare, p.Evict)):
            self._send(sock, p.encode(p.Result({}), rid))
        elif isinstance(msg, p.GetFile):
            self._send(sock, p.encode(p.Result({"size": 0}), rid, [b""]))
        elif isinstance(msg, (p.Result, p.Error, p.Ack, p.Reject)):
            return
        else:
            self.stats["other_requests"] += 1
            self._send(
                sock,
                p.encode(p.Error("BAD_REQUEST", f"the bench agent does not serve {msg.NAME}", False), rid),
            )

    def _start(self, action: str, sock: zmq.Socket[bytes], rid: bytes, seconds: float) -> None:
        start = time.monotonic()
        self.running[action] = (sock, rid, start)
        self._seq += 1
        heapq.heappush(self.timers, (start + seconds, self._seq, action))

    def _waiting(self, action: str) -> bool:
        return any(run[0] == action for run in self.behind.values())

    def _drop_staged(self, action: str) -> bool:
        """A Kill of a staged action: answered at once, unstarted; what waited behind it now
        waits for what it waited for."""
        for after, run in self.behind.items():
            if run[0] == action:
                del self.behind[after]
                nxt = self.behind.pop(action, None)
                if nxt is not None:
                    self.behind[after] = nxt
                self.running[action] = (run[1], run[2], time.monotonic())
                self.killed.add(action)
                self._finish(action)
                return True
        return False

    def _finish(self, action: str) -> None:
        entry = self.running.pop(action, None)
        if entry is None:
            return
        nxt = self.behind.pop(action, None)
        if nxt is not None:
            self._start(*nxt)
        sock, rid, start = entry
        killed = action in self.killed
        self.killed.discard(action)
        body = {
            "exit_code": 137 if killed else 0,
            "truncated": False,
            "timed_out": False,
            "killed": killed,
            "run_s": round(time.monotonic() - start, 6),
            "setup_s": 0.0,
            "cores": [],
        }
        self.stats["results"] += 1
        frames = p.encode(p.Result(body), 0, [b"", b""])
        self._queue(sock, [frames[0], frames[1], rid, *frames[3:]])

    def _tick(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, action = heapq.heappop(self.timers)
            self._finish(action)
        for sock, name in self.socks.items():
            if (
                now - self.last_in[name] > 3 * self.hb
            ):  # the controller lost us (or restarted): say hello again
                self.stats["rehellos"] += 1
                self.last_in[name] = now
                self._hello(sock)
            elif now - self.last_out[name] >= self.hb:
                self._send(sock, p.encode(p.Heartbeat(), 0))

    def serve(self) -> None:
        """Poll every socket; drain each readable one; fire due timers and heartbeats."""
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while not self.halt:
            wait = 100.0
            if self.timers:
                wait = min(wait, max(0.0, (self.timers[0][0] - time.monotonic()) * 1000))
            for sock, _ in poller.poll(wait):
                for _ in range(1000):
                    try:
                        frames = recv_frames(sock)
                    except zmq.Again:
                        break
                    self._on(sock, frames)  # type: ignore[arg-type]
                self._flush()
            self._tick()
            self._flush()

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


def start_bench_agents(
    agents_addr: str,
    names: list[str],
    procs: int,
    cores: int,
    mode: str,
    workdir: str,
    mem_mib: int = 2235 * 1024,
) -> list[tuple[subprocess.Popen[bytes], str]]:
    """`procs` bench-agent processes sharing `names` round-robin; each writes its stats on SIGTERM."""
    out = []
    for k in range(max(1, min(procs, len(names)))):
        mine = names[k::procs]
        stats = os.path.join(workdir, f"bench-agent-{k}.json")
        argv = [
            sys.executable,
            "-m",
            "tangram_cli.bench.agents",
            "--controller",
            agents_addr,
            "--names",
            ",".join(mine),
            "--cores",
            str(cores),
            "--mem-mib",
            str(mem_mib),
            "--mode",
            mode,
            "--stats",
            stats,
        ]
        with open(os.path.join(workdir, f"bench-agent-{k}.log"), "ab") as log:
            out.append((subprocess.Popen(argv, stdout=log, stderr=log), stats))
    return out


def stop_bench_agents(agents: list[tuple[subprocess.Popen[bytes], str]]) -> dict[str, Any]:
    """SIGTERM every bench-agent process; their stats summed, plus `cpu_s` of the processes."""
    total: dict[str, Any] = {"cpu_s": 0.0}
    for proc, _ in agents:
        total["cpu_s"] += proc_cpu_s(proc.pid) or 0.0
    for proc, _ in agents:
        stop_proc(proc)
    for _, path in agents:
        with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as fh:
            for key, value in json.load(fh).items():
                total[key] = total.get(key, 0) + value
    total["cpu_s"] = round(total["cpu_s"], 2)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tangram_cli.bench.agents",
        description="Bench agents: many identities, instant or modelled execution.",
    )
    ap.add_argument("--controller", required=True, help="the controller's agents address")
    ap.add_argument("--names", required=True, help="comma-separated node names, one identity each")
    ap.add_argument("--cores", type=int, default=256)
    ap.add_argument("--mem-mib", type=int, default=2235 * 1024)
    ap.add_argument("--mode", choices=("instant", "model"), default="instant")
    ap.add_argument("--stats", help="write counters here as JSON when stopped")
    ns = ap.parse_args(argv)
    agent = BenchAgent(ns.controller, ns.names.split(","), ns.cores, ns.mem_mib, ns.mode)

    def halt(*_: object) -> None:
        agent.halt = True

    signal.signal(signal.SIGTERM, halt)
    signal.signal(signal.SIGINT, halt)
    agent.connect()
    try:
        agent.serve()
    finally:
        agent.close()
        if ns.stats:
            with open(ns.stats, "w", encoding="utf-8") as fh:
                json.dump(agent.stats, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
