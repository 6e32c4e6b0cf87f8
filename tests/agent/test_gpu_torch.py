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
