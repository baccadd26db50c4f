"""`pdserve bench shift`'s arithmetic and output: per-half summaries of each configuration, the best
static split of each half, the P:D controller's moves read from the router's log, the markdown
table and the timeline plot. Pure functions of records and text, apart from the plot's file."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import numpy as np

from pdserve.workload.metrics import RequestRecord, summarize

REBALANCE = "rebalance"
BASELINE = "1P1D"
# the router's log line for a move, and the worker's once it serves in its new role
_MOVE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) pdserve\.router INFO rebalance: (\S+) (\w+) -> (\w+): (.*)$")
_SAID = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) pdserve\.router INFO rebalance: "
                   r"((?:balanced|blocked|to_\w+ asked|to_\w+ held).*)$")
_ROLE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) pdserve\.worker INFO role (\w+) -> (\w+) \((.*)\)$")


def half_summaries(records: list[RequestRecord], phase_of: list[int], num_phases: int, ttft_slo_s: float,
                   tpot_slo_s: float) -> list[dict]:
    """One summary per phase, of the requests sent in it."""
    return [summarize([r for r, p in zip(records, phase_of) if p == i], ttft_slo_s, tpot_slo_s)
            for i in range(num_phases)]


def best_static(results: dict[str, dict], half: int) -> str | None:
    """The static configuration with the most goodput in `half` (more output tokens/s breaks a tie)."""
    static = [name for name, r in results.items() if not r["rebalance"]]
    if not static:
        return None
    return max(static, key=lambda n: (results[n]["halves"][half]["goodput"], results[n]["halves"][half]["output_throughput"]))


def ratios(results: dict[str, dict], num_phases: int) -> list[dict]:
    """Per half: the best static split, and the controller's goodput against static 1P1D and it."""
    out = []
    for half in range(num_phases):
        best = best_static(results, half)
        row: dict = {"half": half, "best_static": best}
        if REBALANCE in results:
            ours = results[REBALANCE]["halves"][half]["goodput"]
            for key, name in (("vs_1p1d", BASELINE), ("vs_best_static", best)):
                base = results[name]["halves"][half]["goodput"] if name in results else None
                row[key] = ours / base if base else None
        out.append(row)
    return out


def _epoch(stamp: str, millis: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1e3


def parse_moves(log: str, start_epoch: float) -> list[dict]:
    """The controller's moves in a `pdserve serve` log: when each was decided (seconds from
    `start_epoch`), which worker, from and to which role, why, and when a worker first served in
    that new role afterwards (None if none did within the log)."""
    moves, changes = [], []
    for line in log.splitlines():
        if m := _MOVE.match(line):
            moves.append({"at_s": round(_epoch(m[1], m[2]) - start_epoch, 3), "worker": m[3], "from": m[4],
                          "to": m[5], "reason": m[6], "serving_at_s": None})
        elif m := _ROLE.match(line):
            changes.append((_epoch(m[1], m[2]) - start_epoch, m[3], m[4], m[5]))
    for move in moves:
        done = next((c for c in changes if c[0] >= move["at_s"] - 1e-3 and c[1:3] == (move["from"], move["to"])), None)
        if done is not None:
            changes.remove(done)
            move["serving_at_s"], move["drain"] = round(done[0], 3), done[3]
    return moves


def parse_decisions(log: str, start_epoch: float) -> list[dict]:
    """The controller's changes of mind that moved nothing (balanced, a need being confirmed, one
    held by the dwell), with their times in seconds from `start_epoch` and the signals it read."""
    return [{"at_s": round(_epoch(m[1], m[2]) - start_epoch, 3), "said": m[3]}
            for line in log.splitlines() if (m := _SAID.match(line))]


def table(results: dict[str, dict], num_phases: int) -> str:
    lines = ["| config | half | done/sent | goodput req/s | SLA % | TTFT p50 / p90 ms | TPOT p50 / p90 ms | out tok/s "
             "| vs 1P1D | vs best static |", "|" + " --- |" * 10]
    best = ratios(results, num_phases)
    f = lambda d: "-" if d["p50"] is None else f"{d['p50']:.0f} / {d['p90']:.0f}"  # noqa: E731
    for name, res in results.items():
        for half, s in enumerate(res["halves"]):
            vs = ["-", "-"]
            base = results.get(BASELINE)
            if base is not None and name != BASELINE and base["halves"][half]["goodput"] > 0:
                vs[0] = f"{s['goodput'] / base['halves'][half]['goodput']:.2f}x"
            winner = best[half]["best_static"]
            if name == winner:
                vs[1] = "best"
            elif winner is not None and results[winner]["halves"][half]["goodput"] > 0:
                vs[1] = f"{s['goodput'] / results[winner]['halves'][half]['goodput']:.2f}x"
            lines.append(f"| {name} | {half + 1} | {s['completed']}/{s['num_requests']} | {s['goodput']:.3f} "
                         f"| {s['sla_attainment_pct']:.0f} | {f(s['ttft'])} | {f(s['tpot'])} "
                         f"| {s['output_throughput']:.1f} | {vs[0]} | {vs[1]} |")
    moves = results.get(REBALANCE, {}).get("moves")
    if moves is not None:
        lines.append("")
        lines.append(f"{REBALANCE}: started as {results[REBALANCE]['split']}; "
                     + (f"{len(moves)} move(s):" if moves else "no move."))
        for m in moves:
            serving = "" if m["serving_at_s"] is None else f", serving as {m['to']} at {m['serving_at_s']:.0f}s"
            lines.append(f"- at {m['at_s']:.0f}s {m['worker']} {m['from']} -> {m['to']}{serving}: {m['reason']}")
        said = results[REBALANCE].get("decisions") or []
        if said:
            lines.append(f"It changed its mind {len(said)} time(s) without moving (all in the JSON); the last, "
                         f"at {said[-1]['at_s']:.0f}s: {said[-1]['said']}")
    return "\n".join(lines)


def output_rate(records: list[RequestRecord], bin_s: float, t0: float, end_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in bins of `bin_s` from `t0` (each chunk's tokens where it arrived)."""
    edges = np.arange(0.0, end_s + bin_s, bin_s)
    counts = np.zeros(len(edges) - 1)
    for r in records:
        if r.chunk_times and r.output_tokens:
            per_chunk = r.output_tokens / len(r.chunk_times)
            idx = np.clip(((np.asarray(r.chunk_times) - t0) // bin_s).astype(int), 0, len(counts) - 1)
            np.add.at(counts, idx, per_chunk)
    return edges[:-1] + bin_s / 2, counts / bin_s


def timeline_plot(runs: dict[str, tuple[list[RequestRecord], float]], moves: list[dict], boundaries: list[float],
                  ttft_slo_s: float, path: Path, title: str, bin_s: float = 5.0) -> Path:
    """Output tokens/s and TTFT (by send time) over the run, one line per configuration (name ->
    its records and the perf_counter time its load started); the phase boundaries and the
    controller's moves marked."""
    from pdserve.workload.plots import pyplot, save_figure

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    end_s = max((r.end - t0 for recs, t0 in runs.values() for r in recs if r.end is not None), default=1.0)
    for name, (records, t0) in runs.items():
        x, y = output_rate(records, bin_s, t0, end_s)
        line, = top.plot(x, y, label=name)
        done = sorted((r.start - t0, r.ttft) for r in records if r.ok)
        if done:
            bottom.plot([d[0] for d in done], [d[1] for d in done], ".", color=line.get_color(), alpha=0.6,
                        label=name)
    for ax in (top, bottom):
        for b in boundaries[1:]:
            ax.axvline(b, color="black", linestyle="--", linewidth=1)
        for m in moves:
            ax.axvline(m["at_s"], color="red", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
    for m in moves:
        top.annotate(f"{REBALANCE}: {m['from']} -> {m['to']}", (m["at_s"], 0), xycoords=("data", "axes fraction"),
                     rotation=90, va="bottom", ha="right", fontsize=7, color="red")
    bottom.axhline(ttft_slo_s, color="grey", linestyle="--", label=f"TTFT target {ttft_slo_s:g} s")
    top.set(ylabel="output tokens/s", title=f"output throughput ({bin_s:g} s bins); dashed: the phase changes")
    bottom.set(xlabel="seconds from the start of the load", ylabel="TTFT (s), by send time")
    if any(not math.isnan(v) for v in bottom.get_ylim()):
        bottom.set_yscale("log")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    return save_figure(plt, fig, title, path)
