"""One log format for the controller, the node agents and the CLI (docs/operations.md, "Logs").

Stdlib only: the agent bundle ships this module. Two formats, chosen per process by ``--log-format``
(``tangram controller``, ``python -m agent``), ``log_format`` in ``agent.json``, or the environment
variable ``TANGRAM_LOG_FORMAT``, in that order; the default is ``text``:

text, one line a record (a traceback follows on its own lines)::

    2026-11-30T01:23:22.123Z INFO controller tangram.controller: controller local up: ...
    2026-11-30T01:23:24.456Z WARNING agent[n1] agent.link: cut off from the controller ...

json, one object a line (JSON lines)::

    {"ts": "2026-11-30T01:23:22.123Z", "level": "INFO", "source": "agent", "node": "n1",
     "logger": "agent.link", "pid": 4242, "msg": "...", "exc": "Traceback ..."}

``ts`` is UTC with milliseconds in both; ``node`` only for agents, ``exc`` only with a traceback.
``source`` is the process: ``controller``, ``agent`` (text: ``agent[NODE]``) or ``cli``.
``parse_line`` reads either format back (``tangram logs`` converts between them).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any

FORMATS = ("text", "json")
ENV_FORMAT = "TANGRAM_LOG_FORMAT"
ENV_LEVEL = "TANGRAM_LOG"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

TEXT_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<level>[A-Z]+) "
    r"(?P<source>[a-z]+)(?:\[(?P<node>[^\]]*)\])? (?P<logger>\S+): (?P<msg>.*)$"
)


def utc_stamp(created: float) -> str:
    """``2026-11-30T01:23:22.123Z`` for a ``time.time()`` value."""
    whole = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((created - whole) * 1000):03d}Z"


def choose_format(explicit: str | None = None) -> str:
    """``explicit`` (a flag or config value), else ``$TANGRAM_LOG_FORMAT``, else ``text``.

    ValueError for an unknown explicit value; an unknown value in the environment falls back to
    ``text`` (a typo there must not stop every command)."""
    if explicit:
        value = explicit.strip().lower()
        if value not in FORMATS:
            raise ValueError(f"log format {explicit!r}: expected one of {', '.join(FORMATS)}")
        return value
    value = os.environ.get(ENV_FORMAT, "").strip().lower()
    return value if value in FORMATS else "text"


class TextFormatter(logging.Formatter):
    def __init__(self, source: str, node: str = "") -> None:
        super().__init__()
        self.who = f"{source}[{node}]" if node else source

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{utc_stamp(record.created)} {record.levelname} {self.who} {record.name}: {record.getMessage()}"
        )
        extra = _trace(self, record)
        return f"{line}\n{extra}" if extra else line


class JsonFormatter(logging.Formatter):
    def __init__(self, source: str, node: str = "") -> None:
        super().__init__()
        self.source, self.node = source, node

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": utc_stamp(record.created),
            "level": record.levelname,
            "source": self.source,
        }
        if self.node:
            doc["node"] = self.node
        doc.update(logger=record.name, pid=record.process, msg=record.getMessage())
        extra = _trace(self, record)
        if extra:
            doc["exc"] = extra
        return json.dumps(doc, ensure_ascii=False, default=str)


def _trace(fmt: logging.Formatter, record: logging.LogRecord) -> str:
    parts = []
    if record.exc_info:
        record.exc_text = record.exc_text or fmt.formatException(record.exc_info)
    if record.exc_text:
        parts.append(record.exc_text)
    if record.stack_info:
        parts.append(fmt.formatStack(record.stack_info))
    return "\n".join(parts)


def formatter(source: str, node: str = "", fmt: str | None = None) -> logging.Formatter:
    return (JsonFormatter if choose_format(fmt) == "json" else TextFormatter)(source, node)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (a test runner may swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(
    source: str,
    *,
    node: str = "",
    fmt: str | None = None,
    level: str | int | None = None,
    path: str | None = None,
) -> logging.Handler:
    """Log every record of this process (the root logger) in the one format: to ``path``, else to
    stderr. Replaces a handler an earlier call installed and leaves other handlers alone.
    ``level``: a level name or number; None keeps the root's level."""
    handler: logging.Handler
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        handler = logging.FileHandler(path)
    else:
        handler = _Stderr()
    handler.setFormatter(formatter(source, node, fmt))
    handler._tangram = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_tangram", False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    if level is not None:
        root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def env_level(default: str) -> str:
    """``$TANGRAM_LOG`` when it names a level, else ``default``."""
    value = os.environ.get(ENV_LEVEL, "").strip().upper()
    return value if value in LEVELS else default


def configure_cli(verbose: int = 0) -> None:
    """The CLI's own records (``tangram.*`` loggers: the SSH bootstrap, ...) in the one format on
    stderr. ``$TANGRAM_LOG`` sets the level of every logger; else ``-v`` shows Tangram's INFO."""
    level = env_level("") or None
    configure("cli", level=level)
    if verbose and level is None:
        logging.getLogger("tangram").setLevel(logging.INFO)


def parse_line(line: str) -> dict[str, Any] | None:
    """A log line of either format as the JSON format's object; None for a line of neither (a
    traceback line, a process's own output)."""
    text = line.rstrip("\n")
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and "ts" in doc and "msg" in doc else None
    m = TEXT_LINE.match(text)
    if m is None:
        return None
    doc = {"ts": m["ts"], "level": m["level"], "source": m["source"]}
    if m["node"] is not None:
        doc["node"] = m["node"]
    doc.update(logger=m["logger"], msg=m["msg"])
    return doc


def render_text(doc: dict[str, Any]) -> str:
    """A parsed record (``parse_line``) in the text format."""
    who = f"{doc.get('source', '?')}[{doc['node']}]" if doc.get("node") else str(doc.get("source", "?"))
    line = f"{doc.get('ts', '')} {doc.get('level', '')} {who} {doc.get('logger', '')}: {doc.get('msg', '')}"
    return f"{line}\n{doc['exc']}" if doc.get("exc") else line
