"""PNG plots of simulator results (matplotlib, imported lazily; `pip install matplotlib`
or the `[plot]` extra)."""

from __future__ import annotations

from typing import Any

from tangram.errors import ConfigError


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed",
            hint="pip install matplotlib (or pip install 'tangram-rl[plot]')",
        ) from None
    return plt


def _bars(ax: Any, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    n = len(series)
    width = 0.8 / max(1, n)
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.legend()


def plot_runs(doc: dict[str, dict[str, Any]], path: str, title: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pols = list(doc)
    _bars(
        axes[0],
        ["mean", "p50", "p99"],
        {p: [doc[p]["mean_act_s"], doc[p]["p50_act_s"], doc[p]["p99_act_s"]] for p in pols},
        "ACT (s)",
    )
    _bars(
        axes[1],
        ["env", "reward", "step"],
        {p: [doc[p]["env_act_s"], doc[p]["reward_act_s"], doc[p]["step_time_s"]] for p in pols},
        "seconds (per trajectory / per step)",
    )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_experiment(doc: dict[str, Any], path: str) -> None:
    plt = _plt()
    name = doc["experiment"]
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(10, 5))
    if name in ("fig6", "fig7"):
        labels = list(dict.fromkeys(r["workload"] for r in rows))
        tang = [next(r for r in rows if r["workload"] == w and r["policy"] == "tangram") for w in labels]
        base = [next(r for r in rows if r["workload"] == w and r["policy"] != "tangram") for w in labels]
        labels = [f"{w}\nvs {b['policy']}\nbatch {b['batch']}" for w, b in zip(labels, base, strict=True)]
        if name == "fig6":
            _bars(
                ax,
                labels,
                {"baseline": [r["total_act_s"] for r in base], "tangram": [r["total_act_s"] for r in tang]},
                "ACT per trajectory (s)",
            )
            for j, (b, t) in enumerate(zip(base, tang, strict=True)):
                ax.annotate(
                    f"step {b['step_time_s']:.0f}s -> {t['step_time_s']:.0f}s",
                    (j, 0),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        else:
            xs = range(len(labels))
            for off, rs, lab in ((-0.2, base, "baseline"), (0.2, tang, "tangram")):
                env = [r["env_act_s"] for r in rs]
                rew = [r["reward_act_s"] for r in rs]
                ax.bar([x + off for x in xs], env, 0.38, label=f"{lab}: env interaction")
                ax.bar([x + off for x in xs], rew, 0.38, bottom=env, label=f"{lab}: reward")
            ax.set_xticks(list(xs), labels)
            ax.set_ylabel("ACT per trajectory (s)")
            ax.legend(fontsize=8)
    elif name == "fig8-gpu":
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        _line(ax, rows, "mean ACT (s)")
        sw = doc["gpu_sweep"]
        ax2.plot([r["gpus"] for r in sw], [r["mean_act_s"] for r in sw], marker="o", label="tangram")
        ax2.axhline(doc["ours"]["static_mean_act_s"], color="gray", linestyle="--", label="static (36 GPUs)")
        ax2.set_yscale("log")
        ax2.set_title(f"batch {sw[0]['batch']}: GPUs for static's ACT")
        ax2.set_xlabel("GPUs given to tangram")
        ax2.set_ylabel("mean ACT (s)")
        ax2.legend()
    elif name == "fig9":
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        _line(ax, rows, "mean ACT (s)")
        sw = doc["cpu_sweep"]
        for p in dict.fromkeys(r["policy"] for r in sw):
            pts = [(r["cpu_nodes"], r["reward_act_s"] + r["env_act_s"]) for r in sw if r["policy"] == p]
            ax2.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax2.set_title(f"batch {sw[0]['batch']}: CPU pool size")
        ax2.set_xlabel("CPU nodes (256 cores each)")
        ax2.set_ylabel("total ACT per trajectory (s)")
        ax2.legend()
    elif name == "table1":
        labels = list(doc["ours"])
        _bars(
            ax,
            labels,
            {
                "decide mean (us)": [doc["ours"][k]["decide_mean_us"] for k in labels],
                "decide p99 (us)": [doc["ours"][k]["decide_p99_us"] for k in labels],
            },
            "microseconds",
        )
    else:
        _line(ax, rows, "mean ACT (s)")
    ax.set_title(f"{name} (simulated)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _line(ax: Any, rows: list[dict[str, Any]], ylabel: str) -> None:
    for p in dict.fromkeys(r["policy"] for r in rows):
        pts = [(r["batch"], r["mean_act_s"]) for r in rows if r["policy"] == p]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    ax.set_xlabel("RL batch size")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.legend()
