"""PNG plots of simulator results (matplotlib, imported lazily; `pip install matplotlib`
or the `[plot]` extra).

Every figure colours a policy the same way (``POLICY_COLOURS``, via ``colour_of``), puts
absolute times on a log axis (MOPD's seconds next to coding's thousands stay visible), labels
each bar above its top, and an experiment's plot has a second panel with our ratios next to
the paper's (hatched bars), from ``tangram.sim.report.compare``. The plot functions return the
colour they used per policy (what a test compares across figures).
"""

from __future__ import annotations

import zlib
from typing import Any

from tangram.errors import ConfigError
from tangram.sim.report import compare

# one palette for all figures: a policy keeps its colour everywhere
POLICY_COLOURS: dict[str, str] = {
    "tangram": "#1f77b4",
    "k8s": "#d62728",
    "static": "#ff7f0e",
    "serverless": "#9467bd",
    "fixed-dop": "#2ca02c",
    "api-retry": "#8c564b",
    "api-retry+static": "#8c564b",
}
PAPER_COLOUR = "#7f7f7f"
_FALLBACK = ("#17becf", "#bcbd22", "#e377c2", "#393b79", "#637939", "#843c39")

Colours = dict[str, str]


def colour_of(policy: str) -> str:
    """The policy's colour: its own entry, else its family's (``k8s:8`` -> ``k8s``), else a
    fixed pick from a fallback list by a hash of the name (stable across runs)."""
    if policy in POLICY_COLOURS:
        return POLICY_COLOURS[policy]
    family = policy.split(":", 1)[0]
    if family in POLICY_COLOURS:
        return POLICY_COLOURS[family]
    return _FALLBACK[zlib.crc32(policy.encode()) % len(_FALLBACK)]


def _plt() -> Any:
    try:  # matplotlib is optional (the `plot` extra): imported only when a plot is asked for
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed",
            hint="pip install matplotlib (or pip install 'tangram-rl[plot]')",
        ) from None
    return plt


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _label(ax: Any, bars: Any) -> None:
    """Value labels just above each bar (rotated when the bars are narrow)."""
    narrow = len(bars) > 6
    ax.bar_label(
        bars,
        labels=[_num(b.get_height()) for b in bars],
        padding=2,
        fontsize=7,
        rotation=90 if narrow else 0,
    )


def _headroom(ax: Any, log: bool) -> None:
    """Room above the tallest bar for its label."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * (4.0 if log else 1.15))


def _bars(
    ax: Any,
    labels: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    used: Colours,
    log: bool = True,
) -> None:
    """Grouped bars, one series per policy, coloured by ``colour_of``."""
    n = len(series)
    width = 0.8 / max(1, n)
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        used[name] = colour_of(name)
        _label(ax, ax.bar(xs, ys, width, label=name, color=used[name]))
    if log:
        ax.set_yscale("log")
    _headroom(ax, log)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel + (" (log)" if log else ""))
    ax.legend(fontsize=8)


def plot_runs(doc: dict[str, dict[str, Any]], path: str, title: str) -> Colours:
    plt = _plt()
    used: Colours = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pols = list(doc)
    _bars(
        axes[0],
        ["mean", "p50", "p99"],
        {p: [doc[p]["mean_act_s"], doc[p]["p50_act_s"], doc[p]["p99_act_s"]] for p in pols},
        "ACT (s)",
        used,
    )
    _bars(
        axes[1],
        ["env", "reward", "step"],
        {p: [doc[p]["env_act_s"], doc[p]["reward_act_s"], doc[p]["step_time_s"]] for p in pols},
        "seconds (per trajectory / per step)",
        used,
    )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return used


def _pairs(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict], list[dict]]:
    """(workloads, Tangram's rows, the baseline's rows) of fig6/fig7."""
    names = list(dict.fromkeys(r["workload"] for r in rows))
    tang = [next(r for r in rows if r["workload"] == w and r["policy"] == "tangram") for w in names]
    base = [next(r for r in rows if r["workload"] == w and r["policy"] != "tangram") for w in names]
    return names, tang, base


def _fig6(ax: Any, rows: list[dict[str, Any]], used: Colours) -> None:
    names, tang, base = _pairs(rows)
    xs = range(len(names))
    for off, rs in ((-0.2, base), (0.2, tang)):
        for x, r in zip(xs, rs, strict=True):
            used[r["policy"]] = colour_of(r["policy"])
            bars = ax.bar([x + off], [r["total_act_s"]], 0.38, color=used[r["policy"]])
            _label(ax, bars)
    ax.set_yscale("log")
    _headroom(ax, True)
    ax.set_xticks(list(xs), [f"{w}\nbatch {b['batch']}" for w, b in zip(names, base, strict=True)])
    ax.set_ylabel("ACT per trajectory (s, log)")
    _legend(ax, used)


def _fig7(ax: Any, rows: list[dict[str, Any]], used: Colours) -> None:
    """Env + reward ACT per trajectory, normalised to the baseline's total per workload."""
    names, tang, base = _pairs(rows)
    xs = range(len(names))
    for off, rs in ((-0.2, base), (0.2, tang)):
        for x, r, b in zip(xs, rs, base, strict=True):
            scale = b["total_act_s"] or 1.0
            c = used[r["policy"]] = colour_of(r["policy"])
            env, rew = r["env_act_s"] / scale, r["reward_act_s"] / scale
            ax.bar([x + off], [env], 0.38, color=c)
            top = ax.bar([x + off], [rew], 0.38, bottom=[env], color=c, alpha=0.45, hatch="..")
            ax.bar_label(top, labels=[f"{_num(r['total_act_s'])}s"], padding=2, fontsize=7)
    ax.set_ylim(0, 1.35)
    ax.set_xticks(list(xs), [f"{w}\nbatch {b['batch']}" for w, b in zip(names, base, strict=True)])
    ax.set_ylabel("ACT per trajectory / baseline's (dotted: reward)")
    _legend(ax, used)


def _legend(ax: Any, used: Colours) -> None:
    from matplotlib.patches import Patch  # optional dependency; _plt() checked it is there

    ax.legend(
        handles=[Patch(color=c, label=p) for p, c in used.items()], fontsize=8, loc="upper center", ncol=4
    )


def _line(ax: Any, rows: list[dict[str, Any]], ylabel: str, used: Colours, x: str = "batch") -> None:
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = [(r[x], r["mean_act_s"]) for r in rows if r["policy"] == p]
        used[p] = colour_of(p)
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p, color=used[p])
    ax.set_xlabel("RL batch size" if x == "batch" else x)
    ax.set_ylabel(ylabel + " (log)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)


def _vs_paper(ax: Any, doc: dict[str, Any]) -> None:
    """Our ratios (Tangram's colour) next to the paper's (hatched), where the paper gives a number."""
    rows = [r for r in compare(doc) if r.ratio is not None]
    if not rows:
        ax.set_axis_off()
        ax.set_title("no numeric figure in the paper to compare")
        return
    xs = range(len(rows))
    ours = ax.bar(
        [x - 0.2 for x in xs], [r.ours for r in rows], 0.38, color=colour_of("tangram"), label="ours"
    )
    paper = ax.bar(
        [x + 0.2 for x in xs],
        [r.paper for r in rows],
        0.38,
        color="white",
        edgecolor=PAPER_COLOUR,
        hatch="//",
        label="paper",
    )
    _label(ax, ours)
    _label(ax, paper)
    ax.set_yscale("log")
    _headroom(ax, True)
    ticks = [r.result.split(" (")[0] + (" [OFF]" if r.check == "OFF" else "") for r in rows]
    ax.set_xticks(list(xs), ticks, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("figure (ratio or share, log)")
    ax.set_title("ours vs the paper ([OFF]: outside ±25%)")
    ax.legend(fontsize=8)


def _gpu_sweep(ax: Any, doc: dict[str, Any], used: Colours) -> None:
    sw = doc["gpu_sweep"]
    used["tangram"] = colour_of("tangram")
    ax.plot(
        [r["gpus"] for r in sw],
        [r["mean_act_s"] for r in sw],
        marker="o",
        label="tangram",
        color=used["tangram"],
    )
    static = doc["ours"]["static_mean_act_s"]
    used["static"] = colour_of("static")
    ax.axhline(
        static, color=used["static"], linestyle="--", label=f"static ({doc['ours'].get('static_gpus')} GPUs)"
    )
    ax.set_yscale("log")
    ax.set_title(f"batch {sw[0]['batch']}: GPUs for static's ACT")
    ax.set_xlabel("GPUs given to tangram")
    ax.set_ylabel("mean ACT (s, log)")
    ax.legend(fontsize=8)


def _cpu_sweep(ax: Any, doc: dict[str, Any], used: Colours) -> None:
    sw = doc["cpu_sweep"]
    for p in dict.fromkeys(r["policy"] for r in sw):
        pts = [(r["cpu_nodes"], r["reward_act_s"] + r["env_act_s"]) for r in sw if r["policy"] == p]
        used[p] = colour_of(p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p, color=used[p])
    ax.set_title(f"batch {sw[0]['batch']}: CPU pool size")
    ax.set_xlabel("CPU nodes (256 cores each)")
    ax.set_ylabel("total ACT per trajectory (s)")
    ax.legend(fontsize=8)


_SWEEPS = {"gpu_sweep": _gpu_sweep, "cpu_sweep": _cpu_sweep}


def plot_experiment(doc: dict[str, Any], path: str) -> Colours:
    """The experiment's figure, its sweep (fig8-gpu, fig9) and ours vs the paper, side by side."""
    plt = _plt()
    name, rows = doc["experiment"], doc["rows"]
    used: Colours = {}
    sweeps = [key for key in _SWEEPS if doc.get(key)]
    fig, axes = plt.subplots(1, 2 + len(sweeps), figsize=(6.5 * (2 + len(sweeps)), 5))
    ax, ax2 = axes[0], axes[-1]
    for key, sub in zip(sweeps, axes[1:-1], strict=True):
        _SWEEPS[key](sub, doc, used)
    if name == "fig6":
        _fig6(ax, rows, used)
    elif name == "fig7":
        _fig7(ax, rows, used)
    elif name == "table1":
        labels = list(doc["ours"])
        series = {
            "decide mean (us)": [doc["ours"][k]["decide_mean_us"] for k in labels],
            "decide p99 (us)": [doc["ours"][k]["decide_p99_us"] for k in labels],
        }
        _bars(ax, labels, series, "microseconds", {})
        used["tangram"] = colour_of("tangram")
    else:
        _line(ax, rows, "mean ACT (s)", used)
    ax.set_title(f"{name} (simulated)")
    ax.tick_params(axis="x", labelsize=8)
    _vs_paper(ax2, doc)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return used
