"""Inventory problems and their wording: ``Problem`` (``path: message``), and ``validate``, which
runs one pydantic model over one section or host entry and turns each validation error into a
readable problem (unknown keys with a did-you-mean, unquoted YAML ``no`` read as a boolean,
inline secrets refused) instead of stopping at the first.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from tangram_cli.inventory import model as m


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def fmt_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _unwrap(ann: Any) -> Any:
    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = args[0] if len(args) == 1 else ann
            if len(args) != 1:
                return ann
        else:
            return ann


def _fields_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid keys of the mapping at ``loc`` inside ``cls`` (for did-you-mean)."""
    ann: Any = cls
    for part in loc:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if part not in ann.model_fields:
                return []
            ann = ann.model_fields[part].annotation
        elif typing.get_origin(ann) in (list, dict, tuple):
            ann = typing.get_args(ann)[-1] if typing.get_args(ann) else Any
        else:
            return []
    ann = _unwrap(ann)
    return list(ann.model_fields) if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def did_you_mean(word: Any, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _looks_secret(key: str) -> bool:
    k = key.lower().replace("-", "_")
    return k != "key_env" and k.endswith(m.SECRET_WORDS)


def describe(value: Any) -> str:
    """A YAML value as a message names it: ``the boolean false``, ``a mapping``, ``str 'x'``."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"


_QUOTE = "YAML reads unquoted yes/no/on/off/true/false, numbers and dates as non-strings; quote it"


def _message(err: Mapping[str, Any], cls: type[BaseModel]) -> str:
    kind, value, loc = err["type"], err.get("input"), tuple(err["loc"])
    if kind == "extra_forbidden":
        key = str(loc[-1])
        if _looks_secret(key):
            return (
                "inline secrets are not allowed; put the secret in an environment variable "
                "on the controller's host and name that variable with key_env"
            )
        return "unknown key" + did_you_mean(key, _fields_at(cls, loc[:-1]))
    if kind == "missing":
        return "required key missing"
    if kind == "string_type":
        why = (
            f"; {_QUOTE}"
            if isinstance(value, bool | int | float) or type(value).__name__ in ("date", "datetime")
            else ""
        )
        return f"expected a string, got {describe(value)}{why}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"expected a whole number, got {describe(value)}"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {describe(value)}"
    if kind == "bool_type":
        return f"expected true or false, got {describe(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {describe(value)}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {describe(value)}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        choices = re.findall(r"'([^']*)'", expected)
        hint = (
            did_you_mean(value, choices)
            if isinstance(value, str)
            else (f"; {_QUOTE}" if isinstance(value, bool) else "")
        )
        return f"must be one of {expected}, got {value!r}{hint}"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def validate(cls: type[BaseModel], data: Any, path: tuple[Any, ...], problems: list[Problem]) -> Any:
    """``cls.model_validate(data)``, or None with every error appended to ``problems``."""
    try:
        return cls.model_validate(data if data is not None else {})
    except ValidationError as exc:
        errors = exc.errors()
        found = [(tuple(err["loc"]), _message(err, cls), err["type"]) for err in errors]
        # a misspelt required key: keep "unknown key (did you mean 'limit'?)",
        # drop "limit: required key missing"
        suggested = {
            (*loc[:-1], msg.split("'")[-2])
            for loc, msg, kind in found
            if kind == "extra_forbidden" and "did you mean" in msg
        }
        for loc, msg, kind in found:
            if not (kind == "missing" and loc in suggested):
                problems.append(Problem(fmt_path(path + loc), msg))
        return None
