"""External inference servers (vLLM, SGLang) driven through their offload endpoints, stdlib HTTP only.

* vLLM (started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``): evict = ``POST /sleep?level=1``
  (weights to CPU memory, KV cache dropped), load = ``POST /wake_up``
  (https://docs.vllm.ai/en/latest/features/sleep_mode/).
* SGLang (``--enable-memory-saver``): evict = ``POST /release_memory_occupation``, load =
  ``POST /resume_memory_occupation`` (``sgl-project/sglang:python/sglang/srt/entrypoints/http_server.py``).
* The server *is* the host backup: ``prepare`` checks ``GET /health`` on each server and puts it to sleep,
  so a service starts evicted. After every evict NVML is polled (bounded by ``free_wait_s``) until the
  GPUs' used memory has dropped by ``release_mib`` (default half of ``gpu_mem_mib``), because a release can
  return before the memory is free (THUDM/slime#579); a timeout raises :class:`EvictFailed` and the host
  keeps the service resident.
* ``call`` posts the payload as JSON to ``options["endpoint"]`` (default ``/v1/completions``; ``model`` is
  filled in from ``spec.model`` when missing) and returns the JSON reply.

Options: ``url`` (one server for every chunk) or ``urls`` (``{"start-end": url}``), ``endpoint``,
``http_timeout_s`` (30), ``free_wait_s`` (30), ``release_mib``, ``poll_s`` (0.1).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .base import EvictFailed, GpuInfo, LoadFailed, LoadResult, PrepareFailed, ServiceSpec
from .nvml import device_memory

MAX_REPLY_BYTES = 64 << 20

ENDPOINTS = {
    "vllm": {"sleep": "/sleep?level=1", "wake": "/wake_up"},
    "sglang": {"sleep": "/release_memory_occupation", "wake": "/resume_memory_occupation"},
}

MemoryProbe = Callable[[GpuInfo], "int | None"]


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def http_json(url: str, method: str = "GET", body: Any = None, timeout_s: float = 30.0) -> Any:
    """One HTTP request (no proxies, bounded reply); JSON in and out; ``HttpError`` for non-2xx."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL, got {url!r}")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read(MAX_REPLY_BYTES + 1)
        if len(raw) > MAX_REPLY_BYTES:
            raise HttpError(resp.status, f"reply larger than {MAX_REPLY_BYTES} bytes")
        text = raw.decode(errors="replace")
        if not 200 <= resp.status < 300:
            raise HttpError(resp.status, text)
        return json.loads(text) if text.strip() else {}
    finally:
        conn.close()


@dataclass(frozen=True)
class ExternalConfig:
    """Factory for :class:`ExternalRuntime`; ``memory_probe`` defaults to NVML by UUID."""

    memory_probe: MemoryProbe | None = None

    def __call__(self, spec: ServiceSpec) -> ExternalRuntime:
        return ExternalRuntime(spec, self.memory_probe)


class ExternalRuntime:
    def __init__(self, spec: ServiceSpec, memory_probe: MemoryProbe | None = None) -> None:
        if spec.runtime not in ENDPOINTS:
            raise ValueError(f"external runtime handles {sorted(ENDPOINTS)}, not {spec.runtime!r}")
        opts = spec.options
        if not opts.get("url") and not opts.get("urls"):
            raise ValueError(f"service {spec.name}: options need 'url' or 'urls' (the server's base URL)")
        self.spec = spec
        self.paths = ENDPOINTS[spec.runtime]
        self.endpoint = str(opts.get("endpoint", "/v1/completions"))
        self.http_timeout_s = float(opts.get("http_timeout_s", 30.0))
        self.free_wait_s = float(opts.get("free_wait_s", 30.0))
        self.poll_s = float(opts.get("poll_s", 0.1))
        self.release_mib = int(opts.get("release_mib", spec.gpu_mem_mib // 2))
        if memory_probe is None:
            memory_probe = device_memory
        self.memory_probe = memory_probe
        self._awake: set[tuple[int, ...]] = set()

    def url_for(self, gpus: Sequence[GpuInfo] | None) -> str:
        urls = self.spec.options.get("urls")
        if urls and gpus is not None:
            start, end = gpus[0].index, gpus[-1].index + 1
            for key in (f"{start}-{end}", str(start)):
                if key in urls:
                    return str(urls[key]).rstrip("/")
            raise LoadFailed(f"service {self.spec.name}: no server configured for GPUs [{start}, {end})",
                             hint="add it to options['urls'] as 'start-end': url")
        return str(self.spec.options.get("url") or next(iter(urls.values()))).rstrip("/")

    def _all_urls(self) -> list[str]:
        urls = self.spec.options.get("urls")
        return sorted({str(u).rstrip("/") for u in urls.values()}) if urls else [self.url_for(None)]

    async def _post(self, url: str, body: Any = None) -> Any:
        body = {} if body is None else body
        return await asyncio.to_thread(http_json, url, "POST", body, self.http_timeout_s)

    async def prepare(self) -> int:
        for base in self._all_urls():
            try:
                await asyncio.to_thread(http_json, base + "/health", "GET", None, self.http_timeout_s)
                await self._post(base + self.paths["sleep"])
            except Exception as exc:
                raise PrepareFailed(f"service {self.spec.name}: server {base} is not ready: {exc}") from exc
        return 0  # the backup lives in the server's own process

    async def load(self, gpus: Sequence[GpuInfo]) -> LoadResult:
        base = self.url_for(gpus)
        if _key(gpus) in self._awake:
            return LoadResult(0.0, self.spec.restore_bytes, restored=False)
        t0 = time.perf_counter()
        await self._post(base + self.paths["wake"])
        self._awake.add(_key(gpus))
        return LoadResult(time.perf_counter() - t0, self.spec.restore_bytes)

    async def evict(self, gpus: Sequence[GpuInfo]) -> None:
        base = self.url_for(gpus)
        awake = _key(gpus) in self._awake
        before = [self.memory_probe(g) for g in gpus] if awake else []
        await self._post(base + self.paths["sleep"])  # also after a failed wake: sleeping twice is harmless
        self._awake.discard(_key(gpus))
        if awake:
            await self._wait_free(gpus, before)

    async def _wait_free(self, gpus: Sequence[GpuInfo], before: list[int | None]) -> None:
        """Poll until each GPU's used memory fell by ``release_mib`` (GPUs without a reading are skipped)."""
        deadline = time.monotonic() + self.free_wait_s
        while True:
            now = [self.memory_probe(g) for g in gpus]
            pending = [
                (g.index, b, n) for g, b, n in zip(gpus, before, now, strict=True)
                if b is not None and n is not None and n > b - self.release_mib
            ]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise EvictFailed(
                    f"service {self.spec.name}: memory not released after {self.free_wait_s:g} s "
                    f"(gpu, before MiB, now MiB): {pending}"
                )
            await asyncio.sleep(self.poll_s)

    async def call(self, gpus: Sequence[GpuInfo], payload: dict[str, Any]) -> dict[str, Any]:
        body = dict(payload)
        if self.endpoint.startswith("/v1/"):
            body.setdefault("model", self.spec.model)
        reply = await asyncio.to_thread(http_json, self.url_for(gpus) + self.endpoint, "POST", body,
                                        self.http_timeout_s)
        return reply if isinstance(reply, dict) else {"result": reply}

    async def close(self) -> None:
        self._awake.clear()


def _key(gpus: Sequence[GpuInfo]) -> tuple[int, ...]:
    return tuple(g.index for g in gpus)
