"""The client library marks what it resends after a `Welcome` (protocol 1.8), and only to a
controller that reads the mark."""

from __future__ import annotations

import asyncio

import pytest
from support.fake_controller import FakeController

from tangram import protocol as p
from tangram.client.transport import Transport


@pytest.mark.parametrize("minor", [p.RESEND_MINOR, p.RESEND_MINOR - 1])
async def test_resends_after_a_restart_carry_the_flag_for_a_controller_that_reads_it(minor: int) -> None:
    ctl = FakeController()
    transport = Transport(ctl.addr, "marks", heartbeat_s=5.0)
    try:
        start = asyncio.ensure_future(transport.start())
        hello = await ctl.recv()
        await ctl.send(ctl.welcome(1, minor), hello.request_id)
        await start
        pending = transport.request(p.Cancel(target_request_id=3))
        first = await ctl.request()
        assert first.request_id == pending.request_id and first.resend is False
        await ctl.send(ctl.welcome(2, minor))  # a restarted controller
        env = await ctl.request()
        assert env.request_id == pending.request_id and transport.resent == 1
        assert env.resend is (minor >= p.RESEND_MINOR)
    finally:
        await transport.close()
        ctl.close()
