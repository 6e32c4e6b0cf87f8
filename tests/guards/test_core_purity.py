"""The scheduling core must stay pure: no I/O, no clock, no global random (docs/architecture.md: the
core gets `now` as an argument and returns commands; the drivers do the I/O).

An AST walk over ``tangram/core/**`` (and the simulator's pure baselines) rejects imports of
modules that do I/O or read time, and calls of the module-level ``random`` functions.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = sorted((ROOT / "tangram" / "core").rglob("*.py")) + [
    p for p in [ROOT / "tangram" / "sim" / "baselines.py"] if p.exists()
]
FORBIDDEN = {
    "time", "datetime", "asyncio", "threading", "os", "sys", "socket", "subprocess", "zmq", "msgpack",
    "io", "pathlib", "shutil", "tempfile", "signal", "select", "selectors", "multiprocessing", "logging",
    "docker", "asyncssh", "pynvml", "urllib", "http", "requests", "secrets", "uuid",
}
FORBIDDEN_PACKAGES = (
    "tangram.client",
    "tangram.protocol",
    "tangram.wire_checks",
    "tangram.wire_messages",
    "tangram_cli",
    "agent",
    "tangram.sim.engine",
)


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == "random" and any(a.name != "Random" for a in node.names):
                bad.append(f"{path.name}:{node.lineno}: only `from random import Random` is allowed")
        else:
            io_call = ("open", "print", "input", "eval")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in io_call:
                bad.append(f"{path.name}:{node.lineno}: {node.func.id}() does I/O")
            continue
        for name in names:
            top = name.split(".")[0]
            if top in FORBIDDEN or (top == "random" and isinstance(node, ast.Import)):
                bad.append(f"{path.name}:{node.lineno}: imports {name}")
            if any(name == p or name.startswith(p + ".") for p in FORBIDDEN_PACKAGES):
                bad.append(f"{path.name}:{node.lineno}: imports {name}")
    return bad


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_is_pure(path: Path) -> None:
    assert _violations(path) == []


def test_guard_catches_an_impure_module(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nimport random\nfrom random import random as r\nprint(1)\n")
    found = _violations(bad)
    assert len(found) == 4, found
