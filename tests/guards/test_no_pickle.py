"""Guard: no pickle, cloudpickle, marshal, recv_pyobj, send_pyobj or eval in shipped code.

Unpickling bytes from a socket is remote code execution (docs/protocol.md, "Never pickle"). The scan
reads Python tokens, so comments and prose may name these things ("never pickle"), while code
may not: an import, an attribute, a call, or a string naming the module (`import_module("pickle")`).
`obj.eval()` (torch's `Module.eval`) is an attribute call and allowed; the builtin `eval` is not.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tangram", "tangram_cli", "agent")
BANNED = frozenset({"pickle", "cloudpickle", "marshal", "recv_pyobj", "send_pyobj", "dill"})


def _literal(token: str) -> object:
    try:
        return ast.literal_eval(token)
    except (ValueError, SyntaxError):  # f-strings and the like
        return None


def violations(source: str) -> list[str]:
    found: list[str] = []
    previous: tokenize.TokenInfo | None = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        where = f"line {tok.start[0]}"
        if tok.type == tokenize.NAME and tok.string in BANNED:
            found.append(f"{where}: {tok.string}")
        elif tok.type == tokenize.NAME and tok.string == "eval":
            if not (previous and previous.type == tokenize.OP and previous.string == "."):
                found.append(f"{where}: eval")
        elif tok.type == tokenize.STRING and _literal(tok.string) in BANNED:
            found.append(f"{where}: {tok.string}")
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = tok
    return found


def shipped_sources() -> list[Path]:
    files = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if not any(part in ("tests", "test", "testing") or part.startswith("test_") for part in parts):
                files.append(path)
    return files


def test_shipped_code_never_unpickles() -> None:
    files = shipped_sources()
    assert any(path.name == "protocol.py" for path in files), "the scan found no sources"
    bad = []
    for path in files:
        try:
            hits = violations(path.read_text(encoding="utf-8"))
        except (tokenize.TokenError, SyntaxError) as exc:  # a broken file is another test's failure
            hits = [f"could not tokenize: {exc}"]
        bad += [f"{path.relative_to(ROOT)} {hit}" for hit in hits]
    assert not bad, "pickle-like deserialisation is banned (docs/protocol.md):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\n",
        "import cloudpickle as cp\n",
        "from marshal import loads\n",
        "msg = sock.recv_pyobj()\n",
        "sock.send_pyobj(x)\n",
        "value = eval(text)\n",
        "f = eval\n",
        "mod = importlib.import_module('pickle')\n",
        'mod = __import__("marshal")\n',
        "getattr(sock, 'recv_pyobj')()\n",
        "x = pickle . loads(b)\n",
    ],
)
def test_scanner_catches(source: str) -> None:
    assert violations(source)


@pytest.mark.parametrize(
    "source",
    [
        "# never pickle: recv_pyobj is RCE\n",
        '"""Never pickle; no eval( either."""\n',
        "model.eval()\n",
        "value = ast.literal_eval(text)\n",
        "msg = 'do not unpickle this'\n",
        "picklelike = 1\n",
        "unmarshal_value = 2\n",
    ],
)
def test_scanner_allows(source: str) -> None:
    assert violations(source) == []
