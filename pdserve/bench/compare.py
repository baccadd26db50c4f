"""`pdserve bench compare`: colocated against disaggregated serving on this machine, equal cores.

1. For each configuration, start a local cluster with `pdserve serve --pin-cpus` (workers share the
   machine's cores equally) and wait until it is ready:
   - default: `pdserve serve` as a user starts it, no layout flag (the layout it picks for this host);
   - colocated: one worker doing prefill and decode on all cores;
   - disaggregated: one prefill and one decode worker, the cores split between them;
   - replicas: two colocated workers, the cores split;
   - disaggregated-2-routers: disaggregated behind two routers on one address (router replicas).
   With `--peer-url [NAME=]URL`, servers already running (vLLM for CPU, SGLang, another pdserve)
   are measured too, each as one more row: the same prompts, loads and targets. With
   `--peer-command NAME=CMD` the peer is started only for its own rows and stopped after them
   (`peer_process.py`): a server idling beside another's measurement can slow it.
2. Run the same seeded workload sweep against each (the `pdserve bench` runner), sampling the
   memory of the router and workers (proportional set size: shared pages count once), then stop
   the cluster.
3. Write JSON (every setting disclosed), a markdown table in the seeds' shape, the goodput ratio of
   each configuration to colocated at each load, and plots: goodput and p99 TPOT against load, and
   latency CDFs of every configuration at each load.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from pdserve.workload.host_cpu import NOISY_OTHERS_CORES, noisy
from pdserve.bench.local_cluster import LocalCluster
from pdserve.bench.peer import parse_peer, peer_pids
from pdserve.bench.peer_process import PeerProcess
from pdserve.bench.procmem import memory_mib
from pdserve.workload.results import write_json
from pdserve.bench.serving import server_info, sweep
from pdserve.workload.args import add_workload_args, load_points, spec_from_args
from pdserve.credentials import add_secret_args, read_secret

PEER_KEY_ENV = "PDSERVE_PEER_API_KEY"

CONFIGS = {
    "default": [],  # no layout flag, no pinning: what `pdserve serve` does by itself here
    "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1"],
    "disaggregated": ["--prefill", "1", "--decode", "1", "--colocated", "0"],
    "replicas": ["--prefill", "0", "--decode", "0", "--colocated", "2"],
    # disaggregated behind two routers on one address (router replicas): what a second router costs
    "disaggregated-2-routers": ["--prefill", "1", "--decode", "1", "--colocated", "0", "--routers", "2"],
}


def total_memory_mib(pids: list[int]) -> float:
    """A server's memory: all its processes, shared pages counted once."""
    return sum(m for pid in pids if (m := memory_mib(pid)) == m)  # NaN: a process that is gone


def run_config(name: str, args: argparse.Namespace, points: list[dict]) -> tuple[dict, dict]:
    print(f"[bench compare] starting {name}", file=sys.stderr, flush=True)
    pinned = ["--pin-cpus"] if CONFIGS[name] else []
    cluster = LocalCluster(args.model, [*pinned, *CONFIGS[name], *args.serve_args.split()])
    try:
        result, records = measure(name, cluster.url, [cluster.proc.pid, *cluster.pids.values()], args, points)
    finally:
        cluster.stop()
    return {**result, "processes": cluster.ready["processes"]}, records


def run_peer(name: str, url: str, args: argparse.Namespace, points: list[dict]) -> tuple[dict, dict]:
    command = args.peer_commands.get(name)
    started = None
    if command is not None:
        print(f"[bench compare] starting {name}: {command}", file=sys.stderr, flush=True)
        started = PeerProcess(name, url, command, Path(args.plot_dir) / f"peer-{name}.log", args.peer_key,
                              progress=lambda s: print(f"[bench compare] {name}: still starting after {s:.0f}s",
                                                       file=sys.stderr, flush=True))
    try:
        pids = peer_pids(url)
        print(f"[bench compare] {name}: {url}" + (f" (processes {pids})" if pids else " (not on this machine)"),
              file=sys.stderr, flush=True)
        result, records = measure(name, url, pids, argparse.Namespace(**{**vars(args), "api_key": args.peer_key}),
                                  points)
    finally:
        if started is not None:
            started.stop()
    return {**result, "url": url, "processes": [{"pid": pid} for pid in pids], "command": command}, records


# Reading a process's proportional set size walks its page tables while holding its memory map's
# lock: 10 ms for a 1.7 GB worker, 30 ms for vLLM's 5 GB one on a 2-vCPU Xeon, during which the
# server's own page faults wait. Every 0.25 s that cost the measured servers a fifth of their
# throughput on 2 cores; the peak (a KV pool is allocated up front) needs no finer sampling.
MEMORY_SAMPLE_S = 2.0


def measure(name: str, url: str, pids: list[int], args: argparse.Namespace, points: list[dict]) -> tuple[dict, dict]:
    """The sweep against a server at `url`, and the peak memory of its processes `pids` (None if
    none are known), sampled every MEMORY_SAMPLE_S."""
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while True:  # from the start: a short sweep may end before the first wait does
            peak[0] = max(peak[0], total_memory_mib(pids))
            if done.wait(MEMORY_SAMPLE_S):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        info = server_info(url, args.api_key)
        spec = spec_from_args(args, args.vocab_size or int(info.get("vocab_size") or 256))
        model = info["id"] if name in CONFIGS or not args.peer_model else args.peer_model
        runs, records = sweep(url, model, spec, points, args, label=f"{name}: ", server_pids=pids or None)
    finally:
        done.set()
        sampler.join()
    return {"runs": runs, "memory_mib_peak": peak[0] if pids else None, "model": model,
            "workload": spec.describe()}, records


def table(results: dict[str, dict], baseline: str = "colocated") -> str:
    """The seeds' table; the ratios are each row's output tok/s and TTFT / TPOT means against the
    `baseline` row's (a configuration or a peer) at the same load."""
    lines = ["| config | load | done/sent | output tok/s | TTFT mean / p99 ms | TPOT mean / p99 ms | goodput req/s "
             f"| SLA % | vs {baseline}: tok/s, TTFT, TPOT | memory MiB |", "|" + " --- |" * 10]
    base = results.get(baseline)
    for name, res in results.items():
        for i, s in enumerate(res["runs"]):
            load = s["load"]["concurrency"] if s["load"]["concurrency"] else (s["load"]["request_rate"] or "inf")
            ratio = "-" if base is None else _ratios(s, base["runs"][i])
            f = lambda d: "-" if d["mean"] is None else f"{d['mean']:.0f} / {d['p99']:.0f}"  # noqa: E731
            mark = " (noisy)" if noisy(s.get("host_cpu")) else ""
            memory = "-" if res["memory_mib_peak"] is None else f"{res['memory_mib_peak']:.0f}"
            lines.append(f"| {name} | {load}{mark} | {s['completed']}/{s['num_requests']} "
                         f"| {s['output_throughput']:.1f} "
                         f"| {f(s['ttft'])} | {f(s['tpot'])} | {s['goodput']:.3f} | {s['sla_attainment_pct']:.0f} "
                         f"| {ratio} | {memory} |")
    if any(noisy(s.get("host_cpu")) for res in results.values() for s in res["runs"]):
        lines.append(f"\n(noisy): other processes on this machine took more than {NOISY_OTHERS_CORES} cores while "
                     "that point ran (`host_cpu` in the JSON); measure it again on a quiet machine.")
    return "\n".join(lines)


def _peer_command(text: str, peers: dict[str, str]) -> tuple[str, str]:
    name, sep, command = text.partition("=")
    if not sep or not command.strip():
        raise ValueError(f"--peer-command takes NAME=CMD; got {text!r}")
    if name not in peers:
        raise ValueError(f"--peer-command {name}: no --peer-url names {name!r}")
    return name, command


def _ratios(run: dict, base: dict) -> str:
    def over(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    return ", ".join((over(run["output_throughput"], base["output_throughput"]),
                      over(run["ttft"]["mean"], base["ttft"]["mean"]), over(run["tpot"]["mean"], base["tpot"]["mean"])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model for every cluster (default: SmolLM2-135M-Instruct)")
    p.add_argument("--configs", default="colocated,disaggregated,replicas")
    p.add_argument("--serve-args", default="", help="more flags for every `pdserve serve`, e.g. '--dtype float32'")
    add_workload_args(p)
    # the long-prompt workload where prefill and decode interfere
    p.set_defaults(input_len="1024+-128", output_len="64", num_requests=24, request_rate="0.1,0.2,0.3,0.4",
                   ttft_slo=8000.0, tpot_slo=100.0)
    p.add_argument("--peer-url", action="append", default=[], metavar="[NAME=]URL",
                   help="an OpenAI-compatible server already running (vLLM, SGLang, ...) measured with the same "
                        "sweep, as one more row; repeatable")
    p.add_argument("--peer-command", action="append", default=[], metavar="NAME=CMD",
                   help="start peer NAME with this shell command just before its rows and stop it after "
                        "(its process group), so that it never idles beside another server's measurement; "
                        "repeatable")
    p.add_argument("--peer-model", default=None, help="the model name to ask peers for (default: their first)")
    add_secret_args(p, "peer-api-key", PEER_KEY_ENV, "the peers' API key")
    p.add_argument("--baseline", default=None, help="the row the table's ratios are against: a configuration or a "
                   "peer's name (default: colocated, if measured, else the first)")
    p.add_argument("--result-json", default="results/bench_compare.json")
    p.add_argument("--plot-dir", default="results/plots")
    args = p.parse_args(argv)
    args.api_key = ""  # clusters started here ask for no key
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not (names or args.peer_url):
        p.error(f"--configs takes {', '.join(CONFIGS)}; got {args.configs!r}")
    try:
        points = load_points(args.request_rate, args.concurrency)
        peers = dict(parse_peer(text, i) for i, text in enumerate(args.peer_url))
        args.peer_commands = dict(_peer_command(text, peers) for text in args.peer_command)
        args.peer_key = read_secret(args.peer_api_key_file, PEER_KEY_ENV)
    except ValueError as e:
        p.error(str(e))
    if len(peers) != len(args.peer_url) or set(peers) & set(CONFIGS):
        p.error("peers need names of their own, none of " + ", ".join(CONFIGS))
    measured = [*names, *peers]
    baseline = args.baseline or ("colocated" if "colocated" in measured else measured[0])
    if baseline not in measured:
        p.error(f"--baseline {baseline!r} names no configuration or peer measured here")
    results, records = {}, {}
    for name in names:
        results[name], records[name] = run_config(name, args, points)
    for name, url in peers.items():
        results[name], records[name] = run_peer(name, url, args, points)
    settings = {"model": args.model, "configs": {n: CONFIGS[n] for n in names}, "peers": peers, "peer_commands": args.peer_commands,
                "serve_args": args.serve_args,
                "dtype": _dtype(args.model, args.serve_args),
                "cores": len(os.sched_getaffinity(0)), "slo_ms": {"ttft": args.ttft_slo, "tpot": args.tpot_slo},
                "burstiness": args.burstiness, "temperature": args.temperature, "when": time.strftime("%Y-%m-%d %H:%M")}
    out = write_json(args.result_json, {"settings": settings, "results": results})
    written = _plots(results, records, Path(args.plot_dir), args.model)
    print(table(results, baseline))
    print(f"wrote {out} and {', '.join(str(w) for w in written)}", file=sys.stderr)
    return 0


def _dtype(model: str, serve_args: str) -> str:
    """The workers' dtype: as passed, or what `auto` chose on this machine (the workers measured it)."""
    parts = serve_args.split()

    def passed(flag: str, default: str) -> str:
        return parts[parts.index(flag) + 1] if flag in parts[:-1] else default

    name = passed("--dtype", "auto")
    if name != "auto":
        return name
    from pdserve.engine.dtype_choice import recorded_choice
    from pdserve.models.registry import resolve_model

    return f"auto ({recorded_choice(resolve_model(model), passed('--quantization', 'auto')) or 'not measured'})"


def _plots(results: dict, records: dict, plot_dir: Path, model: str) -> list[Path]:
    from pdserve.workload import plots

    first = next(iter(results.values()))["runs"]
    key = "concurrency" if first[0]["load"]["concurrency"] else "request_rate"
    written = []
    if len(first) > 1:
        written.append(plots.load_curves({n: r["runs"] for n, r in results.items()}, key,
                                         plot_dir / "compare_goodput_vs_load.png", f"{model}: equal cores"))
    for point in next(iter(records.values())):
        slug = point.replace(" ", "").replace(",", "_")
        written.append(plots.latency_cdfs({n: recs[point] for n, recs in records.items()},
                                          plot_dir / f"compare_cdf_{slug}.png", f"{model}, {point}"))
    return written
