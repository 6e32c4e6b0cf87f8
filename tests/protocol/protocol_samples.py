"""One message of every type, with every defaulted field set to a non-default value."""

from __future__ import annotations

import msgpack

from tangram import protocol as p

PAYLOAD = msgpack.packb({"prompt": "2+2?", "response": "4"})

SAMPLES: dict[type[p.Message], tuple[p.Message, tuple[bytes, ...]]] = {
    p.Hello: (
        p.Hello(
            "agent",
            "gpu-node-1",
            1,
            0,
            facts={"cpus": 64, "gpus": ["GPU-0a1b", "GPU-2c3d"], "mem": {"total_mib": 256000}, "x": None},
            bundle="sha256:abc123",
            sandboxes=["sb-1", "sb-2"],
            actions=[{"action": "a-1", "attempt": 2, "epoch": 7}],
            job="grpo-7b",
        ),
        (),
    ),
    p.Welcome: (
        p.Welcome(1, 3, 2**63 - 1, 42, heartbeat_s=0.5, max_outstanding=4096, durable=True, session="ab" * 24),
        (),
    ),
    p.Reject: (p.Reject("agent speaks 2, controller 1: run tangram up"), ()),
    p.Heartbeat: (p.Heartbeat(load={"running": 3, "cpu": 0.75, "ok": True}), ()),
    p.Bye: (p.Bye("draining"), ()),
    p.Ack: (p.Ack(), ()),
    p.Accepted: (p.Accepted(), ()),
    p.Result: (p.Result({"exit_code": 0, "run_s": 1.25, "cores": [1, 2], "node": "n1"}), (b"out", b"err")),
    p.Error: (p.Error("REMOTE_ERROR", "boom", False, detail="Traceback (most recent call last):\n..."), ()),
    p.SandboxOpen: (
        p.SandboxOpen(
            image="swe-sandbox:2025-06", mem_mib=4096, reserve=2, timeout_s=1800, labels={"task": "t-1"}
        ),
        (),
    ),
    p.SandboxClose: (p.SandboxClose("sb-1"), ()),
    p.Put: (p.Put("sb-1", "/repo/patch.diff"), (b"\x00\x01binary\xff",)),
    p.Get: (p.Get("sb-1", "/repo/out.txt"), ()),
    p.Exec: (
        p.Exec(
            "sb-1",
            "pytest -q -n {dop} tests/",
            1,
            16,
            elastic="pytest",
            efficiency={"1": 1.0, "2": 0.95, "16": 0.6},
            duration_hint_s=12.5,
            env={"PYTHONHASHSEED": "0", "_X": "a=b"},
            budget_ms=600_000,
            idempotent=True,
            total_budget_ms=900_000,
        ),
        (b"stdin data",),
    ),
    p.Call: (
        p.Call("rm-7b", 2, 30_000, [1, 2, 4], "rm-scaling", total_budget_ms=60_000),
        (PAYLOAD,),
    ),
    p.Lease: (p.Lease("search", units=3, budget_ms=5000, tokens=1200), ()),
    p.Release: (p.Release("lease-9", tokens=900, rate_limited=True, reset_ms=30_000), ()),
    p.Cancel: (p.Cancel(123456789), ()),
    p.CreateSandbox: (
        p.CreateSandbox("sb-1", "registry.local/swe@sha256:00ff", 2048, labels={"tangram.cluster": "c1"}),
        (),
    ),
    p.DestroySandbox: (p.DestroySandbox("sb-1"), ()),
    p.PutFile: (p.PutFile("sb-1", "/work/a.py"), (b"print(1)\n",)),
    p.GetFile: (p.GetFile("sb-1", "/work/a.py"), ()),
    p.Cpuset: (p.Cpuset("sb-1", [0, 1, 2, 3]), ()),
    p.Spawn: (
        p.Spawn(
            "act-1", "sb-1", "make test", [4, 5], 2, {"HOME": "/tmp"}, 60.0, attempt=3, epoch=9, agent_epoch=4,
            after="act-0",
        ),
        (b"stdin",),
    ),
    p.Kill: (p.Kill("act-1", attempt=3, epoch=9), ()),
    p.Prepare: (p.Prepare("rm-7b", {"path": "/models/rm-7b", "bytes": 14_000_000_000}), ()),
    p.Load: (p.Load("rm-7b", [0, 1]), ()),
    p.Evict: (p.Evict("rm-7b", [1]), ()),
    p.Invoke: (p.Invoke("act-2", "rm-7b", [0], 30.0, attempt=2, epoch=9, agent_epoch=4), (PAYLOAD,)),
    p.Shutdown: (p.Shutdown("tangram down"), ()),
    p.SandboxPool: (p.SandboxPool(4, "swe-sandbox:2025-06", 2048), ()),
    p.StatusReq: (p.StatusReq(sections=["nodes", "queue"], limit=10), ()),
    p.Status: (p.Status({"nodes": [{"name": "n1", "cores": 64, "load": 0.5}], "queue": []}), ()),
}
