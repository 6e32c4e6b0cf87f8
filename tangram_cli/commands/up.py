"""`tangram up [INVENTORY]`: start a cluster and wait until every agent has registered.

Without an inventory (no argument, no ``-i``, no ``TANGRAM_INVENTORY``) it starts the local
default: controller plus one agent on this machine (bootstrap/local.py), with warm sandbox pools and
RL jobs when ``--sandbox-pool``/``--job`` ask (bootstrap/local_flags.py). With one it bootstraps
every host over SSH (bootstrap/remote.py). A controller that died is restarted in place, on its
recorded ports and settings (bootstrap/restart.py). A running local cluster is kept; flags that
differ from what it was started with are an error (exit 1) naming each one, unless ``--replace`` asks
for a fresh cluster; so are they when its controller died, rather than ignored by the restart. Exit
codes: 0 up, 1 failed, 2 bad inventory or usage, 3 some hosts failed (with ``--allow-partial``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import click
from click.core import ParameterSource

from tangram.errors import ConfigError, TangramError
from tangram_cli import keys
from tangram_cli import state as st
from tangram_cli.bootstrap import bundle, local, local_flags, plan, restart
from tangram_cli.bootstrap.local import security_line
from tangram_cli.bootstrap.local_flags import LocalExtras, PoolFlag
from tangram_cli.commands.down import down_cluster
from tangram_cli.inventory import load_inventory, parse_size_mib, preflight
from tangram_cli.params import Duration, output_option, verbosity
from tangram_cli.render.status import duration

# Imported where used, not here (start-up cost): bootstrap.remote (asyncssh) and render.up (rich) only
# for an inventory; the local default needs neither.


def _gpu_mem(value: str | None) -> int | None:
    if value is None:
        return None

    try:
        return parse_size_mib(value)
    except ValueError as exc:
        raise ConfigError(f"--gpu-mem: {exc}", hint="write e.g. --gpu-mem 16GiB") from None


def print_ready(
    state: st.ClusterState,
    *,
    started: bool,
    how: str = "",
    summary: str | None = None,
    more: tuple[str, ...] | list[str] = (),
) -> None:
    """The closing lines of `up`. ``how``: "started", "running" or "restarted" (in place); ``more``:
    lines after the security line (the local default's pools and jobs)."""
    agents = len(state.hosts)
    how = how or ("started" if started else "running")
    verb = {"started": "is up", "restarted": "is up again", "running": "is already running"}.get(how, "is up")
    if how == "running" and state.started_at:
        verb += f" since {since(state.started_at)}"
    if summary:
        click.echo(summary)
    click.echo(
        f"cluster {state.name} {verb}: controller {state.address} (pid {state.controller_pid}), "
        f"{agents} agent{'s' if agents != 1 else ''}"
        + (f", executor {state.executor}" if state.executor else "")
        + (f", gpus {state.gpus}" if state.gpus else "")
    )
    if state.inventory == "<local default>":
        click.echo(security_line(state))
    for line in more:
        click.echo(line)
    if state.cluster_id:
        click.echo(f"cluster id: {state.cluster_id} (its sandbox containers: label tangram.cluster-id)")
    click.echo(f"logs: {st.logs_dir(state.name)}")
    click.echo("next: `tangram status`, `tangram demo`, `tangram down`")
    click.echo(f"export TANGRAM_ADDR={state.address}")
    if state.certs:
        click.echo(f"export TANGRAM_CERTS={state.certs}")


@click.command("up")
@click.argument("inventory", required=False)
@click.option(
    "-i", "--inventory", "inventory_opt", metavar="FILE", help="Inventory file (or TANGRAM_INVENTORY)."
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask (there is nothing to confirm yet).")
@click.option("--dry-run", is_flag=True, help="Print the bootstrap plan and stop.")
@click.option("--limit", metavar="HOSTLIST", help="Only these nodes (a hostlist such as cpu-[01-02]).")
@click.option(
    "--parallel", default=8, show_default=True, type=click.IntRange(1, 64), help="SSH connections in flight."
)
@click.option(
    "--timeout",
    "timeout_s",
    type=Duration(0.1, 86400),
    default="300s",
    show_default=True,
    help="Wait this long for agents (300, 300s, 5m).",
)
@click.option(
    "--allow-partial", is_flag=True, help="Exit 3 (not 1) and keep the cluster when some hosts fail."
)
@click.option("--force", is_flag=True, help="Restart agents even where they already run.")
@click.option(
    "--replace",
    is_flag=True,
    help="If the cluster runs, stop it (`tangram down`) and start a fresh one with these flags.",
)
@click.option("--foreground", is_flag=True, help="Stay attached; Ctrl-C stops the cluster.")
@click.option(
    "--executor",
    type=click.Choice(["auto", "docker", "process"]),
    default="auto",
    show_default=True,
    help="Local default: sandbox executor.",
)
@click.option(
    "--gpus", type=click.IntRange(0, 64), default=None, help="Local default: emulated GPU count (8)."
)
@click.option(
    "--gpu-mem", default=None, metavar="SIZE", help="Local default: memory per emulated GPU (80GiB)."
)
@click.option(
    "--curve/--insecure",
    default=True,
    show_default=True,
    help="Local default: CURVE keys (default; an inventory always uses them), or --insecure: plain TCP "
    "on 127.0.0.1 that any local user can connect to, as agent or client (development only).",
)
@click.option(
    "--sandbox-pool",
    "sandbox_pool",
    default="0",
    show_default=True,
    metavar="N[,mem=SHARE]",
    help="Local default: warm sandbox pools, up to N created idle sandboxes per node and sandbox shape, "
    "sized from recent opens, holding at most SHARE of the node's memory (0.5, 50% or 6GiB; default 25%) "
    "(the controller's `sandbox_pool` with max N, mem_fraction SHARE); 0: off. Docker executor only.",
)
@click.option(
    "--job",
    "jobs",
    multiple=True,
    metavar="NAME=WEIGHT[,RES=CAP...]",
    help="Local default: define an RL job with a weight (its fair share) and optional caps "
    "(cores, gpus, api, api:NAME), e.g. --job train=3 --job eval=1,cores=8. Repeatable.",
)
@output_option("table", "json")
@click.pass_context
def command(
    ctx: click.Context,
    inventory: str | None,
    inventory_opt: str | None,
    yes: bool,
    dry_run: bool,
    limit: str | None,
    parallel: int,
    timeout_s: float,
    allow_partial: bool,
    force: bool,
    replace: bool,
    foreground: bool,
    executor: str,
    gpus: int | None,
    gpu_mem: str | None,
    curve: bool,
    sandbox_pool: str,
    jobs: tuple[str, ...],
    output: str,
) -> None:
    """Start a cluster from INVENTORY over SSH, or the local default when none is given.

    Blocks until every agent has registered with the controller, then prints the
    `export TANGRAM_ADDR=...` line rollout jobs need. Re-running it on a running cluster
    changes nothing but starting dead agents again (flags that differ from the running
    cluster's are an error: `--replace` starts it afresh); after a controller crash it restarts
    the controller on the same ports and with the same settings (running agents and clients
    reconnect to it; flags that differ from those settings are an error too).
    """
    if inventory and inventory_opt and inventory != inventory_opt:
        raise click.UsageError("give the inventory once: as an argument or with -i")
    path = inventory or inventory_opt or os.environ.get("TANGRAM_INVENTORY") or None
    verbose, quiet = verbosity(ctx)
    local_values = dict(executor=executor, gpus=gpus, gpu_mem=gpu_mem, curve=curve)
    local_values.update(sandbox_pool=sandbox_pool, jobs=jobs)
    if path:
        _refuse_local_flags(ctx, path, **local_values)
        options = dict(limit=limit, parallel=parallel, timeout_s=timeout_s, allow_partial=allow_partial)
        options.update(force=force)
        view = {"output": output, "verbose": verbose, "quiet": quiet > 0}
        sys.exit(_up_inventory(path, dry_run, replace, foreground, options, view))
    extras = _extras(executor, sandbox_pool, jobs)
    local_values.update(sandbox_pool=extras.pool, jobs=extras.jobs)
    if dry_run:
        _local_dry_run(curve, extras)
        return
    wanted = _wanted(ctx, **local_values)
    if replace:
        _replace(st.DEFAULT_CLUSTER, quiet=quiet > 0)
    else:
        _check_running(st.DEFAULT_CLUSTER, wanted, quiet=quiet > 0 or output == "json")
    name = _up_local(
        executor, gpus, gpu_mem, min(timeout_s, 120.0), curve, extras, output=output, quiet=quiet > 0
    )
    if foreground:
        _stay(name)


def _local_dry_run(curve: bool, extras: LocalExtras) -> None:
    """`up --dry-run` without an inventory: what would start, with its pools and jobs."""
    click.echo(
        "local default: start `tangram controller` on 127.0.0.1 (free ports) and one agent "
        "(`python -m agent`) on this machine; no SSH; "
        + ("CURVE keys in the cluster's certs directory" if curve else "plain TCP (--insecure)")
    )
    for line in extras.describe():
        click.echo(f"  {line}")


def _up_inventory(
    path: str, dry_run: bool, replace: bool, foreground: bool, options: dict[str, Any], view: dict[str, Any]
) -> int:
    """`up INVENTORY`: bootstrap over SSH (bootstrap/remote.py), show it (render/up.py); the exit code."""
    from tangram_cli.bootstrap import remote  # start-up cost: see the note at the top
    from tangram_cli.render import up as show  # start-up cost: see the note at the top

    if dry_run:
        _dry_run(path, options["limit"], view["verbose"])
        return 0
    if replace:
        _replace(remote.cluster_name(path), quiet=view["quiet"])
    json_out = view["output"] == "json"
    with show.Progress(quiet=view["quiet"] or json_out, verbose=view["verbose"]) as progress:
        outcome = remote.up_inventory(path, remote.UpOptions(**options), emit=progress, say=progress.say)
    code = show.print_outcome(outcome, json_out=json_out)
    if foreground and code in (0, 3):
        _stay(outcome.state.name)
    return code


def _dry_run(path: str, limit: str | None, verbose: int) -> None:
    """`up INVENTORY --dry-run`: the plan, then the checks only this machine can make (preflight.py)."""
    from tangram_cli.bootstrap import remote  # start-up cost: see the note at the top

    inv = load_inventory(path)  # InventoryError: exit 2 with every problem
    nodes = remote.select(inv, limit)
    ctl = inv.controller
    click.echo(
        f"cluster {inv.cluster}: controller on this machine, bind {ctl.bind}, advertise {ctl.advertise}, "
        f"ports agents {ctl.ports.agents or 'free'} submit {ctl.ports.submit or 'free'} "
        f"status {ctl.ports.status or 'free'}"
    )
    click.echo(
        f"CURVE keys: {keys.certs_dir(inv.cluster)} (created if missing; each node gets only its own key)"
    )
    digest = bundle.build().digest
    click.echo(plan.render(plan.plan(nodes, inv.cluster, digest), verbose=verbose > 0), nl=False)
    preflight.check(inv, nodes)  # InventoryError (exit 2) naming each key


# Flags of the local default, and where an inventory says the same.
LOCAL_ONLY = {
    "executor": ("--executor", "`executor:` per group or host"),
    "gpus": ("--gpus", "`gpus:` (with `emulated_gpus: true`) per group or host"),
    "gpu_mem": ("--gpu-mem", "`gpu_mem:` per group or host"),
    "sandbox_pool": ("--sandbox-pool", "`sandbox_pool: {max: N, mem_fraction: F}`"),
    "jobs": ("--job", "`jobs: {NAME: {weight: W, caps: {...}}}`"),
}


def _extras(executor: str, sandbox_pool: str, jobs: tuple[str, ...]) -> LocalExtras:
    """``--sandbox-pool`` and ``--job``, checked (ConfigError, exit 2, naming the flag and the fix)."""
    extras = LocalExtras(local_flags.parse_pool_flag(sandbox_pool), local_flags.parse_job_flags(jobs))
    if extras.sandbox_pool and executor == "process":
        raise ConfigError(
            f"--sandbox-pool {sandbox_pool} with --executor process: the process executor keeps no warm "
            "sandbox pools (only the Docker executor does)",
            hint="use --executor docker (or auto, where dockerd runs), or drop --sandbox-pool",
        )
    return extras


def _refuse_local_flags(ctx: click.Context, path: str, **values: object) -> None:
    """Flags that only shape the local default are a usage error (exit 2) with an inventory, each
    named with where the inventory sets the same; ``--curve`` is what an inventory does anyway."""
    problems = []
    for key, value in _wanted(ctx, **values).items():
        if key == "curve":
            if not value:
                problems.append("--insecure (an inventory cluster always uses CURVE)")
            continue
        flag, field = LOCAL_ONLY[key]
        problems.append(f"{flag} (set {field} in the inventory)")
    if problems:
        raise click.UsageError(
            f"{'; '.join(problems)}: only for the local default (`tangram up` without an inventory), "
            f"not with inventory {path}"
        )


def since(started_at: float, now: float | None = None) -> str:
    """``2026-11-30 01:23:22 (3h05m ago)``: when a cluster started, in local time."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started_at))
    return f"{stamp} ({duration(now - started_at)} ago)"


def _wanted(ctx: click.Context, **values: object) -> dict[str, object]:
    """The local-default flags given on the command line (not left at their defaults)."""
    defaults = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)
    return {k: v for k, v in values.items() if ctx.get_parameter_source(k) not in defaults}


def _recorded_gpus(text: str) -> tuple[int, int | None]:
    """(emulated GPUs, GiB each) from the state's ``gpus``: "2 emulated x 16GiB" -> (2, 16);
    "1 (NVML)" -> (0, None)."""
    words = text.split()
    if len(words) == 4 and words[1] == "emulated" and words[0].isdigit() and words[3].endswith("GiB"):
        return int(words[0]), int(words[3].removesuffix("GiB") or 0)
    return 0, None


def differences(state: st.ClusterState, wanted: dict[str, object], was: str = "running") -> list[str]:
    """The given flags that differ from what the cluster was started with, each as
    ``--gpus 4 (running: 2 emulated x 16GiB)`` (``was``: that word)."""
    out = []
    executor = wanted.get("executor")
    if executor not in (None, "auto") and executor != state.executor:
        out.append(f"--executor {executor} ({was}: {state.executor or 'unknown'})")
    emulated, gib = _recorded_gpus(state.gpus)
    gpus = wanted.get("gpus")
    if gpus is not None and gpus != emulated:
        out.append(f"--gpus {gpus} ({was}: {state.gpus or 'none'})")
    gpu_mem = wanted.get("gpu_mem")
    if gpu_mem is not None and (gpus or emulated) and _gpu_mem(str(gpu_mem)) // 1024 != gib:
        out.append(f"--gpu-mem {gpu_mem} ({was}: {state.gpus or 'none'})")
    curve = wanted.get("curve")
    if curve is not None and bool(curve) != bool(state.certs):
        out.append(f"--curve ({was}: --insecure, plain TCP)" if curve else f"--insecure ({was}: CURVE)")
    if "sandbox_pool" in wanted or "jobs" in wanted:  # what runs: its controller.json
        out += local_flags.differences(local_flags.recorded(state.name) or LocalExtras(), wanted, was)
    return out


def _settings(state: st.ClusterState) -> str:
    """``executor process, gpus 1 emulated x 1GiB, CURVE, jobs train=3``: what the cluster was started
    with (its state record and its ``controller.json``)."""
    security = "CURVE" if state.certs else "plain TCP (--insecure)"
    extras = local_flags.recorded(state.name) or LocalExtras()
    more = ""
    if extras.sandbox_pool:
        more = f", sandbox pools up to {extras.sandbox_pool}"
        more += f" (mem {local_flags.percent(extras.pool.mem_fraction)})"
    if extras.jobs:
        more += f", jobs {' '.join(local_flags.job_word(j) for j in extras.jobs)}"
    return f"executor {state.executor or '?'}, gpus {state.gpus or 'none'}, {security}{more}"


def _running_line(state: st.ClusterState) -> str:
    return f"cluster {state.name} already running since {since(state.started_at)}, with {_settings(state)}"


def _check_running(name: str, wanted: dict[str, object], *, quiet: bool) -> None:
    """A running cluster is kept: say so; flags it was not started with are an error (exit 1). One whose
    controller died is checked the same way against its recorded settings (``_check_restart``)."""
    state = st.load(name)
    if state is None:
        return
    if not state.controller_is_ours():
        _check_restart(state, wanted)
        return
    diffs = differences(state, wanted)
    if diffs:
        flags = _flag_words(wanted)
        raise TangramError(
            f"{_running_line(state)}; these flags differ from it: {'; '.join(diffs)}",
            hint=f"`tangram down` then `tangram up {flags}`, or `tangram up --replace {flags}` "
            "(both stop the running cluster and its sandboxes); or drop the flags to keep it",
        )
    if not quiet:
        click.echo(f"tangram up: {_running_line(state)}; keeping it (starting what is missing)", err=True)


def _check_restart(state: st.ClusterState, wanted: dict[str, object]) -> None:
    """A cluster whose controller died is restarted in place with the settings it was started with
    (bootstrap/restart.py: its state record and ``controller.json``), never with other flags: flags that
    differ from those are an error (exit 1) naming each one, rather than silently ignored. A cluster
    that cannot be restarted in place (``missing_record``) is started afresh with the flags given."""
    if restart.missing_record(state) is not None:
        return
    diffs = differences(state, wanted, was="recorded")
    if not diffs:
        return
    pid = state.controller_pid
    why = "now runs another program" if st.pid_alive(pid) else "is gone"
    flags = _flag_words(wanted)
    raise TangramError(
        f"the controller of cluster {state.name} (pid {pid}) {why}; `tangram up` restarts it in place with "
        f"the settings it was started with ({_settings(state)}), and these flags differ from them: "
        f"{'; '.join(diffs)}",
        hint=f"`tangram down` then `tangram up {flags}`, or `tangram up --replace {flags}` (both stop the "
        "cluster's agents and sandboxes and start a fresh one); or drop the flags to restart it as it was",
    )


def _flag_words(wanted: dict[str, object]) -> str:
    """The given flags again, as the user would write them: ``--gpus 4 --insecure``."""
    words = []
    for key, value in wanted.items():
        if key == "curve":
            words.append("--curve" if value else "--insecure")
        elif key == "jobs":
            words.append(local_flags.flag_words(value))  # type: ignore[arg-type]
        elif isinstance(value, PoolFlag):
            words.append(f"--sandbox-pool {value.word()}")
        else:
            words.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(words)


def _replace(name: str, *, quiet: bool) -> None:
    """--replace: stop the cluster if one is recorded, so a fresh one starts with the flags given."""
    if st.load(name) is None:
        return
    echo = (lambda _m: None) if quiet else (lambda m: click.echo(f"  {m}", err=True))
    if not quiet:
        click.echo(f"tangram up --replace: stopping cluster {name} first", err=True)
    down_cluster(name, force=False, purge=False, timeout_s=20.0, echo=echo)


def _up_local(
    executor: str,
    gpus: int | None,
    gpu_mem: str | None,
    timeout_s: float,
    curve: bool,
    extras: LocalExtras,
    *,
    output: str,
    quiet: bool,
) -> str:
    """The local default: start, keep or restart it in place; print the outcome. Returns its name."""
    quiet = quiet or output == "json"

    def say(msg: str) -> None:
        if not quiet:
            click.echo(f"  {msg}", err=True)

    old = st.load(st.DEFAULT_CLUSTER)
    if not quiet and (old is None or not old.controller_is_ours()):
        click.echo("tangram up: starting the local cluster (controller + 1 agent on this machine)", err=True)
    result = local.bring_up_local(
        executor=executor,
        gpus=gpus,
        gpu_mem_mib=_gpu_mem(gpu_mem),
        timeout_s=timeout_s,
        on_event=say,
        curve=curve,
        extras=extras,
    )
    running = local_flags.recorded(result.state.name) or LocalExtras()  # a kept cluster keeps its own
    if output == "json":
        click.echo(json.dumps({**result.to_dict(), **running.to_dict()}, sort_keys=True))
    else:
        more = running.describe()
        print_ready(result.state, started=result.started, how=result.how, summary=result.summary(), more=more)
    return result.state.name


def _stay(name: str) -> None:
    """--foreground: follow the controller's log until Ctrl-C or SIGTERM, then `down`."""
    stop = {"now": False}

    def handler(_sig: int, _frame: object) -> None:
        stop["now"] = True

    old = signal.signal(signal.SIGTERM, handler)
    log = st.logs_dir(name) / "controller.log"
    click.echo(f"running in the foreground (Ctrl-C stops cluster {name}); controller log follows", err=True)
    try:
        with open(log, errors="replace") as fh:
            fh.seek(0, os.SEEK_END)
            while not stop["now"]:
                line = fh.readline()
                if line:
                    click.echo(line.rstrip("\n"), err=True)
                    continue
                cur = st.load(name)
                if cur is None or not cur.controller_alive():
                    click.echo("the controller stopped", err=True)
                    break
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
    down_cluster(name, force=False, purge=False, timeout_s=20.0, echo=lambda m: click.echo(m, err=True))
