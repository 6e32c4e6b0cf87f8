"""`tangram controller`: run the controller in the foreground (`tangram up` starts it detached)."""

from __future__ import annotations

import dataclasses

import click

from tangram_cli.controller.config import ControllerConfig, load_config
from tangram_cli.controller.daemon import Options, run_controller
from tangram_cli.controller.state import check_bind
from tangram_cli.params import Duration


@click.command("controller")
@click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind (loopback only, unless --certs turns CURVE on).",
)
@click.option(
    "--agents-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port for agents (0: pick a free one).",
)
@click.option(
    "--submit-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port for clients (0: pick a free one).",
)
@click.option(
    "--status-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port for `tangram status` (0: pick a free one).",
)
@click.option(
    "--journal", type=click.Path(dir_okay=False), default=None, help="Append every event and command here."
)
@click.option(
    "--state",
    type=click.Path(dir_okay=False),
    default=None,
    help="Durable state file (sandboxes, dispatched actions, recent results), replayed at start "
    "so a restarted controller keeps its clients' work; see docs/recovery.md.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Resolved configuration (services, APIs, profiles, scheduler) as JSON.",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the chosen ports here as JSON once the sockets are bound.",
)
@click.option(
    "--client-grace",
    type=Duration(0.05, 86400),
    default=None,
    help="How long a silent client keeps its sandboxes and leases (default 60s).",
)
@click.option(
    "--heartbeat", type=Duration(0.01, 60), default=None, help="Heartbeat interval (e.g. 1s, 500ms)."
)
@click.option("--cluster", default=None, help="Cluster name (default: from --config, else 'local').")
@click.option(
    "--max-outstanding-per-client",
    type=click.IntRange(1, 10_000_000),
    default=None,
    help="Requests a client may have pending (plus undelivered replies) before RETRY_LATER (default 4096).",
)
@click.option(
    "--max-queued",
    type=click.IntRange(1, 100_000_000),
    default=None,
    help="Unfinished actions over all clients before RETRY_LATER (default 100000).",
)
@click.option(
    "--certs",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="CURVE certs directory (controller key, allow-lists agents/ clients/ status/); "
    "required to bind a non-loopback address.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics at http://BIND:PORT/metrics (0: a free port; default: the "
    "config's metrics_port, else off).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="Log lines as text or JSON (default: $TANGRAM_LOG_FORMAT, else text).",
)
def command(
    bind: str,
    agents_port: int,
    submit_port: int,
    status_port: int,
    journal: str | None,
    state: str | None,
    config_path: str | None,
    ready_file: str | None,
    client_grace: float | None,
    heartbeat: float | None,
    cluster: str | None,
    max_outstanding_per_client: int | None,
    max_queued: int | None,
    certs: str | None,
    metrics_port: int | None,
    log_format: str | None,
) -> None:
    """Run the controller in the foreground.

    Prints one JSON line with the bound ports ({"agents", "submit", "status", "pid", ...}).
    SIGTERM/SIGINT stop it (agents keep running); SIGUSR1 also shuts the agents down
    (the `tangram down` path). Clients connect to tcp://BIND:SUBMIT_PORT.
    """
    config = load_config(config_path)
    certs = certs or config.certs
    try:
        check_bind(bind, curve=bool(certs))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bind") from None
    config = _with_flags(
        config,
        client_grace_s=client_grace,
        heartbeat_s=heartbeat,
        cluster=cluster,
        max_outstanding_per_client=max_outstanding_per_client,
        max_queued=max_queued,
    )
    options = Options(
        bind=bind,
        agents_port=agents_port,
        submit_port=submit_port,
        status_port=status_port,
        journal=journal,
        state=state,
        ready_file=ready_file,
        certs=certs,
        metrics_port=metrics_port,
        log_format=log_format,
    )
    raise SystemExit(run_controller(config, options))


def _with_flags(config: ControllerConfig, **flags: object) -> ControllerConfig:
    """``config`` with the fields the flags given set (a flag left out is None: the file's value stays)."""
    changes = {key: value for key, value in flags.items() if value is not None}
    return dataclasses.replace(config, **changes) if changes else config
