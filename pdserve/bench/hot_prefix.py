"""`pdserve bench prefix`: a burst of requests on one hot prefix, routed three ways, in one run.

Settings (each a `pdserve serve --colocated N --pin-cpus` cluster of its own, started in turn):
- `load`: routing by load alone (`--prefix-affinity 0 --hot-prefix-rate 0`): the requests spread,
  and each worker computes the prefix once for itself (or more, for those that arrive together);
- `affinity`: routing prefers the worker holding the prompt, no copies (`--hot-prefix-rate 0`):
  the burst piles onto the prefix's first holder;
- `copies`: affinity and hot-prefix copies (`--hot-prefix-rate R`): the router copies the prefix's
  KV to the other workers as its rate asks, and the burst spreads over its holders.
- `store`: affinity, no copies, a shared KV store (`--local-kv-store`): the prefix's blocks reach
  the store as its first holder computes them, and every worker reads them from there.

Each run: one request on the prefix (untimed: the prefix is then in one worker's cache, as a hot
prefix is), then `--requests` streamed completions of the prefix (`--prefix-tokens` random token ids,
the same for all) and `--own-tokens` ids of their own, arriving at `--rate` (Poisson, seeded; the
same arrivals for every setting). Per setting: TTFT and end-to-end latency, throughput, the prompt
tokens the workers computed (the sum of their `pdserve_prompt_tokens_by_source_total` by source,
read from their /stats before and after), each worker's share of the prompt tokens served, and the
router's copies. JSON, a markdown table, and a PNG of the TTFT CDFs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
from pathlib import Path

import httpx

from pdserve.bench.crash import token_range
from pdserve.bench.local_cluster import LocalCluster
from pdserve.bench.serving import run_load, server_info
from pdserve.workload.args import chosen
from pdserve.workload.loadgen import BenchRequest
from pdserve.workload.metrics import RequestRecord, distribution

SETTINGS = {
    "load": ["--prefix-affinity", "0", "--hot-prefix-rate", "0"],
    "affinity": ["--hot-prefix-rate", "0"],
    "copies": [],  # --hot-prefix-rate from the bench's own flag
    "store": ["--hot-prefix-rate", "0", "--local-kv-store", "1GiB"],  # the `store` extra
}


def _say(message: str) -> None:
    print(f"[bench prefix] {message}", file=sys.stderr, flush=True)


def make_requests(args: argparse.Namespace, lo: int, hi: int) -> tuple[BenchRequest, list[BenchRequest]]:
    rng = random.Random(args.seed)
    prefix = rng.choices(range(lo, hi), k=args.prefix_tokens)
    own = lambda: rng.choices(range(lo, hi), k=args.own_tokens)  # noqa: E731
    first = BenchRequest(prompt=prefix + own(), max_tokens=args.max_tokens)
    return first, [BenchRequest(prompt=prefix + own(), max_tokens=args.max_tokens) for _ in range(args.requests)]


def sources(cluster: LocalCluster, token: str) -> dict[str, dict[str, int]]:
    """Each worker's prompt tokens by where their KV came from, so far."""
    out = {}
    for p in cluster.ready["processes"]:
        if p["name"] != "router":
            stats = httpx.get(p["url"] + "/stats", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
            out[p["name"]] = stats.get("tokens_by_source", {})
    return out


def copies(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith("pdserve_hot_prefix_copies_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = float(line.rsplit(" ", 1)[1])
    return found


def one_setting(name: str, args: argparse.Namespace, first: BenchRequest, burst: list[BenchRequest],
                out: Path) -> tuple[dict, list[RequestRecord]]:
    token = secrets.token_hex(32)  # the workers' token: their /stats say what they computed
    from pdserve.credentials import TOKEN_ENV

    flags = ["--prefill", "0", "--decode", "0", "--colocated", str(args.workers), "--pin-cpus", *SETTINGS[name],
             *(["--hot-prefix-rate", str(args.copy_rate)] if name == "copies" else [])]
    _say(f"{name}: starting pdserve serve {' '.join(flags)}")
    cluster = LocalCluster(args.model, flags, log_path=out / f"{name}.log",
                           env={TOKEN_ENV: token}, progress=lambda s: _say(f"{name}: starting ({s:.0f} s)"))
    try:
        model = server_info(cluster.url)["id"]
        asyncio.run(run_load(cluster.url, model, [first], rate=1.0, concurrency=1, label=f"{name} first", offsets=[0.0]))
        before = sources(cluster, token)
        records = asyncio.run(run_load(cluster.url, model, burst, rate=args.rate, concurrency=None, seed=args.seed,
                                       label=name))
        after = sources(cluster, token)
        made = copies(cluster.url)
    finally:
        cluster.stop()
    done = [r for r in records if r.ok]
    span = max(r.end for r in done) - min(r.start for r in records) if done else float("nan")
    delta = {w: {k: after[w].get(k, 0) - before[w].get(k, 0) for k in after[w]} for w in after}
    served = {w: sum(d.get(k, 0) for k in ("computed", "prefix_cache")) for w, d in delta.items()}
    total_served = sum(served.values()) or 1
    return {"completed": len(done), "requests": len(records),
            "ttft_ms": distribution([r.ttft for r in done]), "e2e_ms": distribution([r.e2e for r in done]),
            "output_tokens_per_s": sum(r.output_tokens for r in done) / span if done else None,
            "computed_prompt_tokens": sum(d.get("computed", 0) for d in delta.values()),
            "transferred_prompt_tokens": sum(d.get("transferred", 0) for d in delta.values()),
            "served_share": {w: round(n / total_served, 3) for w, n in sorted(served.items())},
            "copies": made, "by_worker": delta}, records


COLUMNS = ("completed", "TTFT p50 (ms)", "TTFT p90 (ms)", "E2E p50 (ms)", "output tok/s", "prompt tokens computed",
           "share served per worker", "copies made")


def table(results: dict) -> str:
    lines = ["| setting | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, s in results.items():
        cells = [f"{s['completed']}/{s['requests']}", f"{s['ttft_ms']['p50']:.0f}", f"{s['ttft_ms']['p90']:.0f}",
                 f"{s['e2e_ms']['p50']:.0f}", f"{s['output_tokens_per_s']:.1f}", str(s["computed_prompt_tokens"]),
                 " / ".join(f"{v:.2f}" for v in s["served_share"].values()), f"{s['copies'].get('copied', 0):.0f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--workers", type=int, default=2, help="colocated workers, the cores split among them")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--own-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--copy-rate", type=float, default=0.5, help="--hot-prefix-rate of the copies setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-prefix-results", help="folder for the JSON, the PNG and the logs")
    args = p.parse_args(argv)
    settings = chosen(p, args.settings, SETTINGS)
    if min(args.workers, args.requests, args.prefix_tokens, args.own_tokens, args.max_tokens) < 1 or not (
            args.rate > 0 and args.copy_rate > 0):
        p.error("counts, --rate and --copy-rate must be positive")
    from pdserve.bench.machine import environment
    from pdserve.store_server import server_binary

    if "store" in settings:
        try:
            server_binary()
        except RuntimeError as e:
            _say(f"no store setting: {e}")
            settings.remove("store")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = environment()
    _say(f"CPU: {machine['cpu']} ({machine['cpu_count']} cores)")
    first, burst = make_requests(args, *token_range(args.model))
    results, runs = {}, {}
    for name in settings:
        results[name], runs[name] = one_setting(name, args, first, burst, out)
        _say(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'by_worker'})}")
    path = out / "bench_prefix.json"
    path.write_text(json.dumps({"machine": machine, "settings": vars(args), "results": results}, indent=2))
    try:
        from pdserve.workload.plots import latency_cdfs

        png = latency_cdfs(runs, path.with_suffix(".png"), "one hot prefix: load, affinity, copies")
        _say(f"wrote {path} and {png}")
    except ImportError:
        _say(f"wrote {path} (no matplotlib: no plot)")
    print(f"CPU: {machine['cpu']} ({machine['cpu_count']} cores, pid {os.getpid()}); {args.workers} colocated workers, "
          f"{args.requests} requests at {args.rate}/s, {args.prefix_tokens}-token shared prefix + {args.own_tokens} "
          f"own, {args.max_tokens} tokens each\n")
    print(table(results))
    return 0
