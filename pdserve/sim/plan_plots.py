"""PNG plots of plans: the cost/goodput Pareto front, and a trace's P:D over time."""

from __future__ import annotations

from pathlib import Path

from pdserve.workload.plots import pyplot, save_figure


def pareto_plot(result: dict, out_dir: Path) -> Path:
    """Goodput against GPUs: the best of each mode at each cost (from the capacities), the demanded
    rate, and the plan."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("colocated", "s"), ("disaggregated", "o")):
        pts = result.get("fronts", {}).get(mode) or [c for c in result["pareto"] if c["mode"] == mode]
        ax.plot([c["num_gpus"] for c in pts], [c["goodput"] for c in pts], marker=marker, label=f"best {mode}")
    ax.axhline(result["traffic"]["qps"], color="red", linestyle="--", label="demanded rate")
    if result.get("best"):
        b = result["best"]
        ax.scatter([b["num_gpus"]], [b["goodput"]], s=160, facecolors="none", edgecolors="black",
                   label="plan (goodput simulated whole)")
    ax.set(xlabel="GPUs", ylabel="goodput (requests/s within SLA)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, "cost against goodput", out_dir / "plan_pareto.png")


def trace_plot(windows: list[dict], out_dir: Path) -> Path:
    """Demand, and the prefill and decode instances recommended for it, over the trace."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [w["time_s"] / 3600 for w in windows]
    top.step(t, [w["qps"] for w in windows], where="post", label="requests/s")
    top.set(ylabel="demand (req/s)")
    bottom.step(t, [w["num_prefill"] for w in windows], where="post", label="prefill instances")
    bottom.step(t, [w["num_decode"] for w in windows], where="post", linestyle="--", label="decode instances")
    bottom.set(xlabel="hours into the trace", ylabel="instances")
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(plt, fig, "rate matching over the trace", out_dir / "plan_trace.png")
