"""Tangram: action-level resource management for agentic RL.

Rollout code imports this package for the client (`tangram.AsyncClient`, `tangram.Client`)
and its errors. The public names load lazily (PEP 562), so `import tangram` stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "AsyncClient": "tangram.client.aio",
    "Client": "tangram.client.sync",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        errors = __import__("tangram.errors", fromlist=["__all__"])
        if name in getattr(errors, "__all__", ()):
            return getattr(errors, name)
        raise AttributeError(f"module 'tangram' has no attribute {name!r}")

    return getattr(importlib.import_module(module), name)
