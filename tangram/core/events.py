"""Inputs to the core, named in the past tense. Every event is a frozen dataclass.

Drivers (the live controller, the simulator) turn the world into these and call
``Scheduler.handle(event, now)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from tangram.core.actions import ActionSpec
from tangram.core.managers.keys import ApiKey


@dataclass(frozen=True)
class NodeJoined:
    """A node offers ``cpus`` (core ids, grouped by NUMA domain in ``numa``), memory and GPUs."""

    node: str
    cpus: tuple[int, ...] = ()
    numa: tuple[tuple[int, ...], ...] = ()
    mem_mib: int = 0
    gpus: int = 0
    gpu_mem_mib: int = 0  # per GPU


@dataclass(frozen=True)
class NodeLost:
    node: str
    reason: str = "node lost"


@dataclass(frozen=True)
class ServiceDefined:
    """A GPU service: its memory per GPU and its restore time, the same on every chunk size
    it runs on unless ``per_size`` lists ``(size, gpu_mem_mib, load_s)`` for a size (a
    tensor-parallel copy on 4 GPUs holds a quarter of the weights per GPU and restores
    them in about a quarter of the time)."""

    service: str
    gpu_mem_mib: int
    chunk_sizes: tuple[int, ...] = (1,)
    load_s: float = 0.0
    t_ori: float | None = None
    per_size: tuple[tuple[int, int, float], ...] = ()


@dataclass(frozen=True)
class ApiDefined:
    """An external API: ``mode`` is ``concurrency`` (limit in flight) or ``quota`` (per period).
    ``keys``: its key pool, by name and limits only (``managers/keys.py``); with keys a
    ``limit`` of 0 leaves the keys' limits as the only ones."""

    api: str
    mode: str
    limit: int
    period_s: float = 60.0
    keys: tuple[ApiKey, ...] = ()


@dataclass(frozen=True)
class ApiReported:
    """The holder of lease ``action_id`` reports its call: the ``tokens`` it used (-1: not
    reported) and whether the provider answered rate-limited (HTTP 429), with the reset time
    it gave (``reset_s``): that key then cools down."""

    action_id: str
    tokens: int = -1
    limited: bool = False
    reset_s: float = 0.0


@dataclass(frozen=True)
class ApiUsed:
    """Quota already spent: ``used`` units granted in a window that began ``window_age_s``
    ago (a restarted controller's record; only ``quota`` mode keeps windows)."""

    api: str
    used: int
    window_age_s: float


@dataclass(frozen=True)
class KeyUsed:
    """Key ``key`` of API ``api`` before a controller restart (API key pools): ``charges`` are
    ``(age_s, units, tokens, lease)``, the leases granted on it in the last minute (``lease``
    names one that is still held and is submitted again with ``ActionSpec.api_key``; ``""``
    once released), and ``cool_left_s`` what is left of its cool-down after a rate-limit
    answer. An unknown API or key is ignored (the config may have changed)."""

    api: str
    key: str
    charges: tuple[tuple[float, int, int, str], ...] = ()
    cool_left_s: float = 0.0


@dataclass(frozen=True)
class SandboxOpened:
    """A trajectory's environment. ``reserve`` > 0 holds that many cores until it closes."""

    sandbox: str
    client: str = ""
    mem_mib: int = 0
    image: str = ""
    reserve: int = 0
    task: str = ""


@dataclass(frozen=True)
class SandboxClosed:
    sandbox: str


@dataclass(frozen=True)
class SandboxAdopted:
    """An open sandbox that has no node yet already exists on ``node`` (a controller that
    restarted learns it from the node's agent): bind it there, as its first placed action
    would, but create nothing."""

    sandbox: str
    node: str


@dataclass(frozen=True)
class ActionSubmitted:
    spec: ActionSpec


@dataclass(frozen=True)
class ActionFinished:
    """An action ended on its node (or a lease was released). ``ok`` False: it failed."""

    action_id: str
    ok: bool = True
    reason: str = ""


@dataclass(frozen=True)
class ActionUnstaged:
    """A staged start (``staging.py``) given back unstarted by its agent: the action it was to
    follow overran its estimate. It queues again in its place."""

    action_id: str


@dataclass(frozen=True)
class ActionCancelled:
    action_id: str
    reason: str = "cancelled"


@dataclass(frozen=True)
class ServiceEvicted:
    """A node reports it no longer holds ``service`` on the chunk starting at ``start``."""

    node: str
    service: str
    start: int


@dataclass(frozen=True)
class ClientGone:
    """A client is gone for good: cancel its work, close its sandboxes."""

    client: str


@dataclass(frozen=True)
class JobDefined:
    """An RL job's weight and caps (``jobs.py``): ``caps`` maps ``cpu`` (cores), ``gpu``
    (GPUs), ``api`` (units of every API) or ``api:<name>`` to the most its actions may hold."""

    job: str
    weight: float = 1.0
    caps: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class JobJoined:
    """A client named its job: its actions belong to ``job`` from now on (``""``: the default)."""

    client: str
    job: str


@dataclass(frozen=True)
class Tick:
    """Time passed; the core acts on deadlines that are due."""


Event = (
    NodeJoined
    | NodeLost
    | ServiceDefined
    | ApiDefined
    | ApiUsed
    | ApiReported
    | KeyUsed
    | SandboxOpened
    | SandboxClosed
    | SandboxAdopted
    | ActionSubmitted
    | ActionFinished
    | ActionUnstaged
    | ActionCancelled
    | ServiceEvicted
    | ClientGone
    | JobDefined
    | JobJoined
    | Tick
)
