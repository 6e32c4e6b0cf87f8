"""Canonical JSONL journal of a driver's decisions: what the core saw and what it said.

Line 1 is a header ``{"journal": "tangram", "version": 1, ...meta}``; every later line is
one handled event::

    {"commands": [{"type": "Spawn", ...}], "event": {"type": "ActionSubmitted", ...}, "seq": 7, "t": 12.5}

Encoding is canonical so two runs can be compared byte for byte: keys sorted, no spaces,
dataclasses as ``{"type": ClassName, field: value, ...}`` (nested ones too), enums by value,
tuples and lists as lists, floats rounded to 9 significant digits. The simulator and the
live controller write the same format; ``diff`` finds the first record where two differ.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

VERSION = 1
_DIGITS = 9
_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _num(x: float) -> float | int | str:
    if math.isnan(x) or math.isinf(x):
        return repr(x)
    return float(f"{x:.{_DIGITS}g}")


def encode(obj: Any) -> Any:
    """A JSON-ready canonical form of ``obj`` (dataclasses, enums, tuples, floats)."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj.value if isinstance(obj, enum.Enum) else obj
    if isinstance(obj, float):
        return _num(obj)
    if isinstance(obj, enum.Enum):
        return encode(obj.value)
    if isinstance(obj, (tuple, list)):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {"type": type(obj).__name__}
        for name in _fields(type(obj)):
            out[name] = encode(getattr(obj, name))
        return out
    raise TypeError(f"cannot journal {type(obj).__name__}: {obj!r}")


def dumps(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def record(t: float, seq: int, event: Any, commands: Sequence[Any]) -> dict[str, Any]:
    return {"t": _num(t), "seq": seq, "event": encode(event), "commands": [encode(c) for c in commands]}


class Journal:
    """Appends records to a text stream (a file) or, with no stream, to ``lines`` in memory."""

    def __init__(self, stream: IO[str] | None = None, **meta: Any) -> None:
        self.stream = stream
        self.lines: list[str] = []
        self.seq = 0
        self._write(dumps({"journal": "tangram", "version": VERSION, **encode(meta)}))

    @classmethod
    def to_path(cls, path: str | Path, *, append: bool = False, **meta: Any) -> Journal:
        """A journal written to ``path``; ``append`` keeps what is there (a live controller:
        each start adds a header line and its records after the previous run's)."""
        return cls(open(path, "a" if append else "w", encoding="ascii", newline="\n"), **meta)

    def _write(self, line: str) -> None:
        if self.stream is None:
            self.lines.append(line)
        else:
            self.stream.write(line + "\n")

    def append(self, t: float, event: Any, commands: Sequence[Any]) -> None:
        self.seq += 1
        self._write(dumps(record(t, self.seq, event, commands)))

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    def flush(self) -> None:
        """Hand buffered records to the OS (a file stream); nothing for an in-memory journal."""
        if self.stream is not None:
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def read(source: str | Path | Iterable[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, records) from a path or from lines; of the last run when a restarted
    controller appended several (a header line each)."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="ascii") as f:
            lines = [line for line in f.read().splitlines() if line]
    else:
        lines = [line for line in source if line.strip()]
    if not lines:
        raise ValueError("empty journal: no header line")
    header = json.loads(lines[0])
    if header.get("journal") != "tangram":
        raise ValueError('not a tangram journal: the first line has no "journal": "tangram"')
    docs = [json.loads(line) for line in lines[1:]]
    last = max((i for i, d in enumerate(docs) if d.get("journal") == "tangram"), default=-1)
    if last >= 0:  # a live controller's file holds one run per start: the last one
        header, docs = docs[last], docs[last + 1 :]
    return header, docs


@dataclass(frozen=True)
class Difference:
    index: int  # 0-based record index (the header is not counted)
    a: dict[str, Any] | None
    b: dict[str, Any] | None


def _iter(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any] | None]:
    yield from records
    while True:
        yield None


def diff(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]]) -> Difference | None:
    """The first record where ``a`` and ``b`` differ (None if equal; a missing one is None)."""
    ia, ib = _iter(a), _iter(b)
    i = 0
    while True:
        ra, rb = next(ia), next(ib)
        if ra is None and rb is None:
            return None
        if ra != rb:
            return Difference(i, ra, rb)
        i += 1
