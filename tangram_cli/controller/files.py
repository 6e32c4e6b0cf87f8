"""Files a client puts into or gets from a sandbox (`PUT`, `GET`): a mixin of `Gateway`.

Before a sandbox's first exec it has no node: what is put is kept by the controller (at most
`MAX_PENDING_PUT_BYTES` per sandbox, charged to the client: `holds.py`) and handed to the agent
when the sandbox is created; a get of such a file is answered from what is kept. Once placed,
each request goes to the sandbox's agent (`AgentLink.file_request`) and is answered with its
reply; a lost node is `SANDBOX_LOST`."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from tangram import protocol
from tangram.errors import BadRequest, NodeLost, SandboxLost, TangramError
from tangram_cli.controller.replies import ClientState

MAX_PENDING_PUT_BYTES = 64 << 20


class FileRequests:
    """Mixed into `Gateway` (which provides the attributes below)."""

    agents: Any
    _own_sandbox: Callable[..., Any]
    _register: Callable[..., None]
    _charge: Callable[[bytes, int], None]
    _uncharge: Callable[[bytes, int], None]
    _charge_puts: Callable[[str, bytes, int], None]
    _spawn_task: Callable[[Coroutine[Any, Any, None]], None]
    final: Callable[..., None]
    fail: Callable[..., None]

    def _on_put(self, client: ClientState, rid: int, msg: protocol.Put, blobs: tuple[bytes, ...]) -> None:
        rec = self._own_sandbox(client, msg.sandbox)
        self._register(client, rid, "put")
        data = blobs[0]
        if not rec.node:
            if rec.pending_bytes + len(data) > MAX_PENDING_PUT_BYTES:
                raise BadRequest(
                    f"more than {MAX_PENDING_PUT_BYTES >> 20} MiB put before the sandbox's first exec"
                )
            rec.pending_puts = [(p, d) for p, d in rec.pending_puts if p != msg.path]
            rec.pending_puts.append((msg.path, data))
            rec.pending_bytes = sum(len(d) for _, d in rec.pending_puts)
            self._charge_puts(msg.sandbox, client.ident, rec.pending_bytes)  # held until placed or closed
            self.final(client.ident, rid, protocol.Result({"queued": True, "size": len(data)}))
            return
        self._charge(client.ident, len(data))  # held until the agent answers
        self._spawn_task(
            self._file(
                client.ident, rid, msg.sandbox, protocol.PutFile(msg.sandbox, msg.path), [data], len(data)
            )
        )

    def _on_get(self, client: ClientState, rid: int, msg: protocol.Get, blobs: tuple[bytes, ...]) -> None:
        rec = self._own_sandbox(client, msg.sandbox)
        self._register(client, rid, "get")
        if not rec.node:
            for path, data in reversed(rec.pending_puts):
                if path == msg.path:
                    self.final(client.ident, rid, protocol.Result({"size": len(data)}), [data])
                    return
            raise BadRequest(f"{msg.path}: no such file (the sandbox has not run anything yet)")
        self._spawn_task(
            self._file(client.ident, rid, msg.sandbox, protocol.GetFile(msg.sandbox, msg.path), [])
        )

    async def _file(
        self, ident: bytes, rid: int, sandbox: str, msg: protocol.Message, blobs: list[bytes], held: int = 0
    ) -> None:
        try:
            env = await self.agents.file_request(sandbox, msg, blobs)
        except NodeLost as exc:
            self.fail(ident, rid, SandboxLost(f"sandbox {sandbox}: {exc}"))
            return
        except TangramError as exc:
            self.fail(ident, rid, exc)
            return
        finally:
            if held:
                self._uncharge(ident, held)
        if isinstance(env.msg, protocol.Error):
            self.final(ident, rid, env.msg)
        else:
            assert isinstance(env.msg, protocol.Result)
            self.final(ident, rid, protocol.Result(dict(env.msg.body)), list(env.blobs[:1]))
