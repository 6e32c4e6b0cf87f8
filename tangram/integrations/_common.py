"""What the framework adapters share: their options, a task's files and tests, the elastic test run
that gives the reward, and the text a command's result becomes for the model.

Pure Python on top of the client: nothing here imports a framework, pydantic or numpy.

Options (the framework's tool/env configuration; flat, so a YAML section maps onto it):

    addr              controller submit address; None: $TANGRAM_ADDR, then the local cluster
    client_name       the name the client shows in `tangram status`
    connect_timeout   seconds to wait for the controller's HELLO answer (default 10)
    image, mem        of each sandbox (as in `AsyncClient.sandbox`; "" / None: the agent's default)
    cpus, timeout     of each command the model runs (default 1 core, 60 s)
    max_output_chars  the model sees at most this much of a command's output (head and tail kept)
    test_command      the test run that gives the reward; `{dop}` becomes the granted core count
    test_cpus         [min, max] cores of the test run (default [1, 8])
    test_elastic      its scaling: a profile name (default "pytest") or a {cores: efficiency} table
    test_duration_hint, test_timeout
    reward            "exit_code" (1.0 when the tests exit 0, else 0.0) or "pytest" (the passed
                      fraction of the last "N passed, M failed" summary line, else as exit_code)

A task (per sample: verl's create_kwargs, SkyRL's extras) may carry `files` ({path: text}) put into
the sandbox before its first command, and its own `test_command`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tangram.errors import ActionTimeout, ConfigError

__all__ = ["Options", "Task", "TestRun", "exec_metrics", "plain", "render", "render_timeout", "score"]

REWARD_MODES = ("exit_code", "pytest")
_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?)\b")


def plain(value: Any) -> Any:
    """`value` as plain dicts, lists and scalars (an OmegaConf DictConfig/ListConfig or a dataclass
    becomes what it holds), so adapters read every framework's configuration the same way."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return [plain(v) for v in value]
    return value


def _number(raw: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key} must be a positive number of seconds, got {value!r}")
    return float(value)


def _cpus(value: Any, key: str) -> int | tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        lo, hi = value
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            return (lo, hi)
    raise ConfigError(f"{key} must be a core count or [min, max], got {value!r}")


def _elastic(value: Any) -> str | dict[int, float] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        try:
            return {int(k): float(v) for k, v in value.items()}
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"test_elastic must be a profile name or a {{cores: efficiency}} table, got {value!r}")


@dataclass(frozen=True)
class TestRun:
    """The elastic test run whose outcome is the reward."""

    command: str
    cpus: int | tuple[int, int] = (1, 8)
    elastic: str | dict[int, float] | None = "pytest"
    duration_hint: float | None = None
    timeout: float = 600.0
    reward: str = "exit_code"

    def exec_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `sandbox.exec` (async and blocking take the same)."""
        return {
            "cpus": self.cpus,
            "elastic": self.elastic,
            "duration_hint": self.duration_hint,
            "timeout": self.timeout,
        }


@dataclass(frozen=True)
class Options:
    addr: str | None = None
    client_name: str = "tangram-adapter"
    connect_timeout: float = 10.0
    image: str = ""
    mem: int | str | None = None
    cpus: int | tuple[int, int] = 1
    timeout: float = 60.0
    max_output_chars: int = 8000
    test: TestRun | None = None

    KEYS = (
        "addr", "client_name", "connect_timeout", "image", "mem", "cpus", "timeout", "max_output_chars",
        "test_command", "test_cpus", "test_elastic", "test_duration_hint", "test_timeout", "reward",
    )  # fmt: skip

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, default_name: str) -> Options:
        """Options from a framework's configuration; an unknown key is an error (a typo would
        otherwise be ignored silently)."""
        raw = plain(raw)
        unknown = sorted(set(raw) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"unknown Tangram adapter option(s) {unknown}; known: {list(cls.KEYS)}")
        limit = raw.get("max_output_chars", 8000)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 100:
            raise ConfigError(f"max_output_chars must be an integer >= 100, got {limit!r}")
        return cls(
            addr=raw.get("addr") or None,
            client_name=str(raw.get("client_name") or default_name),
            connect_timeout=_number(raw, "connect_timeout", 10.0) or 10.0,
            image=str(raw.get("image") or ""),
            mem=raw.get("mem"),
            cpus=_cpus(raw.get("cpus", 1), "cpus"),
            timeout=_number(raw, "timeout", 60.0) or 60.0,
            max_output_chars=limit,
            test=_test_run(raw),
        )


def _test_run(raw: Mapping[str, Any]) -> TestRun | None:
    reward = raw.get("reward", "exit_code")
    if reward not in REWARD_MODES:
        raise ConfigError(f"reward must be one of {list(REWARD_MODES)}, got {reward!r}")
    command = raw.get("test_command")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise ConfigError(f"test_command must be a non-empty string, got {command!r}")
    return TestRun(
        command=command or "",
        cpus=_cpus(raw.get("test_cpus", [1, 8]), "test_cpus"),
        elastic=_elastic(raw.get("test_elastic", "pytest")),
        duration_hint=_number(raw, "test_duration_hint", None),
        timeout=_number(raw, "test_timeout", 600.0) or 600.0,
        reward=reward,
    )


@dataclass(frozen=True)
class Task:
    """One sample's sandbox content: files to put before the first command, and its own tests."""

    files: dict[str, str | bytes] = field(default_factory=dict)
    test_command: str | None = None

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> Task:
        """Reads `files` and `test_command`; other keys belong to the framework and are ignored."""
        raw = dict(raw or {})
        files = raw.get("files") or {}
        if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (str, bytes)) for k, v in files.items()
        ):
            raise ConfigError(f"files must map paths to text or bytes, got {type(files).__name__}")
        command = raw.get("test_command")
        if command is not None and not isinstance(command, str):
            raise ConfigError(f"test_command must be a string, got {command!r}")
        return cls(dict(files), command or None)

    def test_run(self, options: Options) -> TestRun | None:
        """The task's test run: its own command with the options' resources, else the options'."""
        base = options.test
        command = self.test_command or (base.command if base else "")
        if not command:
            return None
        return dataclasses.replace(base or TestRun(command), command=command)


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]}\n... ({len(text) - 2 * keep} characters cut) ...\n{text[-keep:]}"


def _streams(stdout: str, stderr: str) -> str:
    parts = [stdout.rstrip("\n")] if stdout else []
    if stderr:
        parts.append(f"[stderr]\n{stderr.rstrip(chr(10))}")
    return "\n".join(parts)


def render(result: Any, limit: int) -> str:
    """What the model reads after a command: stdout, then stderr, then the exit code if not 0."""
    text = _streams(result.stdout, result.stderr)
    if result.exit_code != 0:
        text = f"{text}\n[exit code {result.exit_code}]" if text else f"[exit code {result.exit_code}]"
    return clip(text, limit) if text else "(no output)"


def render_timeout(exc: ActionTimeout, limit: int) -> str:
    """A command killed at its timeout (or dropped while queued): what it wrote, then why it stopped."""
    text = _streams(getattr(exc, "stdout", "") or "", getattr(exc, "stderr", "") or "")
    note = f"[command {exc}]" if str(exc).startswith("timed out") else f"[command timed out: {exc}]"
    return clip(f"{text}\n{note}" if text else note, limit)


def exec_metrics(result: Any) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code,
        "queued_s": result.queued_s,
        "run_s": result.run_s,
        "dop": result.dop,
        "node": result.node,
    }


def score(result: Any, mode: str) -> float:
    """The reward of a finished test run (see the module docstring for the modes)."""
    if mode == "pytest":
        for line in reversed((result.stdout + "\n" + result.stderr).splitlines()):
            counts: dict[str, int] = {}
            for n, word in _SUMMARY.findall(line):
                key = "failed" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(n)
            if counts:
                total = counts.get("passed", 0) + counts.get("failed", 0)
                return counts.get("passed", 0) / total if total else 0.0
    return 1.0 if result.exit_code == 0 else 0.0
