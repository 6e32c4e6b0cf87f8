"""Tiny deterministic services for the emulated runtime (``model = "agent.gpu.demo_services:reward"``).

Each takes a payload dict and returns a result dict; none touches a GPU or the network.
"""
from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Any

_WORD = re.compile(r"[A-Za-z0-9_]+")
MAX_SLEEP_S = 60.0


def _words(text: Any) -> list[str]:
    return _WORD.findall(str(text).lower())


def _unit(seed: str) -> float:
    """A stable number in [0, 1) from a string."""
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") / 2**64


def reward(payload: dict[str, Any]) -> dict[str, Any]:
    """Score a response: token F1 against ``reference`` when given, else a stable hash score.

    Payload: ``{"response": str, "reference": str (optional)}`` -> ``{"score": float in [0, 1]}``.
    """
    text, reference = payload.get("response", ""), payload.get("reference")
    if not isinstance(text, str) or not isinstance(reference, str | None):
        raise TypeError("response and reference must be strings")
    response = _words(text)
    if reference is None:
        return {"score": round(_unit(" ".join(response)), 6), "method": "hash"}
    ref = _words(reference)
    if not response or not ref:
        return {"score": 0.0, "method": "f1"}
    common = sum(min(response.count(w), ref.count(w)) for w in set(response))
    if common == 0:
        return {"score": 0.0, "method": "f1"}
    precision, recall = common / len(response), common / len(ref)
    return {"score": round(2 * precision * recall / (precision + recall), 6), "method": "f1"}


def teacher_logprobs(payload: dict[str, Any]) -> dict[str, Any]:
    """Per-token log-probabilities from a pretend teacher (stable per token and its predecessor).

    Payload: ``{"tokens": [str | int, ...]}`` -> ``{"logprobs": [float, ...], "sum": float}``.
    """
    tokens = [str(t) for t in payload.get("tokens", [])]
    out = []
    prev = "<s>"
    for tok in tokens:
        p = 0.02 + 0.96 * _unit(prev + "\x00" + tok)
        out.append(round(math.log(p), 6))
        prev = tok
    return {"logprobs": out, "sum": round(sum(out), 6)}


def echo(payload: dict[str, Any]) -> dict[str, Any]:
    """Returns the payload; sleeps ``sleep_s`` first (capped at 60 s) to model a slow call."""
    sleep_s = float(payload.get("sleep_s", 0.0))
    if sleep_s > 0:
        time.sleep(min(sleep_s, MAX_SLEEP_S))
    return {"echo": payload}


def fail(payload: dict[str, Any]) -> dict[str, Any]:
    """Always raises (shows how service errors travel)."""
    raise ValueError(f"demo failure: {payload.get('message', 'no message')}")


# ---- torch demo factories (``spec.model = "agent.gpu.demo_services:tiny_mlp"``); torch imported lazily


def tiny_mlp(in_features: int = 4, hidden: int = 8, out_features: int = 2, seed: int = 0) -> Any:
    """A small deterministic MLP (with a non-persistent buffer, to prove those survive a restore)."""
    import torch  # optional (the gpu extra): only the torch demo modules need it

    gen = torch.Generator().manual_seed(seed)

    class TinyMlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(in_features, hidden)
            self.fc2 = torch.nn.Linear(hidden, out_features)
            self.register_buffer("scale", torch.tensor(2.0), persistent=False)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))

        def forward(self, x: Any) -> Any:
            return self.fc2(torch.relu(self.fc1(x))) * self.scale

    return TinyMlp()


def blob(mib: int = 64, tensors: int = 8, dtype: str = "bfloat16") -> Any:
    """A module of ``tensors`` parameters totalling ``mib`` MiB (restore-bandwidth tests); forward sums."""
    import torch  # optional (the gpu extra), as above

    dt = getattr(torch, dtype)
    per = max(1, (mib << 20) // tensors // torch.empty((), dtype=dt).element_size())

    class Blob(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chunks = torch.nn.ParameterList(
                torch.nn.Parameter(torch.full((per,), 0.5, dtype=dt), requires_grad=False)
                for _ in range(tensors)
            )

        def forward(self, x: Any) -> Any:
            return x + sum(float(c[:16].float().sum()) for c in self.chunks)

    return Blob()
