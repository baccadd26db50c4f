"""`pdserve plan --trace FILE`: dynamic rate matching, P:D recommended for every window of a trace.

A trace is CSV with a header (`time_s,qps`, optionally `isl,osl`) or JSONL with those keys; each
row starts a window that lasts until the next row (the last one as long as the one before it).
Lengths missing from a row are `--isl` / `--osl`.

1. One instance shape (TP of each pool, decode batch limit) is fixed: the cheapest disaggregated
   shape for the busiest window, from the capacities of every prefill and decode instance at its
   lengths (plan.py). Changing TP means reloading weights; changing counts does not.
2. For every other distinct (ISL, OSL) of the trace, the capacities of that shape's two instances
   only (colocated instances and other shapes play no part here, so they are not measured).
3. Each window gets ceil(qps / capacity) instances of each pool.
4. Against that, two static clusters sized for the whole trace: rate-matched at the peak, and 1:1
   (as many prefill as decode instances). GPU-hours of all three are reported.
Counts come from the capacities; windows are not simulated whole one by one.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdserve.workload.loadgen import LengthDist
from pdserve.workload.results import write_json
from pdserve.sim.plan import Planner, Traffic


@dataclass(frozen=True, slots=True)
class Window:
    time_s: float
    qps: float
    isl: LengthDist
    osl: LengthDist


def read_trace(path: str, isl: LengthDist, osl: LengthDist) -> list[Window]:
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(io.StringIO(text)))
    windows = []
    for i, row in enumerate(rows):
        try:
            w = Window(float(row["time_s"]), float(row["qps"]),
                       LengthDist.parse(row["isl"]) if row.get("isl") not in (None, "") else isl,
                       LengthDist.parse(row["osl"]) if row.get("osl") not in (None, "") else osl)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {i + 1} needs time_s and qps (and optional isl, osl): {e}") from None
        if w.qps < 0 or (windows and w.time_s <= windows[-1].time_s):
            raise ValueError(f"{path}: row {i + 1}: times must increase and rates be non-negative")
        windows.append(w)
    if not windows:
        raise ValueError(f"{path} holds no windows")
    return windows


def _durations(windows: list[Window]) -> list[float]:
    gaps = [b.time_s - a.time_s for a, b in zip(windows, windows[1:])]
    return gaps + [gaps[-1] if gaps else 3600.0]


def run_trace(args: argparse.Namespace, planner_for: Callable[[Traffic], Planner]) -> int:
    """The P:D plan of each window of `args.trace`; `planner_for(traffic)` is the planner the
    command's flags make for one traffic shape."""
    windows = read_trace(args.trace, LengthDist.parse(args.isl), LengthDist.parse(args.osl))
    planners: dict[tuple, Planner] = {}
    for w in windows:
        key = (w.isl, w.osl)
        if key not in planners:
            peak = max(x.qps for x in windows if (x.isl, x.osl) == key)
            planners[key] = planner_for(Traffic(w.isl, w.osl, max(peak, 1e-3)))
    busiest = max(windows, key=lambda w: w.qps)
    top = planners[(busiest.isl, busiest.osl)]
    print(f"[plan] prefill and decode capacities for ISL {busiest.isl}, OSL {busiest.osl} (the busiest window)",
          file=sys.stderr)
    top.measure(keys=[(kind, tp, b) for kind, batches in (("prefill", [0]), ("decode", top.batches))
                      for tp in top.tps for b in batches])
    shape = min((c for c in top.configs(max(busiest.qps, 1e-3)) if c.mode == "disaggregated"),
                key=lambda c: (c.num_gpus, -c.goodput), default=None)
    if shape is None:
        print("No disaggregated configuration serves the busiest window within the SLA and GPU budget.",
              file=sys.stderr)
        return 1
    for key, planner in planners.items():  # the others: only the two instances of the shape
        if planner is not top:
            print(f"[plan] capacities of the chosen instances for ISL {key[0]}, OSL {key[1]}", file=sys.stderr)
            planner.measure(keys=[("prefill", shape.tp_prefill, 0), ("decode", shape.tp_decode, shape.batch)])
    rows = []
    for w, duration in zip(windows, _durations(windows)):
        caps = planners[(w.isl, w.osl)].rates()
        p_rate, d_rate = caps[("prefill", shape.tp_prefill, 0)], caps[("decode", shape.tp_decode, shape.batch)]
        if not (p_rate and d_rate):
            print(f"No instance meets the SLA at ISL {w.isl}, OSL {w.osl} (window at {w.time_s:g} s).", file=sys.stderr)
            return 1
        p, d = math.ceil(w.qps / p_rate), math.ceil(w.qps / d_rate)
        rows.append({"time_s": w.time_s, "duration_s": duration, "qps": w.qps, "isl": str(w.isl), "osl": str(w.osl),
                     "num_prefill": p, "num_decode": d, "num_gpus": p * shape.tp_prefill + d * shape.tp_decode,
                     "one_to_one": max(p, d)})
    result = {"shape": {"tp_prefill": shape.tp_prefill, "tp_decode": shape.tp_decode, "batch": shape.batch},
              "windows": rows, "gpu_hours": _gpu_hours(rows, shape)}
    _print(rows, result, shape)
    if args.json:
        print(f"wrote {write_json(args.json, result)}", file=sys.stderr)
    if args.plot_dir:
        from pdserve.sim.plan_plots import trace_plot
        print(f"wrote {trace_plot(rows, Path(args.plot_dir))}", file=sys.stderr)
    return 0


def _gpu_hours(rows: list[dict], shape) -> dict:
    hours = sum(r["duration_s"] for r in rows) / 3600
    peak_p, peak_d = max(r["num_prefill"] for r in rows), max(r["num_decode"] for r in rows)
    one = max(r["one_to_one"] for r in rows)
    return {"dynamic": sum(r["num_gpus"] * r["duration_s"] for r in rows) / 3600,
            "static_matched": hours * (peak_p * shape.tp_prefill + peak_d * shape.tp_decode),
            "static_one_to_one": hours * one * (shape.tp_prefill + shape.tp_decode)}


def _print(rows: list[dict], result: dict, shape) -> None:
    print(f"Instance shape: prefill TP{shape.tp_prefill}, decode TP{shape.tp_decode} (batch {shape.batch}).\n")
    print("| time s | req/s | ISL | OSL | prefill | decode | P:D | GPUs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = f"{r['num_prefill'] / r['num_decode']:.2f}" if r["num_decode"] else "-"
        print(f"| {r['time_s']:g} | {r['qps']:g} | {r['isl']} | {r['osl']} | {r['num_prefill']} | {r['num_decode']} | "
              f"{ratio} | {r['num_gpus']} |")
    g = result["gpu_hours"]
    print(f"\nGPU-hours: dynamic {g['dynamic']:.1f}; static, rate-matched at the peak {g['static_matched']:.1f}; "
          f"static 1:1 {g['static_one_to_one']:.1f}.")
