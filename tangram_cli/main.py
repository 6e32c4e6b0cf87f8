"""The `tangram` command line: a click group whose subcommands load lazily.

Each subcommand lives in `tangram_cli/commands/<name>.py` and exposes a click command named
`command`. Commands load on first use so `tangram --help` stays fast and a missing optional
dependency only breaks the command that needs it. Errors that are the user's to fix
(`tangram.errors.TangramError` with a `hint`) print one line plus "To fix: ..." and exit with
the error's exit code; tracebacks need `-v -v` or TANGRAM_DEBUG=1.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from typing import Any

try:
    import click
except ImportError as exc:  # a client-only install (`pip install tangram-rl`): the command needs [cluster]
    raise SystemExit(
        f"tangram: {exc}\nTo fix: the tangram command needs the cluster install: "
        "pip install 'tangram-rl[cluster]' (from a checkout: pip install -e '.[cluster]')"
    ) from None

from tangram_cli.params import conform

# name -> (module, one-line help); order is the order `tangram --help` lists them in.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("tangram_cli.commands.up", "Start a cluster from an inventory, or the local default."),
    "down": ("tangram_cli.commands.down", "Stop a cluster: drain, remove sandboxes, stop agents."),
    "status": ("tangram_cli.commands.status", "Show nodes, services, APIs and the queue of a cluster."),
    "demo": ("tangram_cli.commands.demo", "Run the built-in agentic-RL workload on the local cluster."),
    "sim": ("tangram_cli.commands.sim", "Simulate workloads and policies in virtual time."),
    "bench": ("tangram_cli.commands.bench", "Benchmarks: scheduler latency, dispatch overhead."),
    "controller": ("tangram_cli.commands.controller", "Run the controller in the foreground."),
    "agent": ("tangram_cli.commands.agent", "Run a node agent in the foreground."),
    "inventory": ("tangram_cli.commands.inventory", "Validate or show an inventory file."),
    "env": ("tangram_cli.commands.env", "Print TANGRAM_ADDR exports for rollout jobs."),
    "keys": ("tangram_cli.commands.keys", "Per-client CURVE keys: add, list, revoke."),
    "logs": ("tangram_cli.commands.logs", "Print or follow the controller's or a node's log."),
}

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_PARTIAL, EXIT_NO_CLUSTER, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


def _available(name: str) -> bool:
    module = COMMANDS[name][0]
    return importlib.util.find_spec(module) is not None


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _available(name)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS or not _available(cmd_name):
            return None
        module = importlib.import_module(COMMANDS[cmd_name][0])
        command: click.Command = module.command
        return conform(command)  # -v/-q/--no-color and -o on every command (tangram_cli/params.py)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """As click's, but an unknown name gets "Did you mean 'status'?" (exit 2): click looks for
        close matches in ``self.commands``, which a lazy group leaves empty."""
        name = args[0] if args else ""
        known = not name or name.startswith("-") or ctx.resilient_parsing or self.get_command(ctx, name)
        if not known:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # `tangram env | head`: the reader left; stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(EXIT_OK)
        except click.exceptions.Exit:
            raise
        except click.ClickException:
            raise
        except Exception as exc:  # user-facing error reporting happens here, once
            _report(exc, ctx)


def _report(exc: Exception, ctx: click.Context) -> None:
    # start-up cost (~10 ms of `tangram --help`'s ~50): the error tree and traceback load on an error only
    from tangram.errors import TangramError

    debug = os.environ.get("TANGRAM_DEBUG") == "1" or (ctx.obj or {}).get("verbose", 0) >= 2
    if debug:
        import traceback  # start-up cost, as above

        traceback.print_exception(exc)
    if isinstance(exc, TangramError):
        click.echo(f"error: {exc.message}", err=True)
        if exc.hint:
            click.echo(f"To fix: {exc.hint}", err=True)
        sys.exit(exc.exit_code)
    click.echo(f"error: {type(exc).__name__}: {exc}", err=True)
    if not debug:
        click.echo("(run with -vv or TANGRAM_DEBUG=1 for the traceback)", err=True)
    sys.exit(EXIT_FAIL)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "TANGRAM"},
)
@click.option("-v", "--verbose", count=True, help="More output; -vv shows tracebacks.")
@click.option("-q", "--quiet", count=True, help="Less output: no progress lines.")
@click.option("--no-color", is_flag=True, help="Plain output (NO_COLOR is honoured too).")
@click.version_option(package_name="tangram-rl", prog_name="tangram")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: int, no_color: bool) -> None:
    """Tangram schedules agentic-RL actions (sandbox commands, GPU service calls, API calls)
    onto pooled CPU cores, GPUs and API quotas, one action at a time.

    Start a local cluster with `tangram up`, try it with `tangram demo`, and reproduce the
    paper's experiments in virtual time with `tangram sim`.
    """
    obj = ctx.ensure_object(dict)
    obj["verbose"] = obj.get("verbose", 0) + verbose
    obj["quiet"] = obj.get("quiet", 0) + quiet
    importlib.import_module("tangram.logfmt").configure_cli(obj["verbose"])  # the one log format
    if no_color:
        os.environ["NO_COLOR"] = "1"


def main() -> None:  # pragma: no cover - console entry
    cli()
