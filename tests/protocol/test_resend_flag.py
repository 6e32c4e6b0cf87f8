"""Frame 2's resend flag (protocol 1.8, `protocol.as_resend`)."""

from __future__ import annotations

import secrets

import pytest

from tangram import protocol as p
from tangram.errors import ProtocolError


def test_a_marked_request_decodes_with_its_token_and_the_flag() -> None:
    token = secrets.token_bytes(p.TOKEN_BYTES)
    frames = p.encode(p.Exec("sb-1", "true", 1, 1), 42, token=token)
    assert p.decode(frames).resend is False
    env = p.decode(p.as_resend(frames))
    assert (env.request_id, env.token, env.resend, env.msg) == (42, token, True, p.decode(frames).msg)
    assert p.decode(p.stamp(p.as_resend(frames), token)).resend is False  # a new stamp drops it
    assert p.as_resend(p.as_resend(frames)) == p.as_resend(frames)


def test_only_a_request_with_a_token_can_be_marked_and_only_with_the_known_flag() -> None:
    with pytest.raises(ValueError):
        p.as_resend(p.encode(p.Exec("sb-1", "true", 1, 1), 42))
    token = secrets.token_bytes(p.TOKEN_BYTES)
    frames = p.encode(p.Exec("sb-1", "true", 1, 1), 42, token=token)
    for flag in (0x00, 0x02, 0xFF):
        bad = [frames[0], frames[1], frames[2] + bytes((flag,)), *frames[3:]]
        with pytest.raises(ProtocolError, match="resend flag"):
            p.decode(bad)
