"""`pdserve simulate-trace`: the P:D controller at scale over a traffic trace, simulated.

1. Read the trace, build the step models (the catalogue's roofline, or a `pdserve profile`) and
   the seeded arrivals (trace_sim.py), load-scaled to the cluster and compressed in time.
2. Run, on every core, the controller from the starting split and a grid of static splits; then
   the static splits next to the best so far, until its neighbours are tried.
3. Print one summary line per configuration (controller, best static, 1:1) and a table per trace
   hour; write everything as JSON, and a plot of load, pool sizes and attainment over the trace.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from pdserve.workload.loadgen import LengthDist
from pdserve.workload.results import write_json
from pdserve.sim import trace_sim as ts
from pdserve.sim.catalog import GPUS, LINKS, MODELS, fits, roofline
from pdserve.sim.fork_map import fork_map
from pdserve.sim.plan_trace import read_trace
from pdserve.sim.profile import perf_model


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve simulate-trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="CSV or JSONL: time_s, qps[, isl, osl] per window")
    p.add_argument("--isl", default="2048", help="input length where the trace gives none")
    p.add_argument("--osl", default="256", help="output length where the trace gives none")
    p.add_argument("--workers", type=int, default=16, help="workers in every cluster (default 16)")
    p.add_argument("--start-prefill", type=int, default=None,
                   help="prefill workers the controller starts with (default half: 1:1)")
    p.add_argument("--load-scale", type=float, default=None,
                   help="multiply every window's rate (default: the busiest window needs all the workers, "
                        "by the closed-form capacity estimates)")
    p.add_argument("--time-scale", type=float, default=240.0,
                   help="trace seconds per simulated second (default 240: an hour in 15 s; 1: real time)")
    p.add_argument("--ttft-slo", type=float, default=2000.0, help="TTFT target, ms (default 2000)")
    p.add_argument("--tpot-slo", type=float, default=50.0, help="TPOT target, ms (default 50)")
    p.add_argument("--confirm-s", type=float, default=None,
                   help="the controller's confirmation, simulated s (default the router's 10 s / time scale, "
                        "at least 2)")
    p.add_argument("--dwell-s", type=float, default=None,
                   help="the controller's wait after a move, simulated s (default the router's 60 s / time "
                        "scale, at least 5: a moved worker must drain first)")
    p.add_argument("--hardware", default="H100-SXM", help=f"GPU: {', '.join(GPUS)}")
    p.add_argument("--model", default="llama-3-8b", help=f"{', '.join(MODELS)}")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism of every worker (default 1)")
    p.add_argument("--weight-bits", type=int, default=16, choices=[4, 8, 16])
    p.add_argument("--link", default="IB-NDR", help=f"KV link: {', '.join(LINKS)}")
    p.add_argument("--profile", default=None, help="a `pdserve profile` JSON instead of the catalogue")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="prefill tokens per step (default 2048)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--min-remote-tokens", type=int, default=256, help="the router's disaggregation threshold")
    p.add_argument("--grid", type=int, default=6,
                   help="static splits in the first pass (default 6, with 1:1; all when workers - 1 <= grid)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/simulate_trace.json")
    p.add_argument("--plot-dir", default="results", help="where simulate_trace.png goes ('' for none)")
    return p.parse_args(argv)


def setup_from_args(args: argparse.Namespace) -> ts.Setup:
    if args.profile:
        perf, blocks = perf_model(json.loads(Path(args.profile).read_text())), 4096
    else:
        try:
            model, gpu, link = MODELS[args.model], GPUS[args.hardware], LINKS[args.link]
        except KeyError as e:
            raise ValueError(f"unknown {e}; see --help for the catalogue") from None
        perf, blocks = roofline(model, gpu, args.tp, args.weight_bits, link), fits(model, gpu, args.tp, args.weight_bits) // 16
        if not blocks:
            raise ValueError("the model's weights leave no room for KV: raise --tp or lower --weight-bits")
    return ts.Setup(perf, perf, args.workers, args.ttft_slo / 1e3, args.tpot_slo / 1e3, args.chunk_tokens,
                    args.batch, blocks, args.min_remote_tokens)


def _score(run: dict) -> tuple:
    o = run["overall"]
    return o["sla_attainment_pct"] or 0.0, o["goodput"]


def compare(setup: ts.Setup, arrivals: list[ts.Arrival], bounds: list[tuple[float, float]], start: int,
            policy, most: int) -> dict:
    """The controller's run, every static split tried (prefill count -> run) and the best of them."""
    one = lambda item: ts.simulate(setup, arrivals, bounds, item[1], policy if item[0] else None,  # noqa: E731
                                   "controller" if item[0] else f"static {item[1]}P:{setup.workers - item[1]}D"
                                   ).to_json()
    grid = ts.static_grid(setup.workers, most)
    first = fork_map(one, [(True, start)] + [(False, p) for p in grid])
    controller, static = first[0], dict(zip(grid, first[1:]))
    while todo := ts.refine({p: _score(r) for p, r in static.items()}, setup.workers):
        print(f"[simulate-trace] static splits next to the best: {todo} prefill", file=sys.stderr, flush=True)
        static.update(zip(todo, fork_map(one, [(False, p) for p in todo])))
    best = max(static, key=lambda p: _score(static[p]))
    return {"controller": controller, "static": static, "best": best}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    try:
        windows = read_trace(args.trace, LengthDist.parse(args.isl), LengthDist.parse(args.osl))
        setup = setup_from_args(args)
        scale = args.load_scale if args.load_scale is not None else ts.auto_load_scale(setup, windows)
        start = args.start_prefill if args.start_prefill is not None else setup.workers // 2
        if not 1 <= start < setup.workers:
            raise ValueError(f"--start-prefill must be 1 to {setup.workers - 1}")
        bounds = ts.window_bounds(windows, args.time_scale)
        policy = ts.policy_for(setup, args.time_scale, args.confirm_s, args.dwell_s)
    except (OSError, ValueError) as e:
        print(f"pdserve simulate-trace: error: {e}", file=sys.stderr)
        return 2
    arrivals = ts.arrivals(windows, args.time_scale, scale, args.seed)
    print(f"[simulate-trace] {len(arrivals)} requests over {bounds[-1][1]:.0f} simulated s (load x{scale:.2f}, "
          f"time /{args.time_scale:g}), {setup.workers} workers; controller confirm {policy.confirm_s:g} s, "
          f"dwell {policy.dwell_s:g} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    runs = compare(setup, arrivals, bounds, start, policy, args.grid)
    wall = time.perf_counter() - t0
    hours = math.ceil(bounds[-1][1] * args.time_scale / 3600)
    ctrl = runs["controller"]
    per_hour = ts.moves_per_hour(ctrl["moves"], args.time_scale, hours)
    ctrl["moves_per_hour"] = {"counts": per_hour, "max": max(per_hour), "mean": len(ctrl["moves"]) / max(1, hours),
                              "reversals": ts.reversals(ctrl["moves"])}
    needs = ts.needs(setup, windows, scale)
    result = {
        "settings": {"trace": args.trace, "workers": setup.workers, "start_prefill": start, "load_scale": scale,
                     "time_scale": args.time_scale, "ttft_slo_ms": args.ttft_slo, "tpot_slo_ms": args.tpot_slo,
                     "confirm_s": policy.confirm_s, "dwell_s": policy.dwell_s, "seed": args.seed,
                     "hardware": None if args.profile else args.hardware, "model": None if args.profile else args.model,
                     "profile": args.profile, "tp": args.tp, "chunk_tokens": args.chunk_tokens, "batch": args.batch,
                     "requests": len(arrivals), "wall_s": wall},
        "windows": [{"time_s": w.time_s, "start_s": a, "end_s": b, "qps": w.qps * scale, "isl": str(w.isl), "isl_mean": w.isl.mean,
                     "osl": str(w.osl), "needs_prefill": p, "needs_decode": d}
                    for w, (a, b), (p, d) in zip(windows, bounds, needs)],
        "controller": ctrl,
        "best_static": runs["static"][runs["best"]],
        "one_to_one": runs["static"][setup.workers // 2],
        "static_tried": {p: r["overall"] for p, r in sorted(runs["static"].items())},
    }
    print(markdown(result))
    print(f"[simulate-trace] {wall:.0f} s wall, {len(runs['static']) + 1} runs", file=sys.stderr)
    if args.json:
        print(f"wrote {write_json(args.json, result)}", file=sys.stderr)
    if args.plot_dir:
        from pdserve.sim.trace_sim_plot import trace_sim_plot
        print(f"wrote {trace_sim_plot(result, Path(args.plot_dir))}", file=sys.stderr)
    return 0


CONFIGS = (("controller", "controller"), ("best_static", "best static"), ("one_to_one", "static 1:1"))


def markdown(result: dict) -> str:
    f = lambda v, spec=".0f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["| configuration | split | SLA % | goodput req/s | p90 TTFT ms | p90 TPOT ms | moves |",
             "|" + " --- |" * 7]
    for key, name in CONFIGS:
        run, o = result[key], result[key]["overall"]
        split = run["start"] + (f" -> {run['splits'][-1]['prefill']}P:{run['splits'][-1]['decode']}D"
                                if run["splits"] else "")
        moves = f"{len(run['moves'])} (most {run['moves_per_hour']['max']}/h)" if key == "controller" else "-"
        lines.append(f"| {name} | {split} | {f(o['sla_attainment_pct'], '.1f')} | {f(o['goodput'], '.2f')} "
                     f"| {f(o['ttft_p90_ms'])} | {f(o['tpot_p90_ms'])} | {moves} |")
    lines += ["", "| hour | req/s | ISL | OSL | controller P:D at end | SLA % controller / best / 1:1 "
                  "| p90 TTFT ms controller / best / 1:1 |", "|" + " --- |" * 7]
    splits = result["controller"]["splits"]
    for i, w in enumerate(result["windows"]):
        at_end = [s for s in splits if s["at_s"] <= w["end_s"]]
        pd = f"{at_end[-1]['prefill']}:{at_end[-1]['decode']}" if at_end else "-"
        sla = " / ".join(f(result[k]["windows"][i]["sla_attainment_pct"]) for k, _ in CONFIGS)
        ttft = " / ".join(f(result[k]["windows"][i]["ttft_p90_ms"]) for k, _ in CONFIGS)
        lines.append(f"| {w['time_s'] / 3600:g} | {w['qps']:.1f} | {w['isl']} | {w['osl']} | {pd} | {sla} | {ttft} |")
    return "\n".join(lines)
