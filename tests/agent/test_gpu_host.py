"""GpuHost on emulated devices: restore, residency, budgets, refcounts, ordering, typed errors.

The interface test at the bottom also runs on the torch runtime (CPU placement here; CUDA under ``gpu``).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from agent.gpu import (
    BadChunk,
    CallTimeout,
    EmulatedConfig,
    GpuHost,
    GpuInfo,
    GpuOutOfMemory,
    GpuUnhealthy,
    HostClosed,
    LoadFailed,
    LoadResult,
    PrepareFailed,
    ServiceError,
    ServiceSpec,
    SpecMismatch,
    UnknownService,
    build_host,
    chunk_of,
    demo_services,
    emulated_gpus,
    nvml,
)
from agent.gpu.emulated import EmulatedRuntime, backup_size, restore_seconds

pytestmark = pytest.mark.timeout(30)
DEMO = "agent.gpu.demo_services"
GB = 10**9


def spec(name: str = "rm", fn: str = "reward", mem: int = 1024, weight: int = 0, **opts: Any) -> ServiceSpec:
    return ServiceSpec(name=name, runtime="emulated", model=f"{DEMO}:{fn}", gpu_mem_mib=mem,
                       weight_bytes=weight, options=opts)


def host(n: int = 4, mem_mib: int = 8192, **emu: Any) -> GpuHost:
    return GpuHost(emulated_gpus(n, mem_mib), {"emulated": EmulatedConfig(**emu)})


def runtime(h: GpuHost, name: str) -> Any:
    return h._services[name].runtime


# ---------------------------------------------------------------- restore and residency


async def test_restore_copies_bytes_and_takes_bytes_over_bandwidth() -> None:
    h = host(bandwidth_gbps=25.0)
    await h.prepare("rm", spec(weight=5 * GB // 2))  # 2.5 GB at 25 GB/s -> >= 0.1 s
    rt: EmulatedRuntime = runtime(h, "rm")
    assert rt.host_bytes == backup_size(5 * GB // 2, 1024, 64 << 20) > 0
    t0 = time.perf_counter()
    res = await h.load("rm", 0, 2)
    wall = time.perf_counter() - t0
    expected = restore_seconds(5 * GB // 2, 25.0)
    assert res.restored and res.bytes == 5 * GB // 2
    assert res.seconds >= expected * 0.99 and wall >= expected * 0.99
    assert rt.device_digest(h.gpus[0:2]) == [rt.backup_digest()] * 2  # one real copy per GPU


async def test_per_service_bandwidth_and_setup_override() -> None:
    h = host()
    await h.prepare("slow", spec("slow", weight=GB // 10, bandwidth_gbps=1.0, setup_s=0.05))
    res = await h.load("slow", 0, 1)
    assert res.seconds >= restore_seconds(GB // 10, 1.0, 0.05) * 0.99  # 0.15 s
    assert 0 < res.bandwidth_gbps <= 1.0


async def test_resident_service_runs_without_restore() -> None:
    h = host()
    await h.prepare("rm", spec(weight=GB // 4))
    rt = runtime(h, "rm")
    loads = 0
    real = rt.load

    async def counting(gpus: Sequence[GpuInfo]) -> LoadResult:
        nonlocal loads
        loads += 1
        return await real(gpus)

    rt.load = counting
    first = await h.load("rm", 0, 1)
    again = await h.load("rm", 0, 1)
    out = await h.invoke("rm", 0, 1, {"response": "a b", "reference": "a b"}, timeout_s=5)
    assert first.restored and not again.restored and again.seconds == 0.0
    assert out == {"score": 1.0, "method": "f1"}
    assert loads == 1


async def test_invoke_loads_first_when_not_resident() -> None:
    h = host()
    await h.prepare("t", spec("t", "teacher_logprobs"))
    out = await h.invoke("t", 2, 4, {"tokens": ["a", "b"]}, timeout_s=5)
    assert out == demo_services.teacher_logprobs({"tokens": ["a", "b"]})
    assert h.facts()["gpus"][2]["resident"] == ["t"] and h.facts()["gpus"][3]["resident"] == ["t"]


async def test_evict_frees_memory_and_is_idempotent() -> None:
    h = host()
    await h.prepare("rm", spec(mem=3000))
    await h.load("rm", 0, 2)
    assert h.used_mib[:2] == [3000, 3000]
    await h.evict("rm", 0, 2)
    await h.evict("rm", 0, 2)
    assert h.used_mib == [0, 0, 0, 0]
    assert runtime(h, "rm").device_digest(h.gpus[0:2]) == []
    assert all(g["resident"] == [] for g in h.facts()["gpus"])


async def test_evict_drops_placements_inside_the_chunk_only() -> None:
    h = host()
    await h.prepare("rm", spec(mem=100))
    await h.load("rm", 0, 1)
    await h.load("rm", 1, 2)
    await h.load("rm", 0, 2)  # another DoP configuration, charged separately
    assert h.used_mib[:2] == [200, 200]
    await h.evict("rm", 1, 2)
    assert sorted(p["gpus"] for p in h.facts()["services"]["rm"]["placements"]) == [[0, 1], [0, 2]]
    await h.evict("rm", 0, 4)
    assert h.facts()["services"]["rm"]["placements"] == [] and h.used_mib == [0] * 4


async def test_prepare_is_idempotent_and_refuses_another_spec() -> None:
    h = host()
    await asyncio.gather(h.prepare("rm", spec()), h.prepare("rm", spec()))
    with pytest.raises(SpecMismatch):
        await h.prepare("rm", spec(mem=2048))
    with pytest.raises(SpecMismatch):
        await h.prepare("other", spec())


# ---------------------------------------------------------------- budgets and refcounts


async def test_over_budget_load_is_refused_and_changes_nothing() -> None:
    h = host(n=2, mem_mib=8192)
    await h.prepare("a", spec("a", mem=5000))
    await h.prepare("b", spec("b", mem=4000))
    await h.load("a", 0, 1)
    with pytest.raises(GpuOutOfMemory) as err:
        await h.load("b", 0, 2)
    e = err.value
    assert (e.gpu, e.need_mib, e.used_mib, e.budget_mib) == (0, 4000, 5000, 8192)
    assert err.value.retryable and "evict" in err.value.hint
    assert h.used_mib == [5000, 0]
    with pytest.raises(GpuOutOfMemory):
        await h.invoke("b", 0, 1, {}, timeout_s=1)
    await h.evict("a", 0, 1)
    await h.load("b", 0, 2)
    assert h.used_mib == [4000, 4000]


async def test_reserve_lowers_the_budget() -> None:
    h = GpuHost(emulated_gpus(1, 8192), {"emulated": EmulatedConfig()}, reserve_mib=1024)
    await h.prepare("a", spec("a", mem=7500))
    with pytest.raises(GpuOutOfMemory):
        await h.load("a", 0, 1)
    assert h.facts()["gpus"][0]["budget_mib"] == 7168


async def test_evict_waits_for_the_call_in_use() -> None:
    h = host()
    await h.prepare("e", spec("e", "echo"))
    await h.load("e", 0, 1)
    call = asyncio.create_task(h.invoke("e", 0, 1, {"sleep_s": 0.3}, timeout_s=5))
    await asyncio.sleep(0.05)
    assert h.facts()["services"]["e"]["placements"][0]["in_use"] == 1
    evict = asyncio.create_task(h.evict("e", 0, 1))
    await asyncio.sleep(0.1)
    assert not evict.done() and h.facts()["gpus"][0]["resident"] == ["e"]
    assert (await call) == {"echo": {"sleep_s": 0.3}}
    await evict
    assert h.facts()["gpus"][0]["resident"] == []


async def test_timed_out_call_keeps_its_instance_and_gpu_until_it_ends() -> None:
    h = host()
    await h.prepare("e", spec("e", "echo"))
    t0 = time.perf_counter()
    with pytest.raises(CallTimeout) as err:
        await h.invoke("e", 0, 1, {"sleep_s": 0.5}, timeout_s=0.1)
    assert time.perf_counter() - t0 < 0.4 and err.value.retryable
    gpu0 = h.facts()["gpus"][0]
    assert gpu0["busy"] and h.facts()["services"]["e"]["placements"][0]["in_use"] == 1
    evict = asyncio.create_task(h.evict("e", 0, 1))
    other = asyncio.create_task(h.invoke("e", 1, 2, {}, timeout_s=5))  # another GPU is not held up
    assert (await other) == {"echo": {}}
    assert not evict.done()
    await evict
    assert time.perf_counter() - t0 >= 0.5
    assert not h.facts()["gpus"][0]["busy"] and h.used_mib[0] == 0


async def test_cancelled_invoke_keeps_the_gpu_until_the_work_ends() -> None:
    """The agent cancels an invoke on Kill; the thread cannot be killed, so the GPU stays held."""
    h = host()
    await h.prepare("e", spec("e", "echo"))
    await h.load("e", 0, 1)
    call = asyncio.create_task(h.invoke("e", 0, 1, {"sleep_s": 0.4}, timeout_s=5))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert h.facts()["gpus"][0]["busy"]
    t0 = time.perf_counter()
    assert await h.invoke("e", 0, 1, {"n": 1}, timeout_s=5) == {"echo": {"n": 1}}
    assert time.perf_counter() - t0 >= 0.2  # waited for the cancelled call's thread
    await h.aclose()


async def test_aclose_waits_for_running_calls_and_drops_everything() -> None:
    h = host()
    await h.prepare("e", spec("e", "echo", weight=GB // 10))  # the restore alone takes 4 ms
    call = asyncio.create_task(h.invoke("e", 0, 2, {"sleep_s": 0.2}, timeout_s=5))
    await asyncio.sleep(0)  # still restoring: aclose must wait for the load too
    early = asyncio.create_task(h.invoke("e", 2, 3, {}, timeout_s=5))  # queued before the close: runs
    await asyncio.sleep(0)
    closing = asyncio.create_task(h.aclose(timeout_s=5))
    await asyncio.sleep(0)
    with pytest.raises(HostClosed):
        await h.invoke("e", 3, 4, {}, timeout_s=5)
    await closing
    assert (await call) == {"echo": {"sleep_s": 0.2}} and (await early) == {"echo": {}}
    assert h.facts()["services"] == {} and h.used_mib == [0, 0, 0, 0]
    with pytest.raises(HostClosed):
        await h.prepare("x", spec("x"))


# ---------------------------------------------------------------- ordering


class Recorder:
    """A runtime that logs what it does, with delays, for ordering tests."""

    def __init__(self, spec: ServiceSpec, log: list[tuple[Any, ...]], delay: float = 0.05) -> None:
        self.spec, self.log, self.delay = spec, log, delay
        self.active: set[int] = set()
        self.overlap = False

    def _enter(self, gpus: Sequence[GpuInfo]) -> None:
        idx = {g.index for g in gpus}
        self.overlap |= bool(self.active & idx)
        self.active |= idx

    async def _run(self, what: str, gpus: Sequence[GpuInfo], tag: Any = None) -> None:
        self._enter(gpus)
        self.log.append((what, tuple(g.index for g in gpus), tag, "start"))
        await asyncio.sleep(self.delay)
        self.log.append((what, tuple(g.index for g in gpus), tag, "end"))
        self.active -= {g.index for g in gpus}

    async def prepare(self) -> int:
        return 0

    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult:
        await self._run("load", gpus)
        return LoadResult(self.delay, 1)

    async def evict(self, gpus: Sequence[GpuInfo]) -> None:
        await self._run("evict", gpus)

    async def call(self, gpus: Sequence[GpuInfo], payload: dict[str, Any]) -> dict[str, Any]:
        await self._run("call", gpus, payload.get("id"))
        return {"id": payload.get("id")}

    async def close(self) -> None:
        pass


def recording_host(log: list[tuple[Any, ...]], n: int = 4) -> tuple[GpuHost, list[Recorder]]:
    made: list[Recorder] = []

    def factory(s: ServiceSpec) -> Recorder:
        made.append(Recorder(s, log))
        return made[-1]

    return GpuHost(emulated_gpus(n, 8192), {"emulated": factory}), made


async def test_calls_on_one_gpu_are_serialized_and_other_gpus_run_in_parallel() -> None:
    log: list[tuple[Any, ...]] = []
    h, made = recording_host(log)
    await h.prepare("s", spec("s", mem=10))
    await h.load("s", 0, 1)
    await h.load("s", 1, 2)
    log.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(h.invoke("s", 0, 1, {"id": i}, timeout_s=5) for i in range(4)),
                         *(h.invoke("s", 1, 2, {"id": 10 + i}, timeout_s=5) for i in range(4)))
    wall = time.perf_counter() - t0
    gpu0 = [e for e in log if e[1] == (0,)]
    assert [e[3] for e in gpu0] == ["start", "end"] * 4  # never two at once on GPU 0
    assert [e[2] for e in gpu0[::2]] == [0, 1, 2, 3]  # in arrival order
    assert not made[0].overlap
    assert wall < 8 * 0.05  # the two GPUs ran side by side


async def test_overlapping_chunks_run_in_arrival_order() -> None:
    log: list[tuple[Any, ...]] = []
    h, made = recording_host(log)
    await h.prepare("s", spec("s", mem=10))
    await h.load("s", 0, 1)
    log.clear()
    # GPU 0 is busy; A needs [0, 2), then B needs [1, 2) (free right now), then C needs [0, 1).
    first = asyncio.create_task(h.invoke("s", 0, 1, {"id": "busy"}, timeout_s=5))
    await asyncio.sleep(0)
    a = asyncio.create_task(h.invoke("s", 0, 2, {"id": "A"}, timeout_s=5))
    b = asyncio.create_task(h.invoke("s", 1, 2, {"id": "B"}, timeout_s=5))
    c = asyncio.create_task(h.invoke("s", 0, 1, {"id": "C"}, timeout_s=5))
    await asyncio.gather(first, a, b, c)
    at = {(e[0], e[1], e[2], e[3]): i for i, e in enumerate(log)}
    assert at[("call", (0,), "busy", "end")] < at[("load", (0, 1), None, "start")]
    assert at[("call", (0, 1), "A", "end")] < at[("load", (1,), None, "start")]  # B waited for A
    assert at[("call", (0, 1), "A", "end")] < at[("call", (0,), "C", "start")]
    assert at[("load", (1,), None, "end")] < at[("call", (1,), "B", "start")]
    assert not made[0].overlap


async def test_evict_and_load_on_overlapping_chunks_keep_arrival_order() -> None:
    log: list[tuple[Any, ...]] = []
    h, _ = recording_host(log)
    await h.prepare("s", spec("s", mem=10))
    await h.load("s", 0, 2)
    ops = [h.evict("s", 0, 2), h.load("s", 0, 2), h.evict("s", 0, 4), h.load("s", 1, 2)]
    await asyncio.gather(*(asyncio.create_task(op) for op in ops))
    starts = [(e[0], e[1]) for e in log if e[3] == "start"][1:]
    assert starts == [("evict", (0, 1)), ("load", (0, 1)), ("evict", (0, 1)), ("load", (1,))]


@pytest.mark.parametrize("seed", range(5))
async def test_random_mix_keeps_the_invariants(seed: int) -> None:
    """Random prepare/load/evict/invoke on random aligned chunks: never two actions on one GPU, never
    over budget, and every request answers (a value or a typed error)."""
    import random

    rng = random.Random(seed)
    log: list[tuple[Any, ...]] = []
    made: list[Recorder] = []
    h: GpuHost

    active: set[int] = set()  # GPUs busy across every service
    overlaps: list[tuple[int, ...]] = []

    class Checked(Recorder):
        async def _run(self, what: str, gpus: Sequence[GpuInfo], tag: Any = None) -> None:
            assert all(u <= b for u, b in zip(h.used_mib, h.budget_mib, strict=True))
            idx = {g.index for g in gpus}
            if active & idx:
                overlaps.append(tuple(sorted(idx)))
            active.update(idx)
            await super()._run(what, gpus, tag)
            active.difference_update(idx)

    def factory(s: ServiceSpec) -> Recorder:
        made.append(Checked(s, log, delay=0.002))
        return made[-1]

    h = GpuHost(emulated_gpus(8, 1000), {"emulated": factory})
    for i in range(4):
        await h.prepare(f"s{i}", spec(f"s{i}", mem=rng.choice([200, 400, 600])))
    chunks = [(s, s + k) for k in (1, 2, 4, 8) for s in range(0, 8, k)]
    ops = []
    for n in range(150):
        name, chunk = f"s{rng.randrange(4)}", rng.choice(chunks)
        kind = rng.choice(["load", "evict", "invoke", "invoke"])
        if kind == "invoke":
            ops.append(h.invoke(name, *chunk, {"id": n}, timeout_s=10))
        else:
            ops.append(getattr(h, kind)(name, *chunk))
    results = await asyncio.gather(*(asyncio.create_task(op) for op in ops), return_exceptions=True)
    assert all(not isinstance(r, BaseException) or isinstance(r, GpuOutOfMemory) for r in results), results
    assert not overlaps and not any(r.overlap for r in made)
    charged = [0] * 8
    for sv in h.facts()["services"].values():
        for p in sv["placements"]:
            for g in range(*p["gpus"]):
                charged[g] += sv["gpu_mem_mib"]
    assert charged == h.used_mib and all(u <= b for u, b in zip(h.used_mib, h.budget_mib, strict=True))
    assert not any(g["busy"] for g in h.facts()["gpus"])


async def test_a_cancelled_waiter_does_not_block_the_queue() -> None:
    log: list[tuple[Any, ...]] = []
    h, _ = recording_host(log)
    await h.prepare("s", spec("s", mem=10))
    first = asyncio.create_task(h.invoke("s", 0, 1, {"id": 1}, timeout_s=5))
    await asyncio.sleep(0)
    doomed = asyncio.create_task(h.invoke("s", 0, 2, {"id": 2}, timeout_s=5))
    await asyncio.sleep(0)
    doomed.cancel()
    assert (await asyncio.wait_for(h.invoke("s", 1, 2, {"id": 3}, timeout_s=5), 2)) == {"id": 3}
    await first
    with pytest.raises(asyncio.CancelledError):
        await doomed


# ---------------------------------------------------------------- typed errors


async def test_service_error_carries_the_traceback() -> None:
    h = host()
    await h.prepare("f", spec("f", "fail"))
    with pytest.raises(ServiceError) as err:
        await h.invoke("f", 0, 1, {"message": "boom"}, timeout_s=5)
    assert "ValueError: demo failure: boom" in err.value.detail and "Traceback" in err.value.detail
    assert h.facts()["gpus"][0]["busy"] is False  # the GPU is released after a failure


async def test_non_dict_result_is_a_service_error() -> None:
    h = host()
    await h.prepare("r", spec("r", "_words"))
    with pytest.raises(ServiceError, match="expected dict"):
        await h.invoke("r", 0, 1, {"x": 1}, timeout_s=5)


async def test_prepare_errors_are_typed() -> None:
    h = host()
    with pytest.raises(PrepareFailed, match="cannot import"):
        await h.prepare("x", spec("x", "no_such_function"))
    with pytest.raises(PrepareFailed, match="not available"):
        await h.prepare("t", ServiceSpec("t", "torch", "m:f", 10))
    with pytest.raises(UnknownService):
        await h.load("x", 0, 1)  # a failed prepare leaves nothing behind
    assert isinstance(PrepareFailed("x"), LoadFailed)


async def test_unknown_service_and_bad_chunks() -> None:
    h = host()
    await h.prepare("rm", spec())
    with pytest.raises(UnknownService):
        await h.invoke("nope", 0, 1, {}, timeout_s=1)
    for start, end in [(-1, 1), (1, 1), (2, 1), (3, 5)]:
        with pytest.raises(BadChunk):
            await h.load("rm", start, end)
    with pytest.raises(ValueError, match="timeout_s"):
        await h.invoke("rm", 0, 1, {}, timeout_s=0)
    assert chunk_of([2, 3]) == (2, 4)
    with pytest.raises(BadChunk):
        chunk_of([0, 2])


class Failing(Recorder):
    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_load_failure_is_typed_rolls_back_and_marks_the_gpu_unhealthy() -> None:
    log: list[tuple[Any, ...]] = []
    h = GpuHost(emulated_gpus(2, 8192), {"emulated": lambda s: Failing(s, log)}, unhealthy_after=3)
    await h.prepare("s", spec("s", mem=100))
    for _ in range(3):
        with pytest.raises(LoadFailed) as err:
            await h.load("s", 0, 1)
        assert "illegal memory access" in err.value.detail
        assert h.used_mib == [0, 0]
    assert ("evict", (0,), None, "start") in log  # partial state dropped
    assert h.facts()["gpus"][0]["healthy"] is False and h.facts()["gpus"][1]["healthy"] is True
    with pytest.raises(GpuUnhealthy):
        await h.load("s", 0, 1)


class Hanging(Recorder):
    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult:
        await asyncio.sleep(10)
        raise AssertionError("unreachable")


async def test_load_timeout_is_a_load_failure() -> None:
    h = GpuHost(emulated_gpus(1, 8192), {"emulated": lambda s: Hanging(s, [])}, load_timeout_s=0.1)
    await h.prepare("s", spec("s", mem=100))
    with pytest.raises(LoadFailed, match=r"passed 0\.1 s"):
        await h.load("s", 0, 1)
    assert h.used_mib == [0]


# ---------------------------------------------------------------- facts, specs, building a host


async def test_facts_shape() -> None:
    h = host(n=2)
    await h.prepare("rm", spec(mem=1000))
    await h.load("rm", 1, 2)
    facts = h.facts()
    g1 = facts["gpus"][1]
    want = {"index", "uuid", "name", "memory_total_mib", "memory_used_mib", "resident", "budget_mib"}
    assert want <= set(g1)
    got = (g1["uuid"], g1["memory_total_mib"], g1["memory_used_mib"], g1["resident"])
    assert got == ("EMU-local-1", 8192, 1000, ["rm"])
    assert facts["services"]["rm"]["placements"][0]["gpus"] == [1, 2]
    await h.aclose()
    assert h.facts()["services"] == {}


def test_service_spec_validation_and_from_dict() -> None:
    s = ServiceSpec.from_dict("rm", {"runtime": "emulated", "model": f"{DEMO}:reward", "gpu_mem_mib": 10,
                                     "host_mem_mib": 2})
    assert s.restore_bytes == 2 << 20 and ServiceSpec.from_dict("rm", s.to_dict()) == s
    assert spec(mem=3).restore_bytes == 3 << 20 and spec(weight=5).restore_bytes == 5
    bads = [{"runtime": "tpu"}, {"gpu_mem_mib": -1}, {"model": ""}, {"name": "bad name"}]
    for bad, why in zip(bads, ["runtime", "gpu_mem_mib", "model", "name"], strict=True):
        args = {"name": "x", "runtime": "emulated", "model": "m:f", "gpu_mem_mib": 1} | bad
        with pytest.raises(ValueError, match=why):
            ServiceSpec(**args)
    with pytest.raises(ValueError, match="unknown service spec keys"):
        ServiceSpec.from_dict("x", {"runtime": "emulated", "model": "m:f", "gpu_mem_mib": 1, "gpus": 2})


async def test_build_host_emulated() -> None:
    h, reason = build_host(emulated=8, gpu_memory_mib=80 * 1024, bandwidth_gbps=50.0)
    assert reason is None and len(h.gpus) == 8 and h.budget_mib == [80 * 1024] * 8
    assert "emulated" in h.runtimes and "vllm" in h.runtimes
    await h.prepare("rm", spec())
    assert (await h.invoke("rm", 0, 8, {"response": "x"}, timeout_s=5))["method"] == "hash"


def test_nvml_discovery_is_clean_without_a_driver() -> None:
    gpus, reason = nvml.discover()
    if gpus:
        pytest.skip("this machine has NVML devices")
    assert gpus == [] and reason
    assert nvml.memory_used_mib("GPU-00000000-0000-0000-0000-000000000000") is None
    h, why = build_host()
    assert h.gpus == () and why


def test_cpu_affinity_mask() -> None:
    assert nvml.cpus_from_mask([0b1011, 1]) == (0, 1, 3, 64)


def test_demo_services_are_deterministic() -> None:
    assert demo_services.reward({"response": "x y"}) == demo_services.reward({"response": "X, y!"})
    assert demo_services.reward({"response": "a b c", "reference": "a b d"})["score"] == pytest.approx(2 / 3,
                                                                                                   abs=1e-6)
    lp = demo_services.teacher_logprobs({"tokens": [1, 2, 3]})
    assert len(lp["logprobs"]) == 3 and all(v < 0 for v in lp["logprobs"])


# ---------------------------------------------------------------- one interface, every runtime


def _torch_factory(device: str) -> Any:
    pytest.importorskip("torch")
    from agent.gpu.torch_module import TorchConfig

    return TorchConfig(device=device)


RUNTIME_CASES = [
    pytest.param("emulated", id="emulated"),
    pytest.param("torch-cpu", id="torch-cpu"),
    pytest.param("torch-cuda", id="torch-cuda", marks=pytest.mark.gpu),
]


def interface_setup(kind: str) -> tuple[GpuHost, ServiceSpec, dict[str, Any], Any, dict[str, Any]]:
    """(host, spec, payload, check(result), a payload the service rejects) for one runtime."""
    if kind == "emulated":
        h = host(n=2)
        s = spec("svc", "reward", mem=512, weight=GB // 8)
        ok = {"response": "a b", "reference": "a b"}
        return h, s, ok, lambda r: r == {"score": 1.0, "method": "f1"}, {"response": 7}
    factory = _torch_factory("cpu" if kind == "torch-cpu" else "cuda")
    if kind == "torch-cpu":
        gpus = emulated_gpus(2, 8192)
    else:
        gpus, _ = nvml.discover()
        gpus = gpus[:2]
    s = ServiceSpec("svc", "torch", f"{DEMO}:tiny_mlp", gpu_mem_mib=256)
    expected = demo_services.tiny_mlp()
    import torch

    with torch.no_grad():
        want = expected(torch.ones(1, 4)).tolist()

    def check(r: dict[str, Any]) -> bool:
        got = r["output"][0]
        close = [abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(got, want[0], strict=True)]
        return len(r["output"]) == 1 and all(close)

    return GpuHost(gpus, {"torch": factory}), s, {"input": [[1.0, 1.0, 1.0, 1.0]]}, check, {"input": "text"}


@pytest.mark.parametrize("kind", RUNTIME_CASES)
async def test_runtime_interface(kind: str) -> None:
    h, s, payload, check, bad = interface_setup(kind)
    await h.prepare("svc", s)
    await h.prepare("svc", s)
    first = await h.load("svc", 0, 1)
    assert first.restored and first.bytes > 0 and first.seconds > 0
    assert not (await h.load("svc", 0, 1)).restored
    assert check(await h.invoke("svc", 0, 1, payload, timeout_s=20))
    assert h.facts()["gpus"][0]["resident"] == ["svc"]
    await h.evict("svc", 0, 1)
    await h.evict("svc", 0, 1)
    assert h.facts()["gpus"][0]["resident"] == [] and h.used_mib[0] == 0
    assert check(await h.invoke("svc", 0, 1, payload, timeout_s=20))  # restores again by itself
    with pytest.raises(ServiceError) as err:
        await h.invoke("svc", 0, 1, bad, timeout_s=20)
    assert "Traceback" in err.value.detail
    await h.aclose()
