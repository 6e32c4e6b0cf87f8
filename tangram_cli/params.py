"""The command line's shared conventions (docs/cli.md, "Conventions"), in one place.

* ``Duration``: a click type for every flag that takes a duration: seconds, or a number with a
  unit (``500ms``, ``30s``, ``5m``, ``2h``), read by `tangram.units.parse_duration_s`.
* ``output_option``: ``-o/--output FORMAT``, the one spelling of an output format, with the old
  ``--json`` kept as a hidden, deprecated alias where a command had it.
* ``conform``: gives every command (subcommands of groups too) ``-v/--verbose``, ``-q/--quiet`` and
  ``--no-color``, and an ``-o/--output`` to commands that only knew ``--json`` (the benchmarks).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click

from tangram.units import parse_duration_s

OUTPUT_HELP = "Output format: a human table (or text), or JSON on stdout for scripts."


class Duration(click.ParamType):
    """A duration in seconds (float): ``20``, ``20s``, ``500ms``, ``1.5m``, ``2h``."""

    name = "duration"

    def __init__(self, min_s: float | None = None, max_s: float | None = None) -> None:
        self.min_s = min_s
        self.max_s = max_s

    def get_metavar(self, *args: Any, **kwargs: Any) -> str:
        return "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = parse_duration_s(value, "")
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if self.min_s is not None and seconds < self.min_s:
            self.fail(f"{value!r} is shorter than the minimum, {self.min_s:g}s", param, ctx)
        if self.max_s is not None and seconds > self.max_s:
            self.fail(f"{value!r} is longer than the maximum, {self.max_s:g}s", param, ctx)
        return seconds

    def __repr__(self) -> str:
        return f"Duration({self.min_s}, {self.max_s})"


def deprecated(old: str, new: str) -> None:
    """A one-line deprecation note on stderr, for people only: scripts (no TTY) see nothing, so
    their captured output stays as it was."""
    if sys.stderr.isatty():
        click.echo(f"note: {old} is deprecated; write {new}", err=True)


def output_option(
    *choices: str, default: str | None = None, json_alias: bool = False, help: str = OUTPUT_HELP
) -> Callable[[Any], Any]:
    """``-o/--output [CHOICES]`` as the parameter ``output``; ``json_alias``: also a hidden ``--json``
    flag that means ``-o json`` (the command's old spelling)."""
    choices = choices or ("table", "json")
    default = default or choices[0]

    def decorate(fn: Any) -> Any:
        target = fn
        if json_alias:

            @functools.wraps(fn)
            def wrapper(*args: Any, json_alias: bool = False, **kwargs: Any) -> Any:
                if json_alias:
                    deprecated("--json", "-o json")
                    kwargs["output"] = "json"
                return fn(*args, **kwargs)

            target = click.option("--json", "json_alias", is_flag=True, hidden=True, help="Same as -o json.")(
                wrapper
            )
        return click.option(
            "-o", "--output", type=click.Choice(list(choices)), default=default, show_default=True, help=help
        )(target)

    return decorate


# ---------------------------------------------------------------- every command


def _count(key: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        obj = ctx.ensure_object(dict)
        obj[key] = obj.get(key, 0) + (value or 0)

    return store


def _no_color(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
    if value:
        os.environ["NO_COLOR"] = "1"


def _counter(short: str, key: str, help: str) -> click.Option:
    """A repeatable flag (``-v -v``) whose count adds to ``ctx.obj[key]``."""
    return click.Option([short, f"--{key}"], count=True, expose_value=False, callback=_count(key), help=help)


def common_params() -> list[click.Option]:
    """Fresh ``-v``, ``-q`` and ``--no-color`` options (they add to the group's, in ``ctx.obj``)."""
    return [
        _counter("-v", "verbose", "More output; -vv shows tracebacks."),
        _counter("-q", "quiet", "Less output: no progress lines (results and errors still print)."),
        click.Option(
            ["--no-color"],
            is_flag=True,
            expose_value=False,
            callback=_no_color,
            help="Plain output (NO_COLOR is honoured too).",
        ),
    ]


def verbosity(ctx: click.Context | None = None) -> tuple[int, int]:
    """(verbose, quiet) counts given anywhere on the command line (group or command)."""
    ctx = ctx or click.get_current_context(silent=True)
    obj = (ctx.obj if ctx is not None else None) or {}
    return int(obj.get("verbose", 0)), int(obj.get("quiet", 0))


def _taken(cmd: click.Command) -> set[str]:
    return {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}


def conform(cmd: click.Command) -> click.Command:
    """Apply the conventions to ``cmd`` and, for a group, to every subcommand (once)."""
    if getattr(cmd, "_tangram_conformed", False):
        return cmd
    taken = _taken(cmd)
    for opt in common_params():
        if not taken.intersection(opt.opts):
            cmd.params.append(opt)
    _adopt_output(cmd)
    cmd._tangram_conformed = True  # type: ignore[attr-defined]
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            conform(sub)
    return cmd


def _adopt_output(cmd: click.Command) -> None:
    """A command with only ``--json`` (parameter ``as_json``) gets ``-o/--output table|json``;
    ``--json`` stays, hidden."""
    names = {p.name for p in cmd.params}
    if "as_json" not in names or "output" in names or cmd.callback is None:
        return
    for p in cmd.params:
        if p.name == "as_json" and isinstance(p, click.Option):
            p.hidden = True
    original = cmd.callback

    @functools.wraps(original)
    def callback(*args: Any, output: str = "table", **kwargs: Any) -> Any:
        if kwargs.get("as_json"):
            deprecated("--json", "-o json")
        kwargs["as_json"] = bool(kwargs.get("as_json")) or output == "json"
        return original(*args, **kwargs)

    cmd.callback = callback
    cmd.params.append(
        click.Option(
            ["-o", "--output"],
            type=click.Choice(["table", "json"]),
            default="table",
            show_default=True,
            help=OUTPUT_HELP,
        )
    )


def duration_params(cmd: click.Command, names: Iterable[str]) -> None:
    """Let these float-seconds options of ``cmd`` take a duration (``90``, ``90s``, ``1.5m``), keeping
    their bounds; for commands defined outside tangram_cli/commands (the benchmarks)."""
    wanted = set(names)
    for p in cmd.params:
        if p.name in wanted and isinstance(p.type, click.FloatRange):
            p.type = Duration(p.type.min, p.type.max)
