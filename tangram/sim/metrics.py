"""Figures from one simulation: ACT (mean, p50, p99), per-trajectory ACT breakdown
(environment interaction vs reward), queueing share, step time, resource-seconds and
utilisation, scheduler decision time.

Definitions (docs/simulator.md):
* ACT of an action = completion - submission (queueing + sandbox/pod wait + restore + run).
* ``env_act_s`` / ``reward_act_s``: per trajectory, the summed ACT of its tool actions / of
  its reward action, averaged over trajectories; ``total_act_s`` is their sum (Fig. 7).
* queueing = the part of ACT before the action really ran (waiting for units, for its
  sandbox or pod, or in API retries); ``queue_share`` = summed queueing / summed ACT.
* step time = the rollout (first submission to last trajectory's end) + ``train_s``.
* CPU: ``cpu_busy_core_s`` = cores x running time of every CPU action; ``cpu_held_core_s``
  = cores held (a pod's cores for its whole life; else from the start command to the
  end); utilisation = busy / (all cores x rollout time), efficiency = busy / held.
* ``exec_api_wait_s`` / ``exec_api_wait_p99_s`` (k8s): mean / p99 time an action's exec
  request waited in the API-server queue (part of its queueing); 0 for other policies.
* GPU: ``gpu_busy_s`` = GPUs x (restore + run); held = the same, or the static deployment's
  GPUs x rollout time; ``restore_share`` = restore time on the calls' paths (GPU-weighted) /
  GPU busy time. A restore started ahead of its call (pre-wake) is on a call's path only for
  what is left of it when the call starts; ``prewake_gpu_s`` is the GPU-seconds of those
  restores, ``prewakes`` their number; ``gpu_act_s`` is the mean ACT of GPU calls.
* APIs with keys (``keyed_throughput``): ``api_429`` = calls a provider answered HTTP 429
  (they reach rollout code); per keyed API, over the minutes (from its first call) in which
  a call of it waited the whole minute, the requests and tokens served per minute against
  the sum of its keys' RPM and TPM limits; ``share_of_limit`` is the larger of the two
  shares (the binding limit's).
* RL jobs (``jobs``, only for a workload whose trajectories name jobs; ``job_summary``): per
  job its actions, queue wait (start - submission: p50, p99, mean), core-seconds and
  GPU-seconds, and ``saturated_core_s``: the core-seconds it held while *every* job had a CPU
  action waiting (``saturated_s`` in all), when the weights decide the split.
"""

from __future__ import annotations

from typing import Any

from tangram.sim.engine import ActRecord, SimResult

MINUTE = 60.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(r: SimResult) -> dict[str, Any]:
    acts = [x.end - x.submit for x in r.records]
    queue = [max(0.0, x.start - x.submit) for x in r.records]
    per_traj: dict[str, list[float]] = {}
    for x in r.records:
        tid = x.aid.rsplit("/", 1)[0]
        e = per_traj.setdefault(tid, [0.0, 0.0])
        e[0 if x.category == "env" else 1] += x.end - x.submit
    n = max(1, len(per_traj))
    env = sum(v[0] for v in per_traj.values()) / n
    rew = sum(v[1] for v in per_traj.values()) / n
    rollout = sum(b - a for a, b in r.steps)
    steps = max(1, len(r.steps))
    out: dict[str, Any] = {
        "policy": r.policy,
        "workload": r.workload,
        "batch": r.batch,
        "seed": r.seed,
        "actions": len(r.records),
        "failed": sum(1 for x in r.records if not x.ok),
        "mean_act_s": _mean(acts),
        "p50_act_s": _pct(acts, 0.5),
        "p99_act_s": _pct(acts, 0.99),
        "env_act_s": env,
        "reward_act_s": rew,
        "total_act_s": env + rew,
        "mean_env_act_s": _mean([a for a, x in zip(acts, r.records, strict=True) if x.category == "env"]),
        "mean_reward_act_s": _mean(
            [a for a, x in zip(acts, r.records, strict=True) if x.category == "reward"]
        ),
        "queue_share": sum(queue) / sum(acts) if sum(acts) > 0 else 0.0,
        "rollout_s": rollout / steps,
        "step_time_s": rollout / steps + r.train_s,
        "api_attempts": sum(x.attempts for x in r.records),
    }
    waits = [run.api_wait for run in r.runs.values() if run.resource == "cpu"] if r.pods else []
    out["exec_api_wait_s"] = _mean(waits)
    out["exec_api_wait_p99_s"] = _pct(waits, 0.99)
    out.update(_resources(r, rollout))
    out["gpu_act_s"] = _mean([a for a, x in zip(acts, r.records, strict=True) if x.kind == "call"])
    out["prewakes"] = r.counters.get("prewakes", 0)
    out["prewake_gpu_s"] = r.prewake_gpu_s
    out["api_429"] = r.counters.get("api_429", 0)
    out["keyed"] = keyed_throughput(r)
    if jobs := job_summary(r):
        out["jobs"] = jobs
    shares = [v["share_of_limit"] for v in out["keyed"].values() if v["minutes"]]
    out["keyed_share"] = min(shares) if shares else None  # None: no keyed API waited a whole minute
    d = list(r.decide_s)
    out.update(
        {
            "events": r.events,
            "wall_s": r.wall_s,
            "events_per_s": r.events / r.wall_s if r.wall_s else 0.0,
            "decide_mean_us": _mean(d) * 1e6,
            "decide_p99_us": _pct(d, 0.99) * 1e6,
        }
    )
    return out


def _resources(r: SimResult, rollout: float) -> dict[str, Any]:
    cpu_busy = cpu_held = gpu_busy = gpu_held = restore = cpu_run = 0.0
    cpu_n = 0
    for run in r.runs.values():
        if run.resource == "cpu":
            cpu_run += max(0.0, run.end - run.start)
            cpu_n += 1
            busy = run.units * max(0.0, run.end - run.start)
            cpu_busy += busy
            cpu_held += run.units * max(0.0, run.end - run.alloc)
        elif run.resource == "gpu":
            busy = run.units * max(0.0, run.end - run.start)
            gpu_busy += busy
            gpu_held += busy
            restore += run.units * run.restore_s
    if r.pods:
        # a pod holds its cores from reservation to close; exec runs inside it
        cpu_held = sum(k * (max(b, a) - a) for a, b, k in r.pods.values())
        cpu_busy = sum(run.units * (run.end - run.start) for run in r.runs.values() if run.resource == "cpu")
    if r.static_gpus:
        gpu_held = r.static_gpus * rollout
    cores, gpus = r.spec.total_cores, r.spec.total_gpus
    return {
        "cpu_busy_core_s": cpu_busy,
        "cpu_held_core_s": cpu_held,
        "cpu_util": cpu_busy / (cores * rollout) if cores and rollout else 0.0,
        "cpu_efficiency": cpu_busy / cpu_held if cpu_held else 0.0,
        "gpu_busy_s": gpu_busy,
        "gpu_held_s": gpu_held,
        "gpu_util": gpu_busy / (gpus * rollout) if gpus and rollout else 0.0,
        "gpu_efficiency": gpu_busy / gpu_held if gpu_held else 0.0,
        "restore_share": restore / gpu_busy if gpu_busy else 0.0,
        "cpu_mean_run_s": cpu_run / cpu_n if cpu_n else 0.0,
        "gpus": gpus,
        "cores": cores,
    }


def keyed_throughput(r: SimResult) -> dict[str, dict[str, Any]]:
    """Per API with keys: served requests and tokens per saturated minute vs its keys' limits."""
    out: dict[str, dict[str, Any]] = {}
    for api, prov in sorted(r.keyed.items()):
        keys = list(prov.keys.values())
        rpm_lim = sum(k.rpm for k in keys) if all(k.rpm > 0 for k in keys) else 0
        tpm_lim = sum(k.tpm for k in keys) if all(k.tpm > 0 for k in keys) else 0
        minutes = _saturated_minutes([x for x in r.records if x.api == api], prov.served)
        reqs = [sum(1 for t, _ in prov.served if a <= t < a + MINUTE) for a in minutes]
        toks = [sum(n for t, n in prov.served if a <= t < a + MINUTE) for a in minutes]
        rpm, tpm = _mean(reqs), _mean(toks)
        share = max(rpm / rpm_lim if rpm_lim else 0.0, tpm / tpm_lim if tpm_lim else 0.0)
        out[api] = {"minutes": len(minutes), "rpm": rpm, "rpm_limit": rpm_lim, "tpm": tpm,
                    "tpm_limit": tpm_lim, "share_of_limit": share}
    return out


def _saturated_minutes(recs: list[ActRecord], served: list[tuple[float, int]]) -> list[float]:
    """Starts of the whole minutes, counted from the first served call, during all of which
    some call of the API waited (submitted, not yet started)."""
    if not served:
        return []
    waits = sorted((x.submit, x.start if x.start >= 0 else x.end) for x in recs)
    covered: list[tuple[float, float]] = []
    for a, b in waits:
        if b <= a:
            continue
        if covered and a <= covered[-1][1]:
            covered[-1] = (covered[-1][0], max(covered[-1][1], b))
        else:
            covered.append((a, b))
    first, last = served[0][0], served[-1][0]
    out: list[float] = []
    m = first
    while m + MINUTE <= last:
        if any(a <= m and m + MINUTE <= b for a, b in covered):
            out.append(m)
        m += MINUTE
    return out


def _windows(r: SimResult, jobs: list[str]) -> list[tuple[float, float]]:
    """The intervals during which every job in ``jobs`` had a CPU action waiting."""
    edges = []
    for x in r.records:
        start = x.start if x.start >= 0 else x.end
        if x.kind == "exec" and start > x.submit:
            edges += [(x.submit, 1, x.job), (start, -1, x.job)]
    edges.sort()
    waiting = dict.fromkeys(jobs, 0)
    out: list[tuple[float, float]] = []
    since: float | None = None
    for t, d, job in edges:
        waiting[job] += d
        every = all(n > 0 for n in waiting.values())
        if every and since is None:
            since = t
        elif not every and since is not None:
            if t > since:
                out.append((since, t))
            since = None
    return out


def job_summary(r: SimResult) -> dict[str, dict[str, Any]]:
    """Per job of the run (module docstring); empty when no trajectory names a job."""
    jobs = sorted({x.job for x in r.records if x.job})
    if not jobs:
        return {}
    job_of = {x.aid: x.job for x in r.records}
    wins = _windows(r, jobs) if len(jobs) > 1 else []
    out: dict[str, dict[str, Any]] = {}
    for job in jobs:
        waits = [max(0.0, x.start - x.submit) for x in r.records if x.job == job]
        out[job] = {"actions": len(waits), "p50_wait_s": _pct(waits, 0.5), "p99_wait_s": _pct(waits, 0.99),
                    "mean_wait_s": sum(waits) / len(waits) if waits else 0.0, "core_s": 0.0, "gpu_s": 0.0,
                    "saturated_core_s": 0.0}
    for aid, run in r.runs.items():
        row = out.get(job_of.get(aid, ""))
        if row is None:
            continue
        row["core_s" if run.resource == "cpu" else "gpu_s"] += run.units * max(0.0, run.end - run.start)
        if run.resource == "cpu":
            row["saturated_core_s"] += run.units * sum(
                max(0.0, min(b, run.end) - max(a, run.start)) for a, b in wins
            )
    for row in out.values():
        row["saturated_s"] = sum(b - a for a, b in wins)
    return out
