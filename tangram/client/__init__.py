"""The client library rollout code imports: `AsyncClient` (aio.py), `Client` (sync.py).

Depends only on pyzmq, msgpack and `tangram.protocol`/`tangram.errors`.
"""
