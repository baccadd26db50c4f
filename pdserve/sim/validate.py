"""The simulator against measurements: `pdserve bench compare` results, simulated again.

    python -m pdserve.sim.validate --measured results/bench_compare.json [more runs ...] \\
        --profile colocated=P.json --profile disaggregated=PREFILL.json,DECODE.json --profile replicas=P.json

For every configuration and load point of the measured runs, the same workload (lengths, seeds,
arrival times: `--vocab-size` must be the served model's, as the draws share one random stream)
runs through the simulated cluster of the same layout, with the given step models. The table puts
mean TTFT, mean TPOT and goodput side by side with the mean of the measured runs, and the error.
A measured run during which other processes took CPU (`host_cpu` in `bench compare`'s JSON)
counts only when no quiet run of that point exists, and is marked (noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.workload.host_cpu import noisy
from pdserve.workload.loadgen import LengthDist, WorkloadSpec
from pdserve.workload.results import write_json
from pdserve.router.policy import DisaggregationPolicy
from pdserve.sim.cluster import SimCluster
from pdserve.sim.profile import perf_model
from pdserve.sim.simulate import simulate_sweep

METRICS = (("TTFT mean ms", lambda r: r["ttft"]["mean"]), ("TPOT mean ms", lambda r: r["tpot"]["mean"]),
           ("goodput req/s", lambda r: r["goodput"]))


def layout(argv: list[str]) -> dict[str, int]:
    """--prefill/--decode/--colocated counts from a configuration's `pdserve serve` flags, read
    by `pdserve serve`'s own argument definitions."""
    from pdserve.launcher import add_serve_args

    parser = argparse.ArgumentParser(add_help=False)
    add_serve_args(parser)
    args, _ = parser.parse_known_args(argv)
    from pdserve.launcher import serve_layout

    chosen = serve_layout(args)  # no layout flag: the layout `pdserve serve` chose on this host
    return {"prefill": chosen.prefill, "decode": chosen.decode, "colocated": chosen.colocated}


def simulate_config(measured: dict, name: str, models: list[str], backend: str | None, vocab_size: int) -> list[dict]:
    settings, result = measured["settings"], measured["results"][name]
    w = result["workload"]
    spec = WorkloadSpec(w["num_requests"], LengthDist.parse(w["input_len"]), LengthDist.parse(w["output_len"]),
                        w["seed"], vocab_size, w["shared_prefix_len"], w["num_prefixes"], w["turns"], w["dataset"],
                        w.get("think_time", 0.0))
    profiles = [perf_model(json.loads(Path(m).read_text()), backend) for m in models]
    prefill, decode = profiles[0], profiles[-1]
    n = layout(settings["configs"][name])
    points = [{"request_rate": r["load"]["request_rate"] or float("inf"), "concurrency": r["load"]["concurrency"]}
              for r in result["runs"]]

    def make() -> SimCluster:
        return SimCluster(prefill, decode, n["prefill"], n["decode"], n["colocated"], policy=DisaggregationPolicy(),
                          transfer=prefill)

    slo = settings["slo_ms"]
    return simulate_sweep(make, spec, points, settings.get("burstiness", 1.0), slo["ttft"] / 1e3, slo["tpot"] / 1e3)


def compare(measured_runs: list[dict], simulated: dict[str, list[dict]]) -> tuple[list[str], list[dict]]:
    lines = ["| config | req/s | " + " | ".join(f"{m}: measured | simulated | error" for m, _ in METRICS) + " |",
             "| --- | --- | " + " | ".join("--- | --- | ---" for _ in METRICS) + " |"]
    rows = []
    for name, sim_runs in simulated.items():
        for i, sim in enumerate(sim_runs):
            real = [m["results"][name]["runs"][i] for m in measured_runs]
            quiet = [r for r in real if not noisy(r.get("host_cpu"))]
            row = {"config": name, "load": sim["load"], "runs": len(real), "noisy_runs": len(real) - len(quiet)}
            cells = []
            for metric, get in METRICS:
                values = [get(r) for r in (quiet or real) if get(r) is not None]
                mean = sum(values) / len(values) if values else None
                s = get(sim)
                error = (s - mean) / mean if mean and s is not None else None
                row[metric] = {"measured": values, "measured_mean": mean, "simulated": s, "error": error}
                shown = " / ".join(f"{v:.3g}" for v in values) + ("" if quiet else " (noisy)")
                cells.append(f"{shown} | {s:.3g} | {error * 100:+.0f}%" if error is not None else f"{shown} | - | -")
            rate = sim["load"]["request_rate"]
            lines.append(f"| {name} | {rate if rate is not None else 'inf'} | " + " | ".join(cells) + " |")
            rows.append(row)
    return lines, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", nargs="+", required=True, help="`pdserve bench compare` JSONs of one workload")
    p.add_argument("--profile", action="append", required=True, metavar="CONFIG=P[,DECODE_P]",
                   help="step models per configuration: one profile, or prefill and decode profiles")
    p.add_argument("--backend", default="shm")
    p.add_argument("--vocab-size", type=int, default=49152, help="the served model's (default: SmolLM2's)")
    p.add_argument("--out", default="results/validation.json")
    args = p.parse_args(argv)
    try:
        measured = [json.loads(Path(m).read_text()) for m in args.measured]
        profiles = {k: v.split(",") for k, v in (item.split("=", 1) for item in args.profile)}
        unknown = set(profiles) - set(measured[0]["results"])
        if unknown:
            raise ValueError(f"no measured results for {', '.join(sorted(unknown))}")
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    simulated = {name: simulate_config(measured[0], name, models, args.backend, args.vocab_size)
                 for name, models in profiles.items()}
    lines, rows = compare(measured, simulated)
    print("\n".join(lines))
    out = write_json(args.out, {"measured": args.measured, "profiles": profiles, "rows": rows})
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
