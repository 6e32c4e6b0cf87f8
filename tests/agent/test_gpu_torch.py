"""Torch runtime, CPU side: building modules, the host copy, restore by copy, evict, safe file loading."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from agent.gpu import GpuHost, PrepareFailed, ServiceSpec, emulated_gpus  # noqa: E402
from agent.gpu.demo_services import tiny_mlp  # noqa: E402
from agent.gpu.torch_module import TorchConfig, TorchRuntime, tensor_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(60)
DEMO = "agent.gpu.demo_services"


def make(model: str = f"{DEMO}:tiny_mlp", **opts: object) -> tuple[GpuHost, ServiceSpec]:
    spec = ServiceSpec("m", "torch", model, gpu_mem_mib=64, options=opts)
    return GpuHost(emulated_gpus(2, 1024), {"torch": TorchConfig(device="cpu")}), spec


async def test_host_copy_is_the_only_copy_and_restore_copies_every_tensor() -> None:
    host, spec = make()
    await host.prepare("m", spec)
    rt: TorchRuntime = host._services["m"].runtime
    ref = tiny_mlp()
    want_bytes = tensor_bytes(list(ref.parameters()) + list(ref.buffers()))
    assert rt.host_bytes == want_bytes == host.facts()["services"]["m"]["host_bytes"]
    assert all(p.is_meta for p in rt._skeleton.parameters())  # no second full copy on the host
    res = await host.load("m", 0, 1)
    assert res.bytes == want_bytes and res.seconds > 0
    placed = rt.placed_module(host.gpus[0:1])
    for (name, got), (_, exp) in zip(placed.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(got, exp), name
        assert got.data_ptr() != rt._host[name].data_ptr()  # a copy, not a view of the backup
    assert float(placed.scale) == 2.0  # the non-persistent buffer survived


async def test_evict_drops_the_device_module_and_restores_again() -> None:
    host, spec = make()
    await host.prepare("m", spec)
    await host.load("m", 0, 2)
    rt: TorchRuntime = host._services["m"].runtime
    await host.evict("m", 0, 2)
    assert rt.placed_module(host.gpus[0:2]) is None and host.used_mib == [0, 0]
    out = await host.invoke("m", 0, 2, {"input": [[0.0, 0.0, 0.0, 0.0]]}, timeout_s=10)
    assert len(out["output"][0]) == 2


async def test_state_dict_file_needs_a_factory(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save(tiny_mlp(seed=3).state_dict(), path)
    host, spec = make(str(path))
    with pytest.raises(PrepareFailed, match="needs options"):
        await host.prepare("m", spec)
    host, spec = make(str(path), factory=f"{DEMO}:tiny_mlp")
    await host.prepare("m", spec)
    out = await host.invoke("m", 0, 1, {"input": [[1.0, 2.0, 3.0, 4.0]]}, timeout_s=10)
    with torch.no_grad():
        want = tiny_mlp(seed=3)(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).tolist()
    assert out["output"][0] == pytest.approx(want[0])


async def test_pickled_module_is_refused_unless_trusted(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    host, spec = make(str(path))
    with pytest.raises(PrepareFailed) as err:
        await host.prepare("m", spec)
    assert "weights" in err.value.detail.lower() or "weights" in str(err.value).lower()
    host, spec = make(str(path), trust_pickle=True)
    await host.prepare("m", spec)
    assert len((await host.invoke("m", 0, 1, {"input": [[1.0, 1.0]]}, timeout_s=10))["output"][0]) == 2


async def test_custom_call_function_and_missing_model() -> None:
    host, spec = make(call=f"{__name__}:double_first")
    await host.prepare("m", spec)
    assert await host.invoke("m", 0, 1, {"x": 3}, timeout_s=10) == {"y": 6, "device": "cpu"}
    host, spec = make("/no/such/file.pt")
    with pytest.raises(PrepareFailed, match="neither"):
        await host.prepare("m", spec)


def double_first(module: torch.nn.Module, payload: dict, device: torch.device) -> dict:
    assert torch.is_inference_mode_enabled()
    return {"y": payload["x"] * 2, "device": str(device)}


# ---- the flat-buffer restore

class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight  # tied: one tensor, two slots
        self.odd = torch.nn.Parameter(torch.arange(7, dtype=torch.float64), requires_grad=False)
        self.register_buffer("steps", torch.tensor(3, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("empty", torch.zeros(0, 4, dtype=torch.bfloat16))
        self.register_buffer("halves", torch.full((3,), 1.5, dtype=torch.float16), persistent=False)


def tied() -> Tied:
    torch.manual_seed(0)
    return Tied()


async def test_one_aligned_flat_buffer_for_every_dtype_and_ties_survive() -> None:
    host, spec = make(f"{__name__}:tied")
    await host.prepare("m", spec)
    rt: TorchRuntime = host._services["m"].runtime
    ref = tied()
    assert rt.host_bytes == tensor_bytes(list(ref.parameters()) + list(ref.buffers()))  # tied weight once
    flat_host = rt._buffer.tensor
    base = flat_host.data_ptr()
    for name, view in rt._host.items():  # every host tensor is an aligned view of the one flat buffer
        assert view.untyped_storage().data_ptr() == base, name
        assert view.storage_offset() * view.element_size() % 256 == 0, name  # aligned offset
    await host.load("m", 0, 1)
    placed = rt.placed_module(host.gpus[0:1])
    assert placed.head.weight is placed.emb.weight  # the tie is kept on the device
    flat = rt._placed[(0,)].flat
    assert flat.numel() >= rt.host_bytes and flat.data_ptr() != base
    got, want = placed.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name, exp in want.items():
        assert got[name].dtype == exp.dtype and got[name].shape == exp.shape, name
        assert torch.equal(got[name], exp), name
        assert got[name].untyped_storage().data_ptr() == flat.data_ptr(), name  # a view of the device buffer
    assert torch.equal(placed.halves, ref.halves) and "halves" not in got  # non-persistent buffer, still one
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in placed.parameters())
    stats = rt.last_load
    assert stats["bytes"] == rt.host_bytes and stats["copy_s"] > 0 and stats["total_s"] >= stats["copy_s"]


def _storage_ref(t: torch.Tensor) -> int:
    return t.untyped_storage()._weak_ref()


async def test_evict_leaves_no_reference_to_the_device_buffer() -> None:
    host, spec = make(call=f"{__name__}:keep_tensor_then_fail")
    await host.prepare("m", spec)
    rt: TorchRuntime = host._services["m"].runtime
    await host.load("m", 0, 1)
    placed = rt.placed_module(host.gpus[0:1])
    ref = _storage_ref(rt._placed[(0,)].flat)
    with pytest.raises(Exception, match="kept"):  # the error's traceback must not hold the module
        await host.invoke("m", 0, 1, {}, timeout_s=10)
    kept = placed  # a caller that still holds the module object after the evict
    del placed
    await host.evict("m", 0, 1)
    try:
        assert torch.UntypedStorage._expired(ref), "something still holds the device buffer"
    finally:
        torch.UntypedStorage._free_weak_ref(ref)
    assert not list(kept.parameters())  # stripped: a module kept by a caller holds no device memory
    await host.load("m", 0, 1)  # and it restores again
    ref = _storage_ref(rt._placed[(0,)].flat)
    await host.aclose()
    try:
        assert torch.UntypedStorage._expired(ref)
    finally:
        torch.UntypedStorage._free_weak_ref(ref)
    assert rt._buffer is None and rt._host == {}


def keep_tensor_then_fail(module: torch.nn.Module, payload: dict, device: torch.device) -> dict:
    weight = module.fc1.weight  # a local that references the device buffer, in the traceback's frame
    raise RuntimeError(f"kept {tuple(weight.shape)}")
