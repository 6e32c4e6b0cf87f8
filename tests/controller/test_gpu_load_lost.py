"""A call whose `Load` fails because its node's connection dropped is answered NODE_LOST
(retryable), like any action on a lost node; a load the agent refused stays INTERNAL
(tangram_cli/controller/agent_gpu.py). Seen in the Docker chaos bench's agent-restart trials."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tangram import protocol
from tangram.core import commands as cmd
from tangram.errors import NodeLost
from tangram_cli.controller.agent_gpu import GpuCommands
from tangram_cli.controller.state import ActionRecord


class _Link(GpuCommands):
    """The attributes GpuCommands uses; `request` answers a Load as `load_reply` says."""

    def __init__(self, load_reply: Any) -> None:
        self.agents: dict[str, Any] = {}
        self.epoch = 1
        self.posted: list[Any] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.load_reply = load_reply
        self.clock = type("C", (), {"now": staticmethod(lambda: 0.0)})()

    def post(self, event: Any, after: Any = None) -> None:
        self.posted.append(event)

    def _spawn_task(self, coro: Any) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    def request(self, node: str, msg: protocol.Message, blobs: Any = ()) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if isinstance(msg, protocol.Load):
            if isinstance(self.load_reply, BaseException):
                fut.set_exception(self.load_reply)
            else:
                fut.set_result(protocol.Envelope(protocol.Error.TYPE, 1, self.load_reply))
        else:
            fut.set_exception(AssertionError("no Invoke may be sent after a failed load"))
        return fut


@pytest.mark.parametrize(
    ("reply", "code", "retryable"),
    [
        (NodeLost("node n1: message could not be delivered"), "NODE_LOST", True),
        (protocol.Error("GPU_OOM", "out of memory", False), "INTERNAL", False),
    ],
)
async def test_a_call_whose_load_failed_gets_the_right_error(reply: Any, code: str, retryable: bool) -> None:
    link = _Link(reply)
    rec = ActionRecord("c1", "call", b"client", 7, "k", 0.0, 60.0, service="s", payload=b"\x80")
    load = link.load(cmd.Load("n1", "s", 0, 1))
    link.invoke(cmd.Invoke("c1", "n1", "s", 0, 1), rec, load)
    await asyncio.wait_for(asyncio.gather(*link.tasks), 5)
    assert rec.outcome is not None and rec.outcome.error is not None
    assert (rec.outcome.error.code, rec.outcome.error.retryable) == (code, retryable)
    finished = [e for e in link.posted if type(e).__name__ == "ActionFinished"]
    assert len(finished) == 1 and not finished[0].ok
