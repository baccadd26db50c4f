"""The chaos benchmark's report: the summary of each run, goodput under faults against the baseline,
a markdown table of runs and one of faults with the breakdown of each recovery, and a plot of
throughput over time with the faults marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.bench.chaos.load import OUTCOMES, RequestResult

BIN_S = 2.0


def goodput(results: list[RequestResult], t0: float) -> dict:
    """Requests that ended well, and their output tokens, per second of the run (its start to the
    last request's end)."""
    ends = [r.end for r in results if r.end is not None]
    seconds = max(1e-9, (max(ends) if ends else t0) - t0)
    ok = [r for r in results if r.outcome == "ok"]
    return {"seconds": round(seconds, 2), "requests_per_s": round(len(ok) / seconds, 4),
            "output_tokens_per_s": round(sum(r.tokens for r in ok) / seconds, 2)}


def latency(results: list[RequestResult]) -> dict:
    """End-to-end seconds of the requests that ended well: p50, p99, max (a fault's fallback that
    waits shows here, not as a failure)."""
    e2e = sorted(r.end - r.start for r in results if r.outcome == "ok")
    if not e2e:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    pick = lambda q: round(float(np.percentile(e2e, q)), 3)  # noqa: E731
    return {"p50_s": pick(50), "p99_s": pick(99), "max_s": round(e2e[-1], 3)}


def outcome_counts(results: list[RequestResult]) -> dict[str, int]:
    return {o: sum(r.outcome == o for r in results) for o in OUTCOMES}


def details(results: list[RequestResult], outcome: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if r.outcome == outcome:
            out[r.detail] = out.get(r.detail, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def throughput_series(results: list[RequestResult], t0: float, bin_s: float = BIN_S) -> dict:
    """Per bin of `bin_s` seconds from t0: text chunks streamed per second (a chunk is about a
    token), requests that ended well per second, and requests that ended badly."""
    ends = [r.end for r in results if r.end is not None]
    span = max(ends) - t0 if ends else 0.0
    edges = np.arange(0.0, span + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    chunks = np.histogram([t - t0 for r in results for t in r.chunk_times], edges)[0] / bin_s
    ok = np.histogram([r.end - t0 for r in results if r.outcome == "ok"], edges)[0] / bin_s
    bad = np.histogram([r.end - t0 for r in results if r.outcome != "ok" and r.end is not None], edges)[0]
    return {"bin_s": bin_s, "t_s": [round(float(e), 2) for e in edges[:-1]],
            "tokens_per_s": [round(float(x), 2) for x in chunks], "ok_per_s": [round(float(x), 3) for x in ok],
            "not_ok": [int(x) for x in bad]}


def markdown(result: dict) -> str:
    runs = result["runs"]
    base = runs.get("baseline")
    lines = ["| run | requests | ok | error | lost | ok req/s | out tok/s | goodput vs baseline | e2e p50 / p99 / max s "
             "| KV blocks in use at end | unexpected exits |", "|" + " --- |" * 11]
    for label, run in runs.items():
        c, g = run["outcomes"], run["goodput"]
        ratio = "-" if base is None or label == "baseline" or not base["goodput"]["requests_per_s"] else (
            f"{g['requests_per_s'] / base['goodput']['requests_per_s']:.2f} req, "
            f"{g['output_tokens_per_s'] / max(1e-9, base['goodput']['output_tokens_per_s']):.2f} tok")
        blocks = "?" if run["kv_blocks_in_use_at_end"] is None else f"{run['kv_blocks_in_use_at_end']:g}"
        e2e = " / ".join("-" if v is None else f"{v:.1f}" for v in run["latency"].values())
        lines.append(f"| {label} | {sum(c.values())} | {c['ok']} | {c['error']} | {c['lost']} "
                     f"| {g['requests_per_s']:.3f} | {g['output_tokens_per_s']:.1f} | {ratio} | {e2e} | {blocks} "
                     f"| {len(run['unexpected_exits'])} |")
    causes = [(label, run) for label, run in runs.items() if run["outcomes"]["error"] and "errors_by_cause" in run]
    if causes:
        lines += ["", "errors by cause: refused (no router took it), in flight when a fault went in (by the "
                  "fault's kind), later (no fault while it ran)", "",
                  "| run | errors | refused | in flight | later |", "|" + " --- |" * 5]
        for label, run in causes:
            e = run["errors_by_cause"]
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(e["in_flight_by_fault"].items()))
            lines.append(f"| {label} | {run['outcomes']['error']} | {e['refused']} "
                         f"| {e['in_flight']}{f' ({kinds})' if kinds else ''} | {e['later']} |")
    for label, run in runs.items():
        if not run["faults"]:
            continue
        lines += ["", f"{label}: recovery per fault (seconds after it; each step since the mark before)", "",
                  "| fault | target | at s | recovered in s | steps | requests meanwhile ok / error / lost |",
                  "|" + " --- |" * 6]
        for f in run["faults"]:
            b = f["recovery"]
            steps = " → ".join(f"{name} {s:.1f}" for name, s in b["steps_s"].items()) or "-"
            total = "not recovered" if not b["recovered"] else f"{b['total_s']:.1f}"
            m = b["requests_meanwhile"]
            kind = f["kind"] + (f":{f['seconds']:g}" if f["kind"] == "freeze-worker" else "")
            lines.append(f"| {kind} | {f['target']} | {f['injected_s']:.1f} | {total} | {steps} "
                         f"| {m['ok']} / {m['error']} / {m['lost']} |")
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    parts = []
    for label, run in result["runs"].items():
        c, g = run["outcomes"], run["goodput"]
        parts.append(f"{label}: {c['ok']} ok, {c['error']} error, {c['lost']} lost, "
                     f"{g['requests_per_s']:.2f} req/s, {g['output_tokens_per_s']:.0f} tok/s")
    return "chaos " + ("passed" if result["passed"] else "FAILED") + " | " + " | ".join(parts)


def plot(result: dict, path: Path) -> Path:
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (label, run) in zip(axes[:, 0], runs.items()):
        series = run["throughput"]
        ax.step(series["t_s"], series["tokens_per_s"], where="post", label="tokens/s streamed", color="tab:blue")
        ax.set_ylabel("tokens/s")
        twin = ax.twinx()
        twin.step(series["t_s"], series["ok_per_s"], where="post", label="requests/s ok", color="tab:green",
                  alpha=0.7)
        bad = [(t, n) for t, n in zip(series["t_s"], series["not_ok"]) if n]
        if bad:
            twin.scatter([t + series["bin_s"] / 2 for t, _ in bad], [0] * len(bad), marker="x", color="tab:red",
                         label="requests not ok")
        twin.set_ylabel("requests/s")
        for f in run["faults"]:
            start = f["injected_s"]
            ax.axvline(start, color="tab:red", linestyle="--", linewidth=1)
            if f["recovered_s"] is not None:
                ax.axvspan(start, f["recovered_s"], color="tab:red", alpha=0.08)
            ax.text(start, ax.get_ylim()[1] * 0.95, f" {f['kind']}\n {f['target']}", fontsize=7, va="top")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("seconds since the load started")
    return save_figure(plt, fig, f"{next(iter(runs.values()))['model']}: throughput under faults", path)
