"""A stand-in for the controller's status socket: a ROUTER on 127.0.0.1 that answers every
`StatusReq` with fixed records (tests of `tangram status` and `tangram env` that need no cluster)."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from tangram import protocol


class FakeStatus:
    def __init__(self, records: dict[str, Any]) -> None:
        self.records = records
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            env = protocol.decode(frames)
            if isinstance(env.msg, protocol.StatusReq):
                reply = protocol.encode(protocol.Status(self.records), env.request_id)
                self.sock.send_multipart([ident, *reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close(0)
        self.ctx.term()
