"""Batches (protocol rule 7): several messages in one, each item checked as a message of its own."""

from __future__ import annotations

import msgpack
import pytest

from tangram import protocol as p
from tangram.errors import ProtocolError

TOKEN = bytes(range(p.TOKEN_BYTES))


def _items() -> list[list[bytes]]:
    return [
        p.encode(p.Result({"exit_code": 0}), 5, [b"", b"out"]),
        p.encode(p.Error("BAD_REQUEST", "no", False), 7, [b"blob"]),
        p.encode(p.Heartbeat(), 0),
        p.encode(p.Exec("sb-1", "true", 1, 1), 9, token=TOKEN),
    ]


def test_a_batch_decodes_to_each_message_with_its_blobs_and_the_batch_token() -> None:
    items = _items()
    (message,) = p.pack(items, TOKEN)
    assert p.is_batch(message) and len(message) == 5  # five frames however many items
    got = p.decode_all(message)
    want = [p.decode(f) for f in items]
    assert [(e.type, e.request_id, e.msg, e.blobs) for e in got] == [  # type: ignore[union-attr]
        (w.type, w.request_id, w.msg, w.blobs) for w in want
    ]
    assert {e.token for e in got} == {TOKEN}  # type: ignore[union-attr]


def test_a_lone_item_goes_as_it_is_and_decode_all_reads_a_plain_message() -> None:
    one = p.encode(p.Heartbeat(), 0)
    assert p.pack([one]) == [one]
    (env,) = p.decode_all(one)
    assert isinstance(env, p.Envelope) and isinstance(env.msg, p.Heartbeat)


def test_chunks_keep_the_count_and_body_limits() -> None:
    items = [p.encode(p.Heartbeat(), 0) for _ in range(p.BATCH_MAX * 2 + 3)]
    runs = p.chunks(items)
    assert [len(r) for r in runs] == [p.BATCH_MAX, p.BATCH_MAX, 3]
    assert [len(r) for r in p.chunks(items[:10], most=4)] == [4, 4, 2]
    big = p.encode(p.Result({f"k{i}": "y" * 60_000 for i in range(15)}), 1)  # 0.9 MB of body
    assert [len(r) for r in p.chunks([big, big, big])] == [2, 1]  # bodies over BATCH_BODY_BYTES split
    assert sum(len(m) for m in p.pack(items)) == 3 * 5


def _body(items: list[list[object]]) -> bytes:
    return msgpack.packb(items)


def _frames(body: bytes, data: bytes = b"", rid: bytes = b"\0" * 8) -> list[bytes]:
    return [p.TAG, bytes((p.BATCH,)), rid, body, data]


def test_a_bad_item_is_answered_alone_and_the_others_stand() -> None:
    good = [p.Result.TYPE, 3, {"body": {}}, []]
    bad_field = [p.Exec.TYPE, 4, {"sandbox": "sb", "cmd": "true", "dop": "one", "units": 1}, []]
    hello = [p.Hello.TYPE, 5, {"role": "client", "name": "x", "major": 1, "minor": 5}, []]
    unknown = [0xEE, 6, {}, []]
    got = p.decode_all(_frames(_body([good, bad_field, hello, unknown])))
    assert isinstance(got[0], p.Envelope) and got[0].request_id == 3
    assert [type(e).__name__ for e in got[1:]] == ["BadItem"] * 3
    assert [e.request_id for e in got[1:]] == [4, 5, 6]
    assert "cannot travel in a batch" in str(got[2].error)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "frames, says",
    [
        (_frames(_body([[8, 1, {"body": {}}, [3]]]), b"ab"), "bytes of blobs"),  # sizes do not add up
        (_frames(_body([[8, 1, {"body": {}}, []]]), rid=b"\0" * 7 + b"\1"), "request id is 0"),
        (_frames(_body([[8, 1, {"body": {}}]])), "expected [type"),  # an item of three fields
        (_frames(_body([[8, -1, {"body": {}}, []]])), "expected [type"),
        (
            _frames(_body([[8, 1, {"body": {}}, [1] * (p.MAX_BLOBS + 1)]]), b"x" * (p.MAX_BLOBS + 1)),
            "expected",
        ),
        (_frames(_body([])), "1 to"),
        (_frames(_body([[4, 0, {}, []]] * (p.BATCH_MAX + 1))), "1 to"),
        (_frames(b"\xc1"), "batch body"),  # not msgpack
        (_frames(_body([[4, 0, {}, []]]))[:4], "5 frames"),
        ([b"TGR2", bytes((p.BATCH,)), b"\0" * 8, _body([[4, 0, {}, []]]), b""], "protocol 2"),
    ],
)
def test_a_broken_batch_is_refused_whole(frames: list[bytes], says: str) -> None:
    with pytest.raises(ProtocolError) as err:
        p.decode_all(frames)
    assert says in str(err.value)


def test_a_batch_body_over_the_limit_is_refused() -> None:
    body = _body([[4, 0, {"load": {"x": "y" * (1 << 20)}}, []], [4, 0, {"load": {"x": "y" * (1 << 20)}}, []]])
    with pytest.raises(ProtocolError) as err:
        p.decode_all(_frames(body))
    assert "batch body over" in str(err.value)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1])
def test_a_batch_writes_ints_as_msgpack_does(value: int) -> None:
    assert p._msgpack_uint(value) == msgpack.packb(value)
    assert p._msgpack_uints([value] * p.MAX_BLOBS) == msgpack.packb([value] * p.MAX_BLOBS)
    assert p.MAX_BLOBS < 16  # the blob sizes are a fixarray
