"""`pdserve bench chaos`: a seeded load against a local cluster while faults are injected at seeded
times, against the same run without faults.

1. Baseline: start `pdserve serve` (cluster.py), warm it up, run the seeded closed-loop load
   (load.py) for `--duration` seconds (or `--num-requests`), with the watcher sampling the cluster
   (watch.py); wait for it to go idle; stop it.
2. Faults: a fresh cluster, the same load, and the fault plan (plan.py: `--faults` at seeded times
   and targets, or `--rolling-restart`: every worker drained in turn) done by faults.py, each
   fault once the cluster recovered from the one before. The load goes on until the last fault
   recovered (and a few seconds more), if that is past the duration.
3. Audit each run: every request accounted for and judged ok / error / lost; no KV block in use
   after a grace period (the router's /metrics, as the soak's audit reads them); no process exited
   that no fault hit; every fault recovered. The run passes with zero lost (and, for a rolling
   restart, zero errors too).
4. Report (report.py, recovery.py): JSON with everything, a markdown table of the runs and one of
   the faults with where each recovery's time went, a plot of throughput over time with the
   faults marked; progress on stderr. Exit 0 only if the audit passed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

from pdserve.bench.chaos.causes import errors_by_cause
from pdserve.bench.chaos.cluster import ChaosCluster
from pdserve.bench.chaos.faults import FaultRunner
from pdserve.bench.chaos.load import ClosedLoopLoad
from pdserve.bench.chaos.plan import (
    DEFAULT_FAULTS, FAULT_KINDS, PlannedFault, parse_faults, plan_faults, rolling_restart_plan, router_names,
    worker_names,
)
from pdserve.bench.chaos.recovery import breakdown, unexpected_exits
from pdserve.bench.chaos.report import (
    details, goodput, latency, markdown, outcome_counts, plot, summary_line, throughput_series,
)
from pdserve.bench.chaos.watch import Watcher
from pdserve.workload.loadgen import LengthDist, WorkloadSpec, build_requests
from pdserve.workload.results import write_json
from pdserve.bench.soak.audit import wait_idle

say = lambda msg: print(f"[bench chaos] {msg}", file=sys.stderr, flush=True)  # noqa: E731

TAIL_S = 5.0  # load kept on after the last fault recovered, so the plot shows the cluster healed
WORKLOAD_POOL = 512  # distinct seeded requests a run of a given duration cycles through


def start_cluster(args: argparse.Namespace, label: str) -> ChaosCluster:
    log = Path(args.server_log_dir) / f"bench_chaos_{label.replace(' ', '_')}_server.log"
    say(f"{label}: starting the cluster ({args.model}, {args.prefill}P{args.decode}D); its log: {log}")
    serve = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--routers", str(args.routers),
             *args.serve_args.split()]
    return ChaosCluster(args.model, serve, log, args.max_restart_backoff)


def served_model(cluster: ChaosCluster) -> dict:
    r = httpx.get(cluster.url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def warm_up(cluster: ChaosCluster, model: str, args: argparse.Namespace) -> None:
    """A request per client, counted nowhere: code paths loaded, KV links opened."""
    spec = WorkloadSpec(args.concurrency, args.input_len, args.output_len, seed=-1 - args.seed,
                        vocab_size=args.vocab_size)
    warm = ClosedLoopLoad(cluster.url, model, build_requests(spec), args.concurrency, args.request_timeout,
                          budget=args.concurrency)
    warm.run()
    if warm.counts()["ok"] < args.concurrency:
        say(f"warm-up: {warm.counts()} ({[r.detail for r in warm.results if r.outcome != 'ok'][:2]})")


class SeededWorkload:
    """The run's requests, drawn once from the seed below the vocabulary size the first cluster
    reports (or `--vocab-size`): every run gets the same ones."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.requests: list | None = None

    def for_model(self, info: dict) -> list:
        if self.requests is None:
            a = self.args
            vocab = a.vocab_size or int(info.get("vocab_size") or 256)
            a.vocab_size = vocab
            self.requests = build_requests(WorkloadSpec(a.num_requests or WORKLOAD_POOL, a.input_len, a.output_len,
                                                        a.seed, vocab))
        return self.requests


def run_once(label: str, args: argparse.Namespace, workload: SeededWorkload,
             plan_for: Callable[[float], list[PlannedFault]]) -> dict:
    """One run on a fresh cluster; `plan_for(duration_s)` gives its faults."""
    cluster = start_cluster(args, label)
    try:
        info = served_model(cluster)
        model, requests = info["id"], workload.for_model(info)
        warm_up(cluster, model, args)
        duration = args.duration if args.num_requests is None else args.planned_duration
        plan: list[PlannedFault] = plan_for(duration)
        for f in plan:
            say(f"{label}: planned {f.describe()}")
        load = ClosedLoopLoad(cluster.url, model, requests, args.concurrency, args.request_timeout,
                              budget=args.num_requests)
        t0 = time.monotonic()
        events_from = len(cluster.events)
        watcher = Watcher(cluster, lambda: f"{label}: {time.monotonic() - t0:.0f}s, {load.counts()}, "
                                           f"{load.in_flight} in flight").start()
        faults = FaultRunner(cluster, plan, t0, args.recovery_timeout).start()
        load_thread = threading.Thread(target=load.run, daemon=True, name="chaos-load")
        load_thread.start()
        if args.num_requests is None:
            time.sleep(max(0.0, t0 + duration - time.monotonic()))
            while plan and not faults.finished.wait(0.5):
                pass
            if plan:
                time.sleep(max(0.0, TAIL_S - (time.monotonic() - max(
                    [i.recovered_at or i.at for i in faults.injections], default=t0))))
            load.stop.set()
        load_thread.join(args.request_timeout + 30)
        faults.stop.set()
        faults.join(args.recovery_timeout + 60)
        elapsed = time.monotonic() - t0
        say(f"{label}: load over after {elapsed:.0f}s: {load.counts()}; waiting up to {args.grace:g}s for idle")
        idle = idle_state(cluster, args.grace)
        watcher.stop()
        cluster.refresh()
        events = cluster.events[events_from:]
    finally:
        cluster.stop()
    results = sorted(load.results, key=lambda r: r.start)
    workers = len(cluster.worker_names)
    fault_rows = [{**inj.as_dict(t0), "recovery": breakdown(inj, events, watcher.samples, results, workers)}
                  for inj in faults.injections]
    return {
        "label": label, "model": model, "elapsed_s": round(elapsed, 1), "outcomes": outcome_counts(results),
        "unaccounted": load.in_flight + (1 if load_thread.is_alive() else 0),
        "goodput": goodput(results, t0), "latency": latency(results), "errors": details(results, "error"),
        "errors_by_cause": errors_by_cause(results, faults.injections), "lost": details(results, "lost"),
        **idle, "unexpected_exits": unexpected_exits(events, faults.injections, t0),
        "faults": fault_rows, "skipped_faults": [f.as_dict() for f in faults.skipped],
        "events": [{**e, "at": round(e["at"] - t0, 3)} for e in events],
        "throughput": throughput_series(results, t0), "requests": [r.as_dict(t0) for r in results],
    }


def idle_state(cluster: ChaosCluster, grace_s: float) -> dict:
    """KV blocks and requests still held on the workers after the grace period, from the router."""
    try:
        metrics, waited, trace = wait_idle(cluster.url, grace_s)
    except httpx.HTTPError as e:
        return {"kv_blocks_in_use_at_end": None, "busy_at_end": {"router": f"unreachable: {type(e).__name__}"},
                "workers_at_end": {}, "idle_after_s": None}
    return {"kv_blocks_in_use_at_end": metrics.value("pdserve_worker_kv_blocks_used"), "busy_at_end": metrics.busy(),
            "workers_at_end": metrics.workers(), "idle_after_s": round(waited, 1), "idle_trace": trace}


def audit(run: dict, workers: int, rolling: bool) -> list[str]:
    """What failed in one run (empty: it passed)."""
    c = run["outcomes"]
    problems = []
    if c["lost"]:
        problems.append(f"{c['lost']} requests lost: {run['lost']}")
    if rolling and c["error"]:
        problems.append(f"{c['error']} requests failed during a rolling restart: {run['errors']}")
    if run["unaccounted"]:
        problems.append(f"{run['unaccounted']} requests unaccounted for")
    if run["kv_blocks_in_use_at_end"] != 0 or run["busy_at_end"]:
        problems.append(f"not idle after the grace period: {run['busy_at_end']}")
    if sum(run["workers_at_end"].values()) != workers:
        problems.append(f"workers registered at the end: {run['workers_at_end']} (of {workers})")
    if run["unexpected_exits"]:
        problems.append(f"processes exited that no fault hit: {run['unexpected_exits']}")
    if unrecovered := [f"{f['kind']} {f['target']}" for f in run["faults"] if not f["recovery"]["recovered"]]:
        problems.append(f"not recovered: {unrecovered}")
    if run["skipped_faults"]:
        problems.append(f"faults not injected (the load ended first): {len(run['skipped_faults'])}")
    return problems


def chaos(args: argparse.Namespace) -> int:
    specs = parse_faults(args.faults)
    names = worker_names(args.prefill, args.decode)

    def no_faults(duration: float) -> list[PlannedFault]:
        return []

    def with_faults(duration: float) -> list[PlannedFault]:
        if args.rolling_restart:
            return rolling_restart_plan(names, duration)
        return plan_faults(specs, duration, names, args.seed, routers=router_names(args.routers))

    workload = SeededWorkload(args)
    runs = {"baseline": run_once("baseline", args, workload, no_faults)}
    if args.num_requests is not None:  # the faults spread over as long as the baseline took
        args.planned_duration = runs["baseline"]["goodput"]["seconds"]
    label = "rolling restart" if args.rolling_restart else "faults"
    runs[label] = run_once(label, args, workload, with_faults)
    problems = {label: audit(run, len(names), args.rolling_restart and label != "baseline")
                for label, run in runs.items()}
    settings = {k: str(v) if isinstance(v, LengthDist) else v for k, v in vars(args).items()}
    result = {"settings": {**settings, "workers": names, "when": time.strftime("%Y-%m-%d %H:%M")},
              "passed": not any(problems.values()), "problems": problems, "runs": runs}
    out = write_json(args.result_json, result)
    written = plot(result, Path(args.plot_dir) / "chaos_throughput.png")
    print(summary_line(result))
    print(markdown(result))
    say(f"wrote {out} and {written}")
    for label, found in problems.items():
        for problem in found:
            say(f"{label}: {problem}")
    return 0 if result["passed"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command's settings; a bad one is an argparse error (exit 2)."""
    p = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="the cluster's model (default: as `pdserve serve`)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--routers", type=int, default=1, help="routers on the cluster's address (router replicas)")
    p.add_argument("--serve-args", default="", help="more flags for `pdserve serve`, e.g. '--dtype float32'")
    p.add_argument("--seed", type=int, default=0, help="the workload's and the fault plan's")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per run (or --num-requests)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per run, instead of a duration")
    p.add_argument("--concurrency", type=int, default=4, help="clients, each with one request at a time")
    p.add_argument("--input-len", default="320",
                   help="prompt tokens: N, A-B (uniform) or M+-S (normal); the router sends prompts of 256 "
                        "uncached tokens or more through a prefill worker, so the default ones cross a KV link")
    p.add_argument("--output-len", default="32", help="output tokens (max_tokens, EOS ignored), same forms")
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids below this (default: asked)")
    p.add_argument("--faults", default=DEFAULT_FAULTS,
                   help="comma list of " + "; ".join(f"{k}: {v}" for k, v in FAULT_KINDS.items()))
    p.add_argument("--rolling-restart", action="store_true",
                   help="instead of --faults: SIGTERM to every worker in turn, each back before the next; "
                        "no request may fail")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds after which a request with no end counts as lost (hung)")
    p.add_argument("--recovery-timeout", type=float, default=120.0,
                   help="seconds the cluster gets to recover from a fault before the next one goes in")
    p.add_argument("--grace", type=float, default=30.0, help="seconds the cluster gets to go idle after the load")
    p.add_argument("--max-restart-backoff", type=float, default=30.0,
                   help="the cluster's `pdserve serve --max-restart-backoff`")
    p.add_argument("--result-json", default="results/bench_chaos.json")
    p.add_argument("--plot-dir", default="results/plots")
    p.add_argument("--server-log-dir", default="results", help="each cluster's stderr goes to a log file here")
    args = p.parse_args(argv)
    try:
        parse_faults(args.faults)
        args.input_len, args.output_len = LengthDist.parse(args.input_len), LengthDist.parse(args.output_len)
    except ValueError as e:
        p.error(str(e))
    if not 1 <= args.routers <= 16:
        p.error("--routers takes 1 to 16")
    if args.prefill < 0 or args.decode < 0 or args.prefill + args.decode < 1:
        p.error("--prefill and --decode must be >= 0, with at least one worker")
    if args.concurrency < 1 or (args.num_requests is not None and args.num_requests < 1):
        p.error("--concurrency and --num-requests must be >= 1")
    if min(args.duration, args.request_timeout, args.recovery_timeout, args.grace, args.max_restart_backoff) <= 0:
        p.error("--duration, --request-timeout, --recovery-timeout, --grace and --max-restart-backoff must be > 0")
    if args.vocab_size is not None and args.vocab_size < 2:
        p.error("--vocab-size must be >= 2")
    args.planned_duration = args.duration
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return chaos(args)
    except (RuntimeError, httpx.HTTPError) as e:
        say(f"{type(e).__name__}: {e}")
        return 1
