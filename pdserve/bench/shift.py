"""`pdserve bench shift`: the P:D controller against static splits, on traffic that turns halfway.

The workload (shift_workload.py), seeded, the same for every configuration: phase 1 sends long
prompts for short answers (prefill-heavy), phase 2 short prompts for long answers (decode-heavy),
each `--phase-s` seconds of Poisson arrivals at its own rate. A rate not given is measured on this
host first (shift_probe.py): between what the two extreme splits can serve of that phase.

1. For each configuration, one after another, start a local cluster (`pdserve serve`, its log kept
   in `--log-dir`) and wait until it is ready:
   - `rebalance`: `--workers` workers starting from the split `--start`, with `--rebalance` and the
     controller's confirm and dwell times and targets (the targets are the benchmark's own);
   - `1P1D`: the static pair, the baseline;
   - every static split of `--workers` (`--splits`, default: each of them, e.g. 2P1D and 1P2D).
2. Send the workload, streaming, recording each chunk's arrival; meanwhile watch the cluster's
   split (its router's /health, every second). Then read its `pdserve_rebalances_total` from
   /metrics and stop it; the controller's moves, with their times and reasons, come from the
   router's log lines, and when the moved worker served in its new role from the worker's.
3. Summarize each configuration per half (the requests sent in it): completed, goodput within the
   targets, p50/p90 TTFT and TPOT, output tokens/s; pick the best static split of each half; and
   put the controller's goodput against static 1P1D and against that best.
4. Write JSON (every setting, every summary, the moves and the split over time), a markdown table
   on stdout, and a plot of output throughput and TTFT over time per configuration with the phase
   change and the moves marked. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.local_cluster import LocalCluster
from pdserve.workload.loadgen import LengthDist
from pdserve.workload.metrics import summarize
from pdserve.workload.results import write_json
from pdserve.bench.serving import run_load, server_info
from pdserve.bench.shift_probe import probe_rates
from pdserve.bench.shift_report import (
    BASELINE, REBALANCE, half_summaries, parse_decisions, parse_moves, ratios, table, timeline_plot,
)
from pdserve.bench.shift_workload import Phase, ShiftWorkload, Split, build_shift_workload, disaggregated_splits


def say(msg: str) -> None:
    print(f"[bench shift] {msg}", file=sys.stderr, flush=True)


class SplitWatcher:
    """The cluster's workers per role (its router's /health), every `every_s` seconds, until stopped."""

    def __init__(self, url: str, t0: float, every_s: float = 1.0) -> None:
        self.url, self.t0, self.every_s = url, t0, every_s
        self.seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                try:
                    roles = http.get(self.url + "/health").json()["roles"]
                except (httpx.HTTPError, ValueError, KeyError):
                    roles = None
                if roles is not None and (not self.seen or self.seen[-1]["roles"] != roles):
                    self.seen.append({"at_s": round(time.perf_counter() - self.t0, 2), "roles": roles})
                self._stop.wait(self.every_s)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def rebalances_total(url: str) -> dict[str, float]:
    """The router's `pdserve_rebalances_total` by direction (empty if it has none)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_rebalances_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


def configurations(args: argparse.Namespace) -> dict[str, tuple[Split, bool]]:
    """name -> (split it starts as, whether the controller runs)."""
    configs = {REBALANCE: (args.start, True), BASELINE: (Split(1, 1), False)}
    for split in args.splits:
        configs.setdefault(str(split), (split, False))
    return configs


def run_config(name: str, split: Split, rebalance: bool, args: argparse.Namespace,
               workload: list[ShiftWorkload]) -> tuple[dict, list, float]:
    """One cluster, the workload against it: (its result, its records, when its load started)."""
    flags = [*split.serve_args, "--slo-ttft-ms", repr(args.ttft_slo), "--slo-tpot-ms", repr(args.tpot_slo)]
    if rebalance:
        flags += ["--rebalance", "--rebalance-confirm-s", repr(args.rebalance_confirm_s),
                  "--rebalance-dwell-s", repr(args.rebalance_dwell_s)]
    log_path = Path(args.log_dir) / f"shift_{name}.log"
    say(f"starting {name} ({split}{', --rebalance' if rebalance else ''}); its log: {log_path}")
    cluster = LocalCluster(args.model, [*flags, *args.serve_args.split()], log_path=log_path,
                           progress=lambda s: say(f"{name}: still starting after {s:.0f}s"))
    try:
        info = server_info(cluster.url)
        if not workload:  # drawn once, with the first cluster's vocabulary: every one gets the same
            workload.append(build_shift_workload(args.phases, args.seed, args.vocab_size or int(info["vocab_size"])))
        w = workload[0]
        t0, wall0 = time.perf_counter(), time.time()
        watcher = SplitWatcher(cluster.url, t0)
        records = asyncio.run(run_load(cluster.url, info["id"], w.requests, 0.0, None, label=f"{name}: ",
                                       offsets=w.offsets))
        timeline = watcher.stop()
        counted = rebalances_total(cluster.url)
    finally:
        cluster.stop()
    halves = half_summaries(records, w.phase_of, len(w.phases), args.ttft_slo / 1e3, args.tpot_slo / 1e3)
    result = {"split": str(split), "rebalance": rebalance, "serve_flags": flags, "halves": halves,
              "whole": summarize(records, args.ttft_slo / 1e3, args.tpot_slo / 1e3), "split_over_time": timeline,
              "processes": cluster.ready["processes"], "log": str(log_path)}
    if rebalance:
        log = log_path.read_text()
        result["moves"], result["decisions"] = parse_moves(log, wall0), parse_decisions(log, wall0)
        result["rebalances_total"] = counted
    for half, s in enumerate(halves):
        say(f"{name}, half {half + 1}: {s['completed']}/{s['num_requests']} done, goodput {s['goodput']:.3f} req/s, "
            f"{s['output_throughput']:.1f} output tok/s")
    return result, records, t0


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _split(text: str) -> Split:
    try:
        return Split.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _splits(text: str) -> list[Split]:
    return [_split(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench shift", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model for every cluster (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workers", type=_positive(int), default=3,
                   help="workers of the controller's cluster and of each static split (1P1D aside)")
    p.add_argument("--start", type=_split, default=None,
                   help="the split the controller starts from (default: 1P and the rest decode, wrong for phase 1)")
    p.add_argument("--splits", type=_splits, default=None,
                   help="static splits to measure, comma-separated, e.g. 2P1D,1P2D,3C (default: every NPMD of "
                        "--workers)")
    p.add_argument("--serve-args", default="", help="more flags for every `pdserve serve`, e.g. '--dtype float32'")
    g = p.add_argument_group("workload")
    g.add_argument("--phase-s", type=_positive(float), default=60.0, help="seconds of each phase")
    g.add_argument("--phase1-rate", type=_positive(float), default=None,
                   help="requests/s in phase 1 (Poisson; default: measured on this host)")
    g.add_argument("--phase1-input-len", type=_length, default=LengthDist.parse("1024+-128"),
                   help="phase 1 prompt tokens: N, A-B or M+-S (long prompts)")
    g.add_argument("--phase1-output-len", type=_length, default=LengthDist.parse("16"),
                   help="phase 1 output tokens (short answers; EOS ignored)")
    g.add_argument("--phase2-rate", type=_positive(float), default=None,
                   help="requests/s in phase 2 (Poisson; default: measured on this host)")
    g.add_argument("--phase2-input-len", type=_length, default=LengthDist.parse("64"),
                   help="phase 2 prompt tokens (short prompts)")
    g.add_argument("--phase2-output-len", type=_length, default=LengthDist.parse("128"),
                   help="phase 2 output tokens (long answers; EOS ignored)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab-size", type=_positive(int), default=None,
                   help="token ids are drawn below this (default: the server's)")
    g = p.add_argument_group("targets and the controller")
    g.add_argument("--ttft-slo", type=_positive(float), default=6000.0,
                   help="TTFT target in ms: goodput, and the controller's prefill pressure")
    g.add_argument("--tpot-slo", type=_positive(float), default=300.0,
                   help="TPOT target in ms: goodput, and the controller's decode pressure")
    g.add_argument("--rebalance-confirm-s", type=_positive(float), default=5.0,
                   help="seconds a need must hold before the controller moves a worker")
    g.add_argument("--rebalance-dwell-s", type=_positive(float), default=20.0,
                   help="seconds after a move before the controller considers another")
    p.add_argument("--result-json", default="results/bench_shift.json")
    p.add_argument("--plot-dir", default="results/plots")
    p.add_argument("--log-dir", default="results/shift_logs", help="each cluster's log")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.workers < 3:
        p.error("--workers must be at least 3: the controller never takes a pool below one worker, so with "
                "two it can move nothing")
    args.start = args.start or Split(1, args.workers - 1)
    args.splits = disaggregated_splits(args.workers) if args.splits is None else args.splits
    if args.start.colocated or args.start.workers != args.workers:
        p.error(f"--start must split --workers ({args.workers}) into prefill and decode, e.g. 1P{args.workers - 1}D")
    kinds = [("long prompts, short answers", args.phase1_rate, args.phase1_input_len, args.phase1_output_len),
             ("short prompts, long answers", args.phase2_rate, args.phase2_input_len, args.phase2_output_len)]
    probe = None
    if args.phase1_rate is None or args.phase2_rate is None:
        unsized = [Phase(name, args.phase_s, 1.0, inputs, outputs) for name, _, inputs, outputs in kinds]
        measured, probe = probe_rates(args.model, args.workers, unsized, args.serve_args.split(), args.seed,
                                      args.vocab_size, Path(args.log_dir), say)
        kinds = [(name, rate or measured[i], inputs, outputs) for i, (name, rate, inputs, outputs) in enumerate(kinds)]
    args.phases = [Phase(name, args.phase_s, rate, inputs, outputs) for name, rate, inputs, outputs in kinds]
    configs = configurations(args)
    results, runs, workload = {}, {}, []
    for name, (split, rebalance) in configs.items():
        results[name], records, t0 = run_config(name, split, rebalance, args, workload)
        runs[name] = (records, t0)
    w = workload[0]
    settings = {"model": args.model, "workers": args.workers, "start": str(args.start), "seed": args.seed,
                "phases": [ph.describe() for ph in w.phases], "slo_ms": {"ttft": args.ttft_slo, "tpot": args.tpot_slo},
                "rebalance_confirm_s": args.rebalance_confirm_s, "rebalance_dwell_s": args.rebalance_dwell_s,
                "serve_args": args.serve_args, "cores": len(os.sched_getaffinity(0)), "probe": probe,
                "when": time.strftime("%Y-%m-%d %H:%M")}
    summary = ratios(results, len(w.phases))
    out = write_json(args.result_json, {"settings": settings, "results": results, "per_half": summary})
    plot = timeline_plot(runs, results[REBALANCE]["moves"], w.boundaries, args.ttft_slo / 1e3,
                         Path(args.plot_dir) / "shift_timeline.png",
                         f"{args.model}: traffic turns at {args.phase_s:g}s; {args.workers} workers")
    print(table(results, len(w.phases)))
    for row in summary:
        vs = lambda k: "-" if row.get(k) is None else f"{row[k]:.2f}x"  # noqa: E731
        print(f"half {row['half'] + 1}: best static {row['best_static']}; {REBALANCE} {vs('vs_1p1d')} of 1P1D, "
              f"{vs('vs_best_static')} of the best static")
    say(f"wrote {out} and {plot}")
    return 0
