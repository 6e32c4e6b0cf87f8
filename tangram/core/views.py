"""Read-only views of a ``Scheduler`` for status and metrics: ``snapshot``."""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from tangram.core import jobs
from tangram.core.state import Snapshot, node_row, queue_row

if TYPE_CHECKING:
    from tangram.core.scheduler import Scheduler


def snapshot(s: Scheduler, limit: int | None = None, now: float | None = None) -> Snapshot:
    """``limit``: only the first ``limit`` waiting actions in FCFS order get a queue row
    (``queued`` still counts them all), so a status query costs O(limit), not O(queue), during
    a burst. ``now``: the reader's time (the controller's clock), for what ages while no event
    comes (queue waits, API keys' minute windows and cool-downs); the core's own time when
    None or earlier. Changes nothing in the scheduler."""
    at = s.now if now is None else max(s.now, now)
    nodes = [node_row(name, s.cpu.nodes.get(name), s.gpu.nodes.get(name))
             for name in sorted(set(s.cpu.nodes) | set(s.gpu.nodes))]
    services = tuple(
        {"service": v.name, "gpu_mem_mib": v.gpu_mem_mib, "chunk_sizes": list(v.chunk_sizes),
         "load_s": v.load_s}
        for v in sorted(s.gpu.services.values(), key=lambda v: v.name)
    )
    pools = s.queues
    apis = tuple(
        {"api": a.name, "mode": a.mode, "limit": a.limit, "in_flight": len(a.in_flight), "used": a.used,
         "queued": len(pools.get("api:" + a.name, {})), "keys": a.keys.rows(at)}
        for a in sorted(s.basic.apis.values(), key=lambda a: a.name)
    )
    queued = sum(len(q) for q in pools.values())
    if limit is None:
        rows = sorted((w for q in pools.values() for w in q.values()), key=lambda w: w.seq)
    else:  # each pool is in submission order: merge their heads
        merged = heapq.merge(*(q.values() for q in pools.values()), key=lambda w: w.seq)
        rows = list(itertools.islice(merged, max(0, limit)))
    queue = tuple(queue_row(w, s._pool(w.spec), at) for w in rows)
    return Snapshot(s.now, tuple(nodes), services, apis, queue, queued, len(s.running),
                    tuple(sorted(s.counters.items())), job_rows(s), len(s.stages))


def job_rows(s: Scheduler) -> tuple[dict[str, object], ...]:
    """``jobs.rows`` plus each job's placed sandboxes' memory (``mem_mib``, ``JobBook.mem``) and
    its dominant share of the CPU pool (``dominant_share``: the larger of its cores and memory
    shares of the cluster's, ``JobBook.dominant_share``; what orders new trajectories)."""
    book = s.jobs
    cores = sum(n.total for n in s.cpu.nodes.values())
    mem = sum(n.mem_total for n in s.cpu.nodes.values())
    return tuple(
        {**row, "mem_mib": book.mem.get(str(row["job"]), 0),
         "dominant_share": round(book.dominant_share(str(row["job"]), cores, mem), 4)}
        for row in jobs.rows(s)
    )
