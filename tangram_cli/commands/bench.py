"""`tangram bench`: benchmarks that print figures (never asserted in tests)."""
from __future__ import annotations

import importlib.util

import click

from tangram_cli.bench_scheduler import scheduler


@click.group("bench")
def command() -> None:
    """Benchmarks: scheduler decision latency, per-action dispatch overhead."""


command.add_command(scheduler)

if importlib.util.find_spec("tangram_cli.bench_dispatch") is not None:
    from tangram_cli.bench_dispatch import dispatch

    command.add_command(dispatch)
