"""`tangram bench`: benchmarks that print figures (never asserted in tests)."""
from __future__ import annotations

import importlib.util

import click

from tangram_cli.bench_scheduler import scheduler


@click.group("bench")
def command() -> None:
    """Benchmarks: scheduler decision latency, dispatch overhead, burst and scale of the live controller,
    crash recovery (chaos)."""


command.add_command(scheduler)

for _module, _name in (
    ("tangram_cli.bench_dispatch", "dispatch"),
    ("tangram_cli.bench_burst", "burst"),
    ("tangram_cli.bench_scale", "scale"),
    ("tangram_cli.bench_chaos", "chaos"),
):
    if importlib.util.find_spec(_module) is not None:
        command.add_command(getattr(importlib.import_module(_module), _name))
