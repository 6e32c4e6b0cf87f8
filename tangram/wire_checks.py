"""Field checks of the wire protocol: limits, field constraints, and the checkers compiled from
message field annotations (`tangram.protocol`, rule 2). No I/O here.

A message field's annotation says what a value may be: `Annotated[str, Str(64, ID_PATTERN)]`,
`Annotated[int, Range(1, 64)]`, `Annotated[list[...], Items(32)]`, `JSON` (free-form), or a plain
`bool`/`int`/`float`/`str`, a `Literal`, a union, a list or a dict of those. `compile_checker`
turns one annotation into a function `check(value, path)` that returns the value normalised
(tuples become lists, ints become floats for float fields) or raises
`ProtocolError(SCHEMA, "path: why")`. `tangram.wire_messages` compiles one per field when it
registers a message; the codec in `tangram.protocol` runs them on encode and decode.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, Union, get_args, get_origin

from tangram.errors import ProtocolError, ProtocolErrorKind

MAX_TEXT = 64 << 10  # longest string in a body (commands, tracebacks)
MAX_STR = 4096  # default bound for a plain `str` field
MAX_ITEMS = 4096  # default bound for lists and dicts
MAX_KEY = 256
MAX_DEPTH = 16  # nesting of free-form (JSON-like) fields
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
SESSION_TOKEN_BYTES = 24  # a client's session token (1.3): 8 bytes of nonce + a 16-byte MAC

# Ids end up in container names, labels and file names. `.` and `:` are allowed for names such
# as `qwen2.5-7b`, but an id never starts with `.` or `-`, and never contains `..`.
ID_PATTERN = r"(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}"


# ---------------------------------------------------------------- field constraints


@dataclass(frozen=True)
class Str:
    """A string field: at most `max_len` characters, matching `pattern` (whole string) if given."""

    max_len: int = MAX_STR
    pattern: str | None = None
    what: str = "string"


@dataclass(frozen=True)
class Range:
    """An int or float field within [lo, hi]."""

    lo: float
    hi: float


@dataclass(frozen=True)
class Items:
    """A list or dict with at most `max_items` entries."""

    max_items: int


class _Json:
    """A free-form value: maps with string keys, lists, str, int64, finite floats, bool, None."""


JSON = _Json()


# ---------------------------------------------------------------- checkers

Checker = Callable[[object, str], object]


def schema_error(path: str, why: str) -> ProtocolError:
    """The error for a value at `path` (`Exec.cpus_min`, `Hello.facts["x"]`) that breaks its field."""
    return ProtocolError(ProtocolErrorKind.SCHEMA, f"{path}: {why}")


def show_value(value: object) -> str:
    """`repr(value)`, cut to 40 characters, for error messages."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_bool(value: object, path: str) -> object:
    if not isinstance(value, bool):
        raise schema_error(path, f"expected bool, got {type(value).__name__}")
    return value


def _int_checker(lo: float, hi: float) -> Checker:
    low, high = max(lo, INT64_MIN), min(hi, INT64_MAX)

    def check(value: object, path: str) -> object:
        if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
            raise schema_error(path, f"expected int, got {type(value).__name__}")
        if not (low <= value <= high):
            raise schema_error(path, f"{show_value(value)} is out of range")
        return value

    return check


def _float_checker(lo: float, hi: float) -> Checker:
    def check(value: object, path: str) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise schema_error(path, f"expected float, got {type(value).__name__}")
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise schema_error(path, f"{show_value(value)} is out of range")
        number = float(value)
        if not math.isfinite(number):
            raise schema_error(path, f"{number} is not a finite number")
        if not lo <= number <= hi:
            raise schema_error(path, f"{number} is out of range")
        return number

    return check


def _str_checker(spec: Str) -> Checker:
    pattern = re.compile(spec.pattern) if spec.pattern else None

    def check(value: object, path: str) -> object:
        if not isinstance(value, str):
            raise schema_error(path, f"expected str, got {type(value).__name__}")
        if len(value) > spec.max_len:
            raise schema_error(path, f"{spec.what} longer than {spec.max_len} characters")
        if pattern is not None and pattern.fullmatch(value) is None:
            raise schema_error(path, f"{show_value(value)} is not a valid {spec.what}")
        if pattern is None and "\x00" in value:
            raise schema_error(path, f"{spec.what} contains NUL")
        return value

    return check


def _check_none(value: object, path: str) -> object:
    if value is not None:
        raise schema_error(path, f"expected None, got {type(value).__name__}")
    return None


def _literal_checker(choices: tuple[object, ...]) -> Checker:
    def check(value: object, path: str) -> object:
        if not isinstance(value, str) or value not in choices:
            raise schema_error(path, f"{show_value(value)} is not one of {', '.join(map(str, choices))}")
        return value

    return check


def _union_checker(options: list[Checker]) -> Checker:
    nullable = _check_none in options

    def check(value: object, path: str) -> object:
        if value is None and nullable:  # `X | None` with None: no failed try of X first
            return None
        first: ProtocolError | None = None
        for option in options:
            try:
                return option(value, path)
            except ProtocolError as exc:
                first = first or exc
        assert first is not None
        raise first

    return check


def _list_checker(item: Checker, max_items: int) -> Checker:
    def check(value: object, path: str) -> object:
        if not isinstance(value, (list, tuple)):
            raise schema_error(path, f"expected list, got {type(value).__name__}")
        if len(value) > max_items:
            raise schema_error(path, f"more than {max_items} items")
        try:
            return [item(v, path) for v in value]
        except ProtocolError:  # check again with each item's path, for the message (cold path)
            return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return check


def _dict_checker(key: Checker, val: Checker, max_items: int) -> Checker:
    def check(value: object, path: str) -> object:
        if not isinstance(value, dict):
            raise schema_error(path, f"expected map, got {type(value).__name__}")
        if len(value) > max_items:
            raise schema_error(path, f"more than {max_items} entries")
        try:
            return {str(key(k, path)): val(v, path) for k, v in value.items()}
        except ProtocolError:  # check again with each entry's path, for the message (cold path)
            return {str(key(k, f"{path} key")): val(v, f"{path}[{show_value(k)}]") for k, v in value.items()}

    return check


_key_check = _str_checker(Str(MAX_KEY, None, "key"))
_text_check = _str_checker(Str(MAX_TEXT))
_int64_check = _int_checker(INT64_MIN, INT64_MAX)
_finite_check = _float_checker(-math.inf, math.inf)


def _check_json(value: object, path: str, depth: int = 0) -> object:
    """A free-form value, normalised (tuples become lists). Paths are built only on failure."""
    try:
        return _json_fast(value, depth)
    except ProtocolError:
        return _json_slow(value, path, depth)


def _json_fast(value: object, depth: int) -> object:
    if value is None or value is True or value is False:
        return value
    kind = type(value)
    if kind is str:
        if len(value) > MAX_TEXT or "\x00" in value:  # type: ignore[arg-type, operator]
            raise schema_error("", "bad text")
        return value
    if kind is int:
        if not INT64_MIN <= value <= INT64_MAX:  # type: ignore[operator]
            raise schema_error("", "out of range")
        return value
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise schema_error("", "not finite")
        return value
    if depth >= MAX_DEPTH:
        raise schema_error("", "too deep")
    if kind is dict:  # (a result body: a flat map of scalars, checked here without a call per value)
        out = {}
        for k, v in value.items():  # type: ignore[attr-defined]
            if type(k) is not str or len(k) > MAX_KEY or "\x00" in k:
                raise schema_error("", "bad key")
            t = type(v)
            if t is float:
                if not math.isfinite(v):
                    raise schema_error("", "not finite")
                out[k] = v
            elif t is int:
                if not INT64_MIN <= v <= INT64_MAX:
                    raise schema_error("", "out of range")
                out[k] = v
            elif t is str and len(v) <= MAX_TEXT and "\x00" not in v:
                out[k] = v
            elif v is None or v is True or v is False:
                out[k] = v
            else:
                out[k] = _json_fast(v, depth + 1)
        return out
    if kind is list or kind is tuple:
        return [_json_fast(v, depth + 1) for v in value]  # type: ignore[attr-defined]
    raise schema_error("", "slow path")  # subclasses and everything else: the exact checks below


def _json_slow(value: object, path: str, depth: int = 0) -> object:
    if depth > MAX_DEPTH:
        raise schema_error(path, f"nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return _int64_check(value, path)
    if isinstance(value, float):
        return _finite_check(value, path)
    if isinstance(value, str):
        return _text_check(value, path)
    if isinstance(value, (list, tuple)):
        return [_json_slow(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {
            str(_key_check(k, f"{path} key")): _json_slow(v, f"{path}[{show_value(k)}]", depth + 1)
            for k, v in value.items()
        }
    raise schema_error(path, f"{type(value).__name__} is not allowed in a body (bytes go in blobs)")


def compile_checker(tp: object) -> Checker:
    """Turn a field annotation into a function that validates and normalises one value."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _compile_annotated(args[0], args[1:])
    if tp is bool:
        return _check_bool
    if tp is int:
        return _int64_check
    if tp is float:
        return _finite_check
    if tp is str:
        return _str_checker(Str())
    if tp is type(None):
        return _check_none
    if origin is Literal:
        return _literal_checker(args)
    if origin in (Union, types.UnionType):
        return _union_checker([compile_checker(a) for a in args])
    if origin is list:
        return _list_checker(compile_checker(args[0]), MAX_ITEMS)
    if origin is dict:
        return _dict_checker(compile_checker(args[0]), compile_checker(args[1]), MAX_ITEMS)
    raise TypeError(f"unsupported field annotation {tp!r}")


def _compile_annotated(base: object, meta: tuple[object, ...]) -> Checker:
    spec = meta[0]
    if isinstance(spec, _Json):
        return _check_json
    if isinstance(spec, Str):
        return _str_checker(spec)
    if isinstance(spec, Range):
        return _int_checker(spec.lo, spec.hi) if base is int else _float_checker(spec.lo, spec.hi)
    if isinstance(spec, Items):
        args = get_args(base)
        if get_origin(base) is list:
            return _list_checker(compile_checker(args[0]), spec.max_items)
        return _dict_checker(compile_checker(args[0]), compile_checker(args[1]), spec.max_items)
    raise TypeError(f"unsupported annotation metadata {spec!r}")
