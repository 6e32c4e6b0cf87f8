"""A small in-test agent speaking the controller <-> agent contract (docs/protocol.md).

Real processes (`sh -c` in a directory per sandbox, own process group), real ZeroMQ; no
executor, cgroup or GPU code. It records every run (cores, start, end) so tests can check
what the controller granted, and serves GPU requests with an echo service.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from tangram import protocol as p


@dataclass
class Run:
    action: str
    sandbox: str
    cores: tuple[int, ...]
    dop: int
    start: float
    end: float = 0.0


@dataclass
class FakeAgent:
    addr: str
    name: str
    root: str
    cpus: tuple[int, ...] = (0, 1)
    gpus: int = 0
    gpu_mem_mib: int = 0
    heartbeat_s: float = 0.2
    runs: list[Run] = field(default_factory=list)
    destroyed: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    loads: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    prepared: list[str] = field(default_factory=list)
    sandboxes_at_hello: list[str] = field(default_factory=list)
    mute: bool = False  # stop heartbeats and replies (a hung agent)
    # what its Hello says: below BATCH_MINOR it is sent no batches; below STAGED_MINOR (as here) the
    # controller holds a staged Spawn until the result of the action it follows (agent_cpu.py)
    minor: int = p.STAGED_MINOR - 1
    batches_in: int = 0  # BATCH messages received
    welcomed: asyncio.Event = field(default_factory=asyncio.Event)
    curve: Any = None  # tangram.certs.CurveKeys: connect as a CURVE client (tests/security)
    facts_extra: dict[str, Any] = field(default_factory=dict)  # more Hello facts (e.g. `pool`)
    pool_targets: list[tuple[str, int, int]] = field(default_factory=list)  # SandboxPool: (image, mem, count)
    load: dict[str, Any] = field(default_factory=dict)  # what its heartbeats carry (e.g. `pool_idle`)
    _procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    _killed: set[str] = field(default_factory=set)
    _task: asyncio.Task[None] | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def start(self) -> FakeAgent:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(self.sock)
        self.sock.connect(self.addr)
        facts = {
            "cpus": list(self.cpus),
            "idle_cpus": [],
            "numa": [list(self.cpus)],
            "mem_mib": 8192,
            "gpus": self.gpus,
            "gpu_mem_mib": self.gpu_mem_mib,
            "executor": "process",
            "docker": False,
            "cgroup": "v2",
            "hostname": "fake",
            "pid": os.getpid(),
            "version": "test",
            **self.facts_extra,
        }
        await self.sock.send_multipart(
            p.encode(
                p.Hello(
                    "agent",
                    self.name,
                    p.PROTOCOL_MAJOR,
                    self.minor,
                    facts,
                    sandboxes=self.sandboxes_at_hello,
                ),
                0,
            )
        )
        self._task = asyncio.ensure_future(self._serve())
        await asyncio.wait_for(self.welcomed.wait(), 5)
        return self

    async def stop(self) -> None:
        self.mute = True
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._tasks:  # let killed runs reap their processes (no unclosed transports)
            await asyncio.wait(set(self._tasks), timeout=5)
        for t in [self._task, *self._tasks]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self.sock.close(0)
        self.ctx.term()

    def _reply(self, rid: int, msg: p.Message, blobs: list[bytes] = ()) -> None:  # type: ignore[assignment]
        if not self.mute:
            self.sock.send_multipart(p.encode(msg, rid, blobs))

    async def _serve(self) -> None:
        last = time.monotonic()
        recv = None
        while True:
            if recv is None:
                recv = asyncio.ensure_future(self.sock.recv_multipart())
            done, _ = await asyncio.wait({recv}, timeout=self.heartbeat_s)
            if time.monotonic() - last >= self.heartbeat_s and not self.mute:
                await self.sock.send_multipart(p.encode(p.Heartbeat(dict(self.load)), 0))
                last = time.monotonic()
            if recv in done:
                frames = recv.result()
                recv = None
                self.batches_in += p.is_batch(frames)
                for env in p.decode_all(frames):  # one message, or the items of a batch
                    self._on(env)

    def _on(self, env: p.Envelope | p.BadItem) -> None:
        if isinstance(env, p.BadItem):
            self._reply(env.request_id, p.Error.from_exception(env.error))
            return
        if isinstance(env.msg, p.Welcome):
            self.welcomed.set()
            return
        if isinstance(env.msg, p.Heartbeat) or self.mute:
            return
        task = asyncio.ensure_future(self._handle(env))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dir(self, sandbox: str) -> str:
        return os.path.join(self.root, sandbox)

    async def _handle(self, env: p.Envelope) -> None:
        msg, rid = env.msg, env.request_id
        if isinstance(msg, p.CreateSandbox):
            os.makedirs(self._dir(msg.sandbox), exist_ok=True)
            self.created.append(msg.sandbox)
            self._reply(rid, p.Result({}))
        elif isinstance(msg, p.DestroySandbox):
            shutil.rmtree(self._dir(msg.sandbox), ignore_errors=True)
            self.destroyed.append(msg.sandbox)
            self._reply(rid, p.Result({}))
        elif isinstance(msg, p.PutFile):
            with open(os.path.join(self._dir(msg.sandbox), msg.path), "wb") as fh:
                fh.write(env.blobs[0])
            self._reply(rid, p.Result({}))
        elif isinstance(msg, p.GetFile):
            try:
                with open(os.path.join(self._dir(msg.sandbox), msg.path), "rb") as fh:
                    data = fh.read()
            except OSError as exc:
                self._reply(rid, p.Error("BAD_REQUEST", str(exc), False))
                return
            self._reply(rid, p.Result({"size": len(data)}), [data])
        elif isinstance(msg, p.Spawn):
            await self._spawn(rid, msg, env.blobs)
        elif isinstance(msg, p.Kill):
            self._killed.add(msg.action)
            proc = self._procs.get(msg.action)
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            self._reply(rid, p.Ack())
        elif isinstance(msg, p.Prepare):
            self.prepared.append(msg.service)
            self._reply(rid, p.Result({}))
        elif isinstance(msg, p.Load):
            self.loads.append((msg.service, tuple(msg.gpus)))
            await asyncio.sleep(0.01)
            self._reply(rid, p.Result({"seconds": 0.01, "bytes": 0}))
        elif isinstance(msg, p.Evict):
            self._reply(rid, p.Result({}))
        elif isinstance(msg, p.SandboxPool):
            self.pool_targets.append((msg.image, msg.mem_mib, msg.count))
            self._reply(rid, p.Result({"idle": 0, "making": 0}))
        elif isinstance(msg, p.Invoke):
            payload = msgpack.unpackb(env.blobs[0], raw=False)
            if isinstance(payload, dict) and payload.get("raise"):
                self._reply(
                    rid, p.Error("REMOTE_ERROR", "service raised ValueError", False, "Traceback: ...")
                )
                return
            self._reply(
                rid, p.Result({"run_s": 0.0}), [msgpack.packb({"echo": payload, "gpus": list(msg.gpus)})]
            )
        else:
            self._reply(rid, p.Error("BAD_REQUEST", f"fake agent does not serve {msg.NAME}", False))

    async def _spawn(self, rid: int, msg: p.Spawn, blobs: tuple[bytes, ...]) -> None:
        if not os.path.isdir(self._dir(msg.sandbox)):
            self._reply(rid, p.Error("SANDBOX_LOST", f"no sandbox {msg.sandbox}", False))
            return
        run = Run(msg.action, msg.sandbox, tuple(msg.cores), msg.dop, time.monotonic())
        self.runs.append(run)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TANGRAM_DOP": str(msg.dop),
            "TANGRAM_CORES": ",".join(map(str, msg.cores)),
            **msg.env,
        }
        proc = await asyncio.create_subprocess_exec(
            "sh",
            "-c",
            msg.cmd.replace("{dop}", str(msg.dop)),
            cwd=self._dir(msg.sandbox),
            env=env,
            stdin=asyncio.subprocess.PIPE if blobs else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._procs[msg.action] = proc
        if msg.action in self._killed:  # the Kill came while the process was being created
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(blobs[0] if blobs else None), msg.timeout_s)
        except TimeoutError:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
        finally:
            self._procs.pop(msg.action, None)
        run.end = time.monotonic()
        code = (
            proc.returncode
            if proc.returncode is not None and proc.returncode >= 0
            else 128 - (proc.returncode or 0)
        )
        self._reply(
            rid,
            p.Result(
                {
                    "exit_code": code,
                    "truncated": False,
                    "timed_out": timed_out,
                    "killed": msg.action in self._killed,
                    "run_s": run.end - run.start,
                    "setup_s": 0.0,
                    "cores": list(msg.cores),
                }
            ),
            [out, err],
        )
