"""`pdserve plan`: the cheapest colocated or disaggregated cluster for a traffic profile and SLA.

    pdserve plan --isl 2048 --osl 256 --qps 10 --ttft-slo 1000 --tpot-slo 50 \\
                 --hardware H100-SXM --model llama-3-70b [--json plan.json] [--plot-dir DIR]

Instances are projected from the catalogue (`--hardware`, `--model`, `--weight-bits`, `--link`)
or measured (`--profile`, a `pdserve profile` JSON: one "GPU" is then one worker as profiled).
It prints every instance's capacity, the plan (simulated whole at the demanded rate), its goodput,
the best of each mode, and the cost/goodput Pareto front. With `--budget G` it adds rate
matching on G GPUs: the best prefill:decode split against a fixed 1:1. With `--trace` it
recommends P:D for every window of a traffic trace (plan_trace.py).

Exit status: 0 with a plan; 1 when no configuration within `--max-gpus` meets the SLA, with the
bound that fails and the best value reachable; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdserve.workload.loadgen import LengthDist
from pdserve.workload.results import write_json
from pdserve.sim.catalog import GPUS, LINKS, MODELS, fits, roofline
from pdserve.sim.plan import Config, InstanceSpec, Planner, Traffic, unreachable, within_budget
from pdserve.sim.verdict import SLA
from pdserve.sim.profile import perf_model
from pdserve.sim.simulate import add_speculation_args


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isl", default="2048", help="input length: N, A-B or M+-S (default 2048)")
    p.add_argument("--osl", default="256", help="output length: N, A-B or M+-S (default 256)")
    p.add_argument("--qps", type=float, default=4.0, help="requests per second to serve (default 4)")
    p.add_argument("--ttft-slo", type=float, default=2000.0, help="TTFT bound, ms (default 2000)")
    p.add_argument("--tpot-slo", type=float, default=50.0, help="TPOT bound, ms (default 50)")
    p.add_argument("--percentile", type=float, default=90.0, help="of requests within each bound (default 90)")
    p.add_argument("--hardware", default="H100-SXM", help=f"GPU: {', '.join(GPUS)}")
    p.add_argument("--model", default="llama-3-8b", help=f"{', '.join(MODELS)}")
    p.add_argument("--weight-bits", type=int, default=16, choices=[4, 8, 16])
    p.add_argument("--fp8-compute", action="store_true",
                   help="matmuls at the GPU's FP8 peak (8- or 4-bit weights; not on A100)")
    p.add_argument("--link", default="IB-NDR", help=f"KV link between instances: {', '.join(LINKS)}")
    p.add_argument("--profile", default=None, help="a `pdserve profile` JSON instead of the catalogue (TP 1 only)")
    p.add_argument("--tp", type=_ints, default=[1, 2, 4, 8], help="tensor-parallel sizes to try (default 1,2,4,8)")
    p.add_argument("--batch", type=_ints, default=[64, 256], help="decode batch limits to try (default 64,256)")
    p.add_argument("--max-gpus", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=2048, help="prefill tokens per step (chunked prefill)")
    add_speculation_args(p)
    p.add_argument("--num-requests", type=int, default=400, help="simulated requests per run, at least")
    p.add_argument("--seed", type=int, default=0)


def instance_factory(args: argparse.Namespace):
    """tp -> InstanceSpec | None, from the profile or the catalogue."""
    speculate = (lambda perf: perf.speculating(args.draft_acceptance, args.num_speculative_tokens)) \
        if args.draft_acceptance else (lambda perf: perf)
    if args.profile:
        profile = json.loads(Path(args.profile).read_text())
        spec = InstanceSpec(speculate(perf_model(profile)), 4096 * 16)
        return lambda tp: spec if tp == 1 else None
    try:
        gpu, model, link = GPUS[args.hardware], MODELS[args.model], LINKS[args.link]
    except KeyError as e:
        raise ValueError(f"unknown {e}; see --help for the catalogue") from None
    roofline(model, gpu, 1, args.weight_bits, link, fp8_compute=args.fp8_compute)  # a bad combination fails here

    def make(tp: int) -> InstanceSpec | None:
        kv = fits(model, gpu, tp, args.weight_bits)
        perf = speculate(roofline(model, gpu, tp, args.weight_bits, link, fp8_compute=args.fp8_compute))
        return InstanceSpec(perf, kv) if kv > 0 else None
    return make


def planner_from_args(args: argparse.Namespace, traffic: Traffic | None = None, tps=None,
                      batches=None) -> Planner:
    sla = SLA(args.ttft_slo / 1e3, args.tpot_slo / 1e3, args.percentile)
    traffic = traffic or Traffic(LengthDist.parse(args.isl), LengthDist.parse(args.osl), args.qps)
    planner = Planner(instance_factory(args), traffic, sla, tps or args.tp, batches or args.batch, args.max_gpus,
                      args.chunk_tokens, args.num_requests, args.seed, progress=_progress())
    if not planner.tps:
        raise ValueError(f"the model fits on none of TP {args.tp} within {args.max_gpus} GPUs")
    return planner


def _progress():
    t0 = time.monotonic()
    return lambda line: print(f"[plan {time.monotonic() - t0:6.1f}s] {line}", file=sys.stderr, flush=True)


def _row(c: Config) -> str:
    return f"| {c.num_gpus} | {c.describe()} | {c.goodput:.3g} | {c.goodput / c.num_gpus:.3g} |"


def report(planner: Planner, budget: int | None) -> tuple[dict, list[str], int]:
    """(the JSON, the printed lines, the exit status)."""
    caps = planner.measure()
    lines = [f"Traffic: ISL {planner.traffic.isl}, OSL {planner.traffic.osl}, {planner.traffic.qps:g} req/s. "
             f"SLA: {planner.sla.describe()}.", "",
             "| instance | TP | batch | req/s within the SLA | alone: TTFT ms | alone: TPOT ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {c.kind} | {c.tp} | {c.batch or '-'} | {c.rate:.3g} | {c.lone.ttft_s * 1e3:.1f} | "
              + (f"{c.lone.tpot_s * 1e3:.1f} |" if c.kind != "prefill" else "- |") for c in caps]
    result: dict = {"traffic": {"isl": str(planner.traffic.isl), "osl": str(planner.traffic.osl),
                                "qps": planner.traffic.qps},
                    "sla": {"ttft_ms": planner.sla.ttft_s * 1e3, "tpot_ms": planner.sla.tpot_s * 1e3,
                            "percentile": planner.sla.percentile},
                    "capacities": [{"kind": c.kind, "tp": c.tp, "batch": c.batch, "rate": c.rate,
                                    "alone_ttft_ms": c.lone.ttft_s * 1e3, "alone_tpot_ms": c.lone.tpot_s * 1e3}
                                   for c in caps]}
    front = planner.pareto()
    result["pareto"] = [c.to_json() for c in front]
    result["fronts"] = {mode: [c.to_json() for c in planner.pareto(mode)] for mode in ("colocated", "disaggregated")}
    per_mode = {mode: planner.best(mode) for mode in ("colocated", "disaggregated")}
    found = [v for v in per_mode.values() if v]
    lines.append("")
    if not found:
        reasons = unreachable(caps, planner.sla)
        if not reasons:
            top = front[-1] if front else None
            reasons = [f"{planner.traffic.qps:g} req/s within the SLA needs more than {planner.max_gpus} GPUs: the "
                       f"most reachable is about {top.goodput:.3g} req/s ({top.describe()})" if top else
                       "no instance meets the SLA at any load"]
        result.update(best=None, unmet=reasons)
        lines += [f"No configuration meets the SLA: {r}." for r in reasons]
        return result, lines, 1
    best, outcome = min(found, key=lambda v: (v[0].num_gpus, -v[0].goodput))
    best_json = best.to_json()
    best_json["goodput"] = planner.goodput(best, best.goodput * 1.5)
    best_json["goodput_per_gpu"] = best_json["goodput"] / best.num_gpus
    best_json["simulated"] = {"ttft_ms": outcome.ttft_s * 1e3, "tpot_ms": outcome.tpot_s * 1e3}
    result["best"] = best_json
    result["by_mode"] = {m: (v[0].to_json() if v else None) for m, v in per_mode.items()}
    p = f"p{planner.sla.percentile:g}"
    lines += [f"Plan: {best.describe()} = {best.num_gpus} GPUs. At {planner.traffic.qps:g} req/s: {p} TTFT "
              f"{outcome.ttft_s * 1e3:.0f} ms, {p} TPOT {outcome.tpot_s * 1e3:.1f} ms. Goodput "
              f"{best_json['goodput']:.3g} req/s, {best_json['goodput_per_gpu']:.3g} per GPU."]
    lines.append(_verdict(per_mode))
    lines += ["", "Pareto front (cost against goodput, from the instances' capacities):", "",
              "| GPUs | configuration | goodput req/s | per GPU |", "| --- | --- | --- | --- |"]
    lines += [_row(c) for c in front]
    if budget:
        result["budget"] = _budget(planner, budget, lines)
    return result, lines, 0


def _verdict(per_mode: dict) -> str:
    col, dis = per_mode["colocated"], per_mode["disaggregated"]
    if not (col and dis):
        only = "colocated" if col else "disaggregated"
        return f"Only {only} serving meets the SLA within the GPU budget."
    c, d = col[0], dis[0]
    if c.num_gpus == d.num_gpus:
        better, other = (("Colocated", c), d) if c.goodput >= d.goodput else (("Disaggregated", d), c)
        return (f"{better[0]} is better here: both need {c.num_gpus} GPUs, and {better[1].describe()} has more "
                f"headroom ({better[1].goodput:.3g} against {other.goodput:.3g} req/s, from the capacities).")
    if c.num_gpus < d.num_gpus:
        return f"Colocated is better here: {c.describe()} needs {c.num_gpus} GPUs, disaggregated {d.num_gpus}."
    return f"Disaggregated is better here: {d.num_gpus} GPUs against {c.num_gpus} for {c.describe()}."


def _budget(planner: Planner, gpus: int, lines: list[str]) -> dict:
    configs = planner.configs()
    best, fixed = within_budget(configs, gpus), within_budget(configs, gpus, one_to_one=True)
    out = {"gpus": gpus, "matched": best.to_json() if best else None, "one_to_one": fixed.to_json() if fixed else None}
    lines.append("")
    if best and fixed:
        out["ratio"] = best.goodput / fixed.goodput
        lines.append(f"Rate matching on {gpus} GPUs: {best.describe()} serves {best.goodput:.3g} req/s; the best 1:1, "
                     f"{fixed.describe()}, {fixed.goodput:.3g} req/s: {out['ratio']:.2f}x.")
    else:
        lines.append(f"Rate matching on {gpus} GPUs: " + ("no 1:1 split fits." if best else "no split fits."))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(p)
    p.add_argument("--budget", type=int, default=None, help="also compare P:D splits on this many GPUs")
    p.add_argument("--trace", default=None, help="a CSV or JSONL traffic trace: recommend P:D per window")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    p.add_argument("--plot-dir", default=None, help="write the Pareto front (and the trace's plan) as PNG here")
    args = p.parse_args(argv)
    try:
        for name in ("qps", "ttft_slo", "tpot_slo", "max_gpus", "num_requests", "chunk_tokens"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not 0 < args.percentile <= 100:
            raise ValueError("--percentile must be in (0, 100]")
        if args.trace:
            from pdserve.sim.plan_trace import run_trace
            return run_trace(args, lambda traffic: planner_from_args(args, traffic))
        planner = planner_from_args(args)
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    result, lines, status = report(planner, args.budget)
    print("\n".join(lines))
    if args.json:
        print(f"wrote {write_json(args.json, result)}", file=sys.stderr)
    if args.plot_dir and result.get("pareto"):
        from pdserve.sim.plan_plots import pareto_plot
        print(f"wrote {pareto_plot(result, Path(args.plot_dir))}", file=sys.stderr)
    return status
