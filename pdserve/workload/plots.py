"""PNG plots of serving benchmarks (matplotlib, no display needed): latency CDFs of every run, and
goodput and p99 TPOT against load for each configuration of a sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.workload.metrics import RequestRecord

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end to end"))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _values_ms(records: list[RequestRecord], metric: str) -> list[float]:
    done = [r for r in records if r.ok]
    if metric == "ttft":
        v = [r.ttft for r in done]
    elif metric == "tpot":
        v = [t for r in done if (t := r.tpot) is not None]
    elif metric == "itl":
        v = [g for r in done for g in r.itls]
    else:
        v = [r.e2e for r in done]
    return [x * 1e3 for x in v]


def latency_cdfs(runs: dict[str, list[RequestRecord]], path: Path, title: str = "") -> Path:
    """One panel per latency metric, one CDF line per run (label -> its records)."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, name) in zip(axes.flat, METRICS):
        lo, hi = np.inf, 0.0
        for label, records in runs.items():
            v = np.sort(_values_ms(records, metric))
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)
                lo, hi = min(lo, v[0]), max(hi, v[-1])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        if lo > 0 and hi / lo > 30:  # spread over decades: a log axis, labelled by decade only
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3, which="both")
    axes.flat[0].legend(fontsize=8)
    return save_figure(plt, fig, title or "latency CDFs", path)


def load_curves(series: dict[str, list[dict]], load_key: str, path: Path, title: str = "") -> Path:
    """Goodput and p99 TPOT against load; one line per configuration (name -> run summaries,
    each with `load[load_key]`)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in series.items():
        x = [r["load"][load_key] for r in runs]
        left.plot(x, [r["goodput"] for r in runs], marker="o", label=name)
        right.plot(x, [r["tpot"]["p99"] if r["tpot"]["p99"] is not None else np.nan for r in runs], marker="o",
                   label=name)
    unit = "requests/s offered" if load_key == "request_rate" else "concurrent requests"
    slo = next((r["slo_ms"] for runs in series.values() for r in runs), None)
    left.set(xlabel=unit, ylabel="goodput (requests/s within SLA)", title="goodput")
    right.set(xlabel=unit, ylabel="p99 TPOT (ms)", title="p99 time per output token")
    if slo:
        right.axhline(slo["tpot"], color="grey", linestyle="--", label=f"TPOT target {slo['tpot']:g} ms")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(plt, fig, title or "serving under load", path)


def save_figure(plt, fig, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
