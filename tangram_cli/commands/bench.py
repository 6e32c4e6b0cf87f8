"""`tangram bench`: benchmarks that print figures (never asserted in tests).

The benchmarks live in tangram_cli/bench/; the conventions every command follows (``-o
table|json`` with ``--json`` kept hidden, ``-v``/``-q``, durations with units) are applied to them
here and by `tangram_cli.params.conform`.
"""
from __future__ import annotations

import importlib.util

import click

from tangram_cli.bench.scheduler import scheduler
from tangram_cli.params import conform, duration_params

# options of the benchmarks that are seconds: they take a duration (90, 90s, 1.5m) as well
DURATIONS = (
    "timeout", "client_grace_s", "long_s", "lost_after_s", "action_timeout_s", "gap", "refill_window"
)


@click.group("bench")
def command() -> None:
    """Benchmarks: scheduler decision latency, dispatch overhead (and the floor of its layout), burst and
    scale of the live controller, crash recovery (chaos), warm sandbox pools."""


command.add_command(scheduler)

for _module, _name in (
    ("tangram_cli.bench.dispatch", "dispatch"),
    ("tangram_cli.bench.floor", "floor"),
    ("tangram_cli.bench.burst", "burst"),
    ("tangram_cli.bench.scale", "scale"),
    ("tangram_cli.bench.chaos", "chaos"),
    ("tangram_cli.bench.pool", "pool"),
):
    if importlib.util.find_spec(_module) is not None:
        command.add_command(getattr(importlib.import_module(_module), _name))

for _sub in command.commands.values():
    duration_params(_sub, DURATIONS)
    conform(_sub)
    for _param in _sub.params:  # help texts name the output flag as it is spelled now
        if isinstance(_param, click.Option) and _param.help:
            _param.help = _param.help.replace("--json", "-o json")
