"""`tangram.Client`: the blocking facade over `AsyncClient`.

One background thread runs an event loop that owns every socket (pyzmq sockets are not
thread-safe); each method submits a coroutine to it and blocks only the calling thread, so a
`Client` can be shared by a thread pool. After `fork()` the child rebuilds its own loop
thread and connection on first use (the parent's sockets are never touched).

    with tangram.Client("tcp://127.0.0.1:7701") as tg:
        with tg.sandbox() as env:
            r = env.exec("python3 -c 'print(6*7)'", cpus=1, timeout=60)
        futs = [tg.submit(tg.call, "reward", {"text": t}) for t in texts]   # concurrent.futures
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from tangram.client.aio import ApiLease, AsyncClient, AsyncSandbox, CallResult, ExecResult, parse_mem
from tangram.errors import ControllerUnreachable

__all__ = ["Client", "Sandbox"]

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tangram-client-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking tangram.Client method was called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class Client:
    def __init__(
        self,
        addr: str | None = None,
        *,
        name: str | None = None,
        default_timeout: float | None = None,
        heartbeat_s: float = 1.0,
        connect_timeout: float = 10.0,
        certs: str | None = None,
        retry_later_s: float = 60.0,
        job: str | None = None,
    ) -> None:
        self._kwargs = {
            "name": name,
            "job": job,
            "default_timeout": default_timeout,
            "heartbeat_s": heartbeat_s,
            "connect_timeout": connect_timeout,
            "certs": certs,
            "retry_later_s": retry_later_s,
        }
        self._addr = addr
        self._lock = threading.Lock()
        self._loop: _LoopThread | None = None
        self._client: AsyncClient | None = None
        self._pid = os.getpid()
        self._closed = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_env(cls, **kwargs: Any) -> Client:
        return cls(None, **kwargs)

    # ------------------------------------------------------------ lifecycle
    def _ensure(self) -> tuple[_LoopThread, AsyncClient]:
        with self._lock:
            if self._pid != os.getpid():  # forked: never touch the parent's loop or sockets
                self._loop, self._client, self._pid = None, None, os.getpid()
            if self._closed:
                raise ControllerUnreachable("the client is closed")
            if self._loop is None:
                self._loop = _LoopThread()
            if self._client is None:
                loop = self._loop

                async def make() -> AsyncClient:
                    return await AsyncClient(self._addr, **self._kwargs).connect()  # type: ignore[arg-type]

                try:
                    self._client = loop.run(make())
                except BaseException:
                    loop.stop()
                    self._loop = None
                    raise
            return self._loop, self._client

    def connect(self) -> Client:
        self._ensure()
        return self

    def close(self) -> None:
        with self._lock:
            self._closed = True
            loop, client, self._loop, self._client = self._loop, self._client, None, None
            pool, self._pool = self._pool, None
            if self._pid != os.getpid():
                return
        if pool is not None:
            pool.shutdown(wait=True)
        if loop is not None:
            if client is not None:
                with contextlib.suppress(Exception):  # closing is best effort
                    loop.run(client.close())
            loop.stop()

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, make: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
        loop, client = self._ensure()
        return loop.run(make(client))

    # ------------------------------------------------------------ API
    def sandbox(
        self,
        image: str = "",
        mem: int | str | None = None,
        reserve: int = 0,
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Open a sandbox; use it as a context manager so it closes on exit."""
        mib = parse_mem(mem)
        sb = self._run(lambda c: c.open_sandbox(image, mib, reserve, timeout, labels))
        return Sandbox(self, sb)

    def call(
        self, service: str, payload: Any, gpus: int | list[int] = 1, timeout: float | None = None,
        elastic: str | None = None, total_timeout: float | None = None,
    ) -> CallResult:
        return self._run(lambda c: c.call(service, payload, gpus=gpus, timeout=timeout, elastic=elastic,
                                          total_timeout=total_timeout))

    def api(self, name: str, timeout: float | None = None, units: int = 1, tokens: int = 0) -> Lease:
        """`AsyncClient.api`, blocking: a context manager holding the lease (and, for an API
        with a key pool, its `key`)."""
        return Lease(self, name, timeout, units, tokens)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Run `fn(*args, **kwargs)` (e.g. `tg.call`, `env.exec`) on the client's worker pool and
        return a `concurrent.futures.Future` (fan-out without your own threads)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=64, thread_name_prefix="tangram-submit"
                )
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)


class Sandbox:
    def __init__(self, owner: Client, sandbox: AsyncSandbox) -> None:
        self._owner = owner
        self._sb = sandbox
        self.id = sandbox.id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def exec(
        self,
        cmd: str | Sequence[str],
        cpus: int | tuple[int, int] = 1,
        elastic: str | Mapping[int, float] | None = None,
        duration_hint: float | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = False,
        stdin: bytes | None = None,
        idempotent: bool = False,
        total_timeout: float | None = None,
    ) -> ExecResult:
        """`AsyncSandbox.exec`, blocking: `timeout` bounds the run, `total_timeout` the whole request."""
        return self._owner._run(
            lambda c: self._sb.exec(
                cmd,
                cpus=cpus,
                elastic=elastic,
                duration_hint=duration_hint,
                timeout=timeout,
                env=env,
                check=check,
                stdin=stdin,
                idempotent=idempotent,
                total_timeout=total_timeout,
            )
        )

    def put(self, path: str, data: bytes | str, timeout: float | None = None) -> None:
        self._owner._run(lambda c: self._sb.put(path, data, timeout=timeout))

    def get(self, path: str, timeout: float | None = None) -> bytes:
        return self._owner._run(lambda c: self._sb.get(path, timeout=timeout))

    def close(self) -> None:
        if not self._sb.closed:
            self._owner._run(lambda c: self._sb.close())

    def submit(self, cmd: str | Sequence[str], **kwargs: Any) -> concurrent.futures.Future[ExecResult]:
        loop, _ = self._owner._ensure()
        return loop.submit(self._sb.exec(cmd, **kwargs))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Lease:
    def __init__(self, owner: Client, api: str, timeout: float | None, units: int, tokens: int = 0) -> None:
        self._owner = owner
        self._args = (api, timeout, units, tokens)
        self._lease: ApiLease | None = None

    def __repr__(self) -> str:
        return f"Lease(api={self._args[0]!r}, key_name={self.key_name!r})"

    def __enter__(self) -> Lease:
        api, timeout, units, tokens = self._args
        self._lease = self._owner._run(
            lambda c: c.api(api, timeout=timeout, units=units, tokens=tokens).acquire()
        )
        return self

    @property
    def key(self) -> str:
        """The API key to call with (API key pools; "" otherwise)."""
        return self._lease.key if self._lease is not None else ""

    @property
    def key_name(self) -> str:
        return self._lease.key_name if self._lease is not None else ""

    def report(self, tokens: int | None = None, rate_limited: bool = False, reset_s: float = 0.0) -> None:
        """`ApiLease.report`: sent with the release."""
        if self._lease is not None:
            self._lease.report(tokens, rate_limited, reset_s)

    def __exit__(self, *exc: object) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            self._owner._run(lambda c: lease.release())
