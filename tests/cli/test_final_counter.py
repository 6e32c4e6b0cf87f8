"""The benches' count of final replies (tangram_cli/bench/burst.py, FinalCounter): a request
answered twice is a duplicate, unless it was resent and the second answer is the first again
(the replay of a restarted controller's reply cache, which the client library drops)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tangram import protocol as p
from tangram_cli.bench.burst import FinalCounter


@dataclass
class _Pending:
    request_id: int


class _Transport:
    """What FinalCounter wraps: request, _on_envelope, _on_welcome, _resend, _pending, _welcome."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = {}
        self._welcome = None
        self.next = 0

    def request(self) -> _Pending:
        self.next += 1
        self._pending[self.next] = _Pending(self.next)
        return self._pending[self.next]

    def _on_envelope(self, env: Any) -> None:
        self._pending.pop(env.request_id, None)

    def _on_welcome(self, msg: Any) -> None:
        pass

    def _resend(self) -> None:
        pass


def _final(rid: int, body: dict[str, Any]) -> p.Envelope:
    return p.Envelope(p.Result.TYPE, rid, p.Result(body))


def test_a_replay_after_a_resend_is_not_a_duplicate_but_a_second_answer_is() -> None:
    t = _Transport()
    c = FinalCounter(t)
    a, b, d = t.request().request_id, t.request().request_id, t.request().request_id
    t._on_welcome(p.Welcome(2, p.PROTOCOL_MINOR, 9))  # a restart: a and b and d are resent
    t._on_envelope(_final(a, {"x": 1}))
    t._on_envelope(_final(a, {"x": 1}))  # the reply cache's copy: a replay
    t._on_envelope(_final(b, {"x": 1}))
    t._on_envelope(_final(b, {"x": 2}))  # another answer: a duplicate
    e = t.request().request_id  # sent after the restart, never resent
    t._on_envelope(_final(e, {}))
    t._on_envelope(_final(e, {}))
    assert c.finals[a] == 2 and c.replays == {a: 1} and c.duplicates(a) == 0
    assert c.duplicates(b) == 1 and c.duplicates(e) == 1 and c.duplicates(d) == 0
    assert c.summary()["replayed_after_resend"] == 1
    assert a in c._first and e not in c._first  # only a resent request's finals are digested (cost)
