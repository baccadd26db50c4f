"""`pdserve bench soak`: valid, malformed and abusive traffic mixed against a local cluster for a
bounded time, then an audit of what it left behind.

1. Start `pdserve serve` (a random API key given through the environment, its stderr kept in a log
   file), wait until it is ready, send each reference request alone (greedy answers later requests
   must match), warm up, and take the memory baseline.
2. For `--duration` seconds keep `--concurrency` clients busy, each running the next action of the
   seeded mix (actions.py: valid, malformed, abusive); a progress line on stderr. Each
   request's outcome is judged against what its action accepts (outcomes.py).
3. Wait for the clients' last actions, then audit (audit.py): every request accounted for,
   none failed, the cluster idle after a grace period, no worker dropped, memory growth within the
   bound, every process alive. Stop the cluster.
4. Print one summary line and the action x outcome table; write JSON (every setting, counts,
   failure samples, memory over time, the server log's errors) and plots. Exit 0 only if the audit
   passed.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import httpx

from pdserve.workload.results import write_json
from pdserve.bench.soak.actions import ACTIONS, CATEGORY, draw, first_round, is_burst
from pdserve.bench.soak.audit import as_dicts, audit, scrape, wait_idle
from pdserve.bench.soak.cluster import Monitor, SoakCluster
from pdserve.bench.soak.outcomes import Ledger
from pdserve.bench.soak.report import details, outcomes_over_time, plots, summary_line, table
from pdserve.bench.soak.target import SoakClient, Target, build_references
from pdserve.credentials import API_KEY_ENV

say = lambda msg: print(f"[bench soak] {msg}", file=sys.stderr, flush=True)  # noqa: E731


def run_client(i: int, client: SoakClient, clients: int, stop_at: float) -> None:
    """Client i: its share of one pass over every kind, then seeded draws until `stop_at`."""
    queue = first_round(i, clients)
    try:
        while queue or time.monotonic() < stop_at:
            early = queue and is_burst(queue[0]) and time.monotonic() < client.target.first_burst_at
            action = queue.pop(0) if queue and not early else draw(client.rng, client)
            try:
                action.run(client)
            except Exception as e:  # noqa: BLE001 - a flaw of the soak itself: counted, and the client goes on
                client.ledger.crash(action.name, e, traceback.format_exc())
    finally:
        client.close()


def warm_up(target: Target) -> None:
    """Each valid kind a couple of times, counted nowhere: code paths loaded, pools touched."""
    ledger = Ledger(target.timeout_s)
    client = SoakClient(target, ledger, random.Random(-1))
    try:
        for action in [a for a in ACTIONS if CATEGORY[a.name] == "valid"] * 2:
            action.run(client)
    finally:
        client.close()
    if ledger.totals()[2]:
        say(f"warm-up: {ledger.totals()[2]} requests failed: {ledger.samples[:2]}")


def memory_baseline(cluster: SoakCluster, count: int = 5, every_s: float = 0.5) -> dict:
    """The median of a few samples of each measure, after the warm-up."""
    samples = []
    for _ in range(count):
        time.sleep(every_s)
        samples.append(cluster.memory())
    return {key: statistics.median(s[key] for s in samples) for key in ("total_mib", "shmem_mib", "rest_mib")}


def server_log(path: Path, keep: int = 40) -> dict:
    """The server log's warnings and errors: counts and the first lines of each."""
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = text.splitlines()
    errors = [ln for ln in lines if any(k in ln for k in ("ERROR", "Traceback", "Exception", "CRITICAL"))]
    warnings = [ln for ln in lines if "WARNING" in ln or "warning" in ln]
    return {"path": str(path), "lines": len(lines), "errors": len(errors), "warnings": len(warnings),
            "error_lines": errors[:keep], "warning_lines": warnings[:keep]}


def serve_args(args: argparse.Namespace) -> list[str]:
    """`--serve-args`, with float32 unless they name a dtype and unquantized unless they name a
    quantization (greedy answers are compared exactly, and neither bfloat16 CPU kernels nor
    quantized weights, which hand products of many rows to a dense GEMM, are batch-invariant: three
    greedy sequences batched together give another text than one alone, so a right answer under
    load can differ), and the router's queue limit `--router-queue`."""
    extra = args.serve_args.split()
    if "--dtype" not in extra:
        extra = ["--dtype", "float32", *extra]
    if "--quantization" not in extra:
        extra = ["--quantization", "none", *extra]
    return [*extra, "--max-queued-requests", str(args.router_queue)]


def run_traffic(target: Target, ledger: Ledger, args: argparse.Namespace) -> list[str]:
    """`--concurrency` clients until `--duration` has passed and their last actions end; the names
    of clients still busy past every deadline (their requests stay unaccounted)."""
    stop_at = ledger.t0 + args.duration
    threads = [threading.Thread(target=run_client, daemon=True, name=f"soak-client-{i}",
                                args=(i, SoakClient(target, ledger, random.Random(args.seed * 1_000_003 + i)),
                                      args.concurrency, stop_at))
               for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:  # a client's last action may run past the end, up to its own timeouts
        t.join(max(0.0, stop_at + 2 * args.action_timeout + 30 - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def soak(args: argparse.Namespace) -> int:
    api_key = secrets.token_urlsafe(24)
    say(f"starting the cluster ({args.model}, {' '.join(serve_args(args))}); its log: {args.server_log}")
    cluster = SoakCluster(args.model, serve_args(args), api_key, Path(args.server_log))
    monitor = None
    try:
        info = httpx.get(cluster.url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"},
                         timeout=30).json()["data"][0]
        target = Target(cluster.url, info["id"], api_key, max_model_len=int(info["max_model_len"]),
                        vocab_size=int(info["vocab_size"]), timeout_s=args.action_timeout, stall_hold_s=args.stall_hold,
                        burst_size=args.burst_size, burst_max_tokens=args.burst_max_tokens, burst_gap_s=args.burst_gap)
        target.references = build_references(target)
        say(f"ready at {cluster.url}; {len(target.references)} reference answers; warming up")
        warm_up(target)
        baseline = memory_baseline(cluster)
        start_metrics = scrape(cluster.url)
        say(f"memory baseline {baseline['rest_mib']:.0f} MiB (+ {baseline['shmem_mib']:.0f} MiB shared); workers "
            f"{start_metrics.workers()}; {args.concurrency} clients for {args.duration:g} s")
        ledger = Ledger(args.action_timeout)
        target.first_burst_at = ledger.t0 + args.duration / 4
        monitor = Monitor(cluster, ledger, args.duration, baseline)
        monitor.start()
        stuck = run_traffic(target, ledger, args)
        soak_seconds = time.monotonic() - ledger.t0
        say(f"traffic stopped after {soak_seconds:.0f} s" + (f"; clients still busy: {stuck}" if stuck else "")
            + f"; waiting up to {args.grace:g} s for the cluster to go idle")
        end_metrics, waited, grace_trace = wait_idle(cluster.url, args.grace)
        monitor.stop()
        rows = ledger.table()
        memory = {"measure": "proportional set size of the launcher, router and workers, without shared memory "
                             "(the KV pools in /dev/shm, which fill to their fixed size as blocks are first used)",
                  "baseline_mib": baseline["rest_mib"], "peak_mib": monitor.peak("rest_mib"),
                  "bound_mib": args.max_memory_growth_mib, "total_pss_baseline_mib": baseline["total_mib"],
                  "total_pss_peak_mib": monitor.peak("total_mib"), "shmem_peak_mib": monitor.peak("shmem_mib"),
                  "samples": monitor.samples}
        checks = audit(rows, ledger.totals()[2], start_metrics, end_metrics, waited, args.grace, memory, cluster.pids)
    finally:
        if monitor is not None:
            monitor.stop()
        cluster.stop()
    settings = {**vars(args), "serve_args": " ".join(serve_args(args)), "served_model": target.model,
                "max_model_len": target.max_model_len, "api_key": f"random, given through {API_KEY_ENV}",
                "processes": cluster.ready["processes"], "when": time.strftime("%Y-%m-%d %H:%M")}
    result = {"settings": settings, "soak_seconds": round(soak_seconds, 1), "clients_stuck": stuck,
              "audit": {"passed": all(c.passed for c in checks), "checks": as_dicts(checks)},
              "actions": {a: {"category": CATEGORY.get(a, "?"), **row} for a, row in rows.items()},
              "kinds_run": sorted(rows), "failures": ledger.samples, "bursts": ledger.notes.get("burst", []),
              "memory": memory, "outcomes_over_time": outcomes_over_time(ledger.events),
              "metrics": {"start": start_metrics.summary(), "end": end_metrics.summary(), "grace_trace": grace_trace},
              "references": [{"chat": r.chat, "prompt": r.prompt, "text": r.text} for r in target.references],
              "server_log": server_log(Path(args.server_log))}
    out = write_json(args.result_json, result)
    written = plots(result, Path(args.plot_dir))
    print(summary_line(result))
    print(table(rows))
    print(details(result))
    say(f"wrote {out} and {', '.join(str(w) for w in written)}")
    if not result["audit"]["passed"]:
        say("audit failed: " + "; ".join(f"{c.name}: {c.detail}" for c in checks if not c.passed))
    return 0 if result["audit"]["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="the cluster's model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--serve-args", default="",
                   help="more flags for `pdserve serve`, e.g. '--kv-cache-memory 512MiB' (--dtype float32 unless "
                        "given)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=12, help="clients, each running one action at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-memory-growth-mib", type=float, default=512.0,
                   help="the bound on the cluster's peak memory above its baseline after warm-up (proportional set "
                        "size without the shared-memory KV pools, which fill to their fixed size)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds the cluster gets to go idle after the traffic")
    p.add_argument("--action-timeout", type=float, default=300.0,
                   help="seconds a request may take before it is a hang (the router holds an admitted request up to 300 s)")
    p.add_argument("--stall-hold", type=float, default=40.0,
                   help="seconds a stalled reader holds its stream (the router drops one stalled for 30 s)")
    p.add_argument("--router-queue", type=int, default=256,
                   help="the router's queue limit (--max-queued-requests): what this machine can serve within "
                        "--action-timeout under the rest of the mix (the router's own default, 1024, suits more cores)")
    p.add_argument("--burst-size", type=int, default=None,
                   help="requests at once in a burst (default: the router's queue limit + 64, so some get 429)")
    p.add_argument("--burst-max-tokens", type=int, default=4, help="output tokens of each burst request")
    p.add_argument("--burst-gap", type=float, default=60.0, help="seconds at least between two bursts' starts")
    p.add_argument("--result-json", default="results/bench_soak.json")
    p.add_argument("--plot-dir", default="results/plots")
    p.add_argument("--server-log", default="results/bench_soak_server.log", help="the cluster's stderr")
    args = p.parse_args(argv)
    if args.burst_size is None:
        args.burst_size = args.router_queue + 64
    for name in ("duration", "action_timeout", "grace"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if min(args.concurrency, args.burst_size, args.burst_max_tokens, args.router_queue) < 1:
        p.error("--concurrency, --burst-size, --burst-max-tokens and --router-queue must be >= 1")
    if args.stall_hold < 0 or args.burst_gap < 0:
        p.error("--stall-hold and --burst-gap must be >= 0")
    try:
        return soak(args)
    except (RuntimeError, httpx.HTTPError) as e:
        say(f"{type(e).__name__}: {e}")
        return 1
