"""External vLLM/SGLang runtime against a fake server on 127.0.0.1 (sleep/wake, release/resume, early return).

Only loopback traffic.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agent.gpu import EvictFailed, GpuHost, GpuInfo, PrepareFailed, ServiceSpec, emulated_gpus
from agent.gpu.external import ENDPOINTS, ExternalConfig, HttpError, http_json

pytestmark = pytest.mark.timeout(30)
AWAKE_MIB, ASLEEP_MIB = 6000, 500


class FakeServer:
    """Tracks sleep state; after a sleep the 'GPU memory' drops ``lag_s`` later (an early return)."""

    def __init__(self, kind: str, lag_s: float = 0.0) -> None:
        self.kind, self.lag_s = kind, lag_s
        self.sleeping = False
        self.freed_at = 0.0
        self.requests: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()

    def used_mib(self) -> int:
        with self.lock:
            if self.sleeping and time.monotonic() >= self.freed_at:
                return ASLEEP_MIB
            return AWAKE_MIB

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append((method, path, body))
            if path == "/health":
                return 200, {}
            if path == ENDPOINTS[self.kind]["sleep"]:
                if not self.sleeping:
                    self.sleeping, self.freed_at = True, time.monotonic() + self.lag_s
                return 200, {"ok": True}
            if path == ENDPOINTS[self.kind]["wake"]:
                self.sleeping = False
                return 200, {"ok": True}
            if path == "/v1/completions":
                if self.sleeping:
                    return 503, {"error": "server is sleeping"}
                return 200, {"model": body.get("model"), "choices": [{"text": body.get("prompt", "")[::-1]}]}
            return 404, {"error": f"no route {path}"}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[tuple[FakeServer, str]]:
    kind, lag = getattr(request, "param", ("vllm", 0.0))
    fake = FakeServer(kind, lag)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, out = fake.handle(method, self.path, json.loads(raw) if raw else None)
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply("GET")

        def do_POST(self) -> None:
            self._reply("POST")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def make_host(fake: FakeServer, url: str, **opts: Any) -> tuple[GpuHost, ServiceSpec]:
    def probe(g: GpuInfo) -> int | None:
        return fake.used_mib() if g.index == 0 else None

    spec = ServiceSpec("llm", fake.kind, "Qwen/Qwen3-0.6B", gpu_mem_mib=6000, weight_bytes=1_200_000_000,
                       options={"url": url, "poll_s": 0.02, **opts})
    host = GpuHost(emulated_gpus(2, 80 * 1024), {fake.kind: ExternalConfig(memory_probe=probe)})
    return host, spec


@pytest.mark.parametrize("server", [("vllm", 0.0), ("sglang", 0.0)], indirect=True)
async def test_prepare_sleeps_load_wakes_call_posts_evict_sleeps(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    host, spec = make_host(fake, url)
    await host.prepare("llm", spec)
    assert fake.sleeping  # a service starts evicted
    res = await host.load("llm", 0, 1)
    assert res.restored and res.bytes == 1_200_000_000 and not fake.sleeping
    out = await host.invoke("llm", 0, 1, {"prompt": "abc", "max_tokens": 4}, timeout_s=5)
    assert out == {"model": "Qwen/Qwen3-0.6B", "choices": [{"text": "cba"}]}
    await host.evict("llm", 0, 1)
    assert fake.sleeping and host.used_mib[0] == 0
    paths = [p for _, p, _ in fake.requests]
    sleep, wake = ENDPOINTS[fake.kind]["sleep"], ENDPOINTS[fake.kind]["wake"]
    assert paths == ["/health", sleep, wake, "/v1/completions", sleep]
    assert (sleep == "/sleep?level=1") == (fake.kind == "vllm")


@pytest.mark.parametrize("server", [("vllm", 0.3)], indirect=True)
async def test_evict_waits_until_memory_is_really_free(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    host, spec = make_host(fake, url)
    await host.prepare("llm", spec)
    await host.load("llm", 0, 1)
    t0 = time.monotonic()
    await host.evict("llm", 0, 1)
    assert time.monotonic() - t0 >= 0.3 * 0.9
    assert fake.used_mib() == ASLEEP_MIB


@pytest.mark.parametrize("server", [("sglang", 5.0)], indirect=True)
async def test_evict_that_never_frees_fails_and_stays_resident(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    host, spec = make_host(fake, url, free_wait_s=0.2)
    await host.prepare("llm", spec)
    await host.load("llm", 0, 1)
    with pytest.raises(EvictFailed, match="not released"):
        await host.evict("llm", 0, 1)
    assert host.facts()["gpus"][0]["resident"] == ["llm"] and host.used_mib[0] == 6000


async def test_unreachable_server_fails_prepare() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = ServiceSpec("llm", "vllm", "m", gpu_mem_mib=10, options={"url": f"http://127.0.0.1:{port}",
                                                                      "http_timeout_s": 2})
    host = GpuHost(emulated_gpus(1, 1024), {"vllm": ExternalConfig(memory_probe=lambda g: None)})
    with pytest.raises(PrepareFailed, match="not ready"):
        await host.prepare("llm", spec)


def test_http_errors_are_typed(server: tuple[FakeServer, str]) -> None:
    _, url = server
    with pytest.raises(HttpError) as err:
        http_json(url + "/nope", "POST", {})
    assert err.value.status == 404
    with pytest.raises(ValueError, match="http"):
        http_json("file:///etc/passwd")


@pytest.mark.parametrize("server", [("vllm", 0.0)], indirect=True)
async def test_per_chunk_urls(server: tuple[FakeServer, str]) -> None:
    fake, url = server
    host, spec = make_host(fake, url)
    spec = ServiceSpec("llm", "vllm", "m", gpu_mem_mib=100, options={"urls": {"0-2": url}, "poll_s": 0.01})
    await host.prepare("llm", spec)
    await host.load("llm", 0, 2)
    from agent.gpu import LoadFailed

    with pytest.raises(LoadFailed, match="no server configured"):
        await host.load("llm", 1, 2)
