"""`pdserve bench-router`: what the router adds to a request, and how many requests it routes.

1. Start one colocated worker and a router as processes (the tiny model unless `--model`).
2. Latency: one request at a time with max_tokens=1, straight to the worker (`/v1/generate`,
   token ids) and through the router (`/v1/completions`, text), taking turns; p50/p99 of each.
3. Capacity: the same requests from `--concurrency` client threads for a fixed count, to the
   worker and through the router; requests per second of each.
4. Overload: the router admits `--concurrency` requests at once; 20 times as many clients send
   one 32-token request each at the same moment. Counted: answers by status, and the router's
   memory (proportional set size) at rest and at its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.procmem import memory_mib
from pdserve.workload.results import write_json
from pdserve.credentials import TOKEN_ENV


def _spawn(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{argv[0]} did not start")
    return proc, json.loads(line)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict:
    model = args.model
    if model is None:
        from pdserve.models.synthetic import write_model
        model = str(write_model(Path(tempfile.mkdtemp()) / "tiny", "tiny", "llama"))
    procs = []
    token = secrets.token_hex(32)  # the worker's and router's shared secret, in their environment
    env, auth = {**os.environ, TOKEN_ENV: token}, {"Authorization": f"Bearer {token}"}
    try:
        router, r_ready = _spawn(["router", "--model", model, "--port", "0", "--served-model-name", "m",
                                  "--max-queued-requests", str(args.concurrency)], env)
        procs.append(router)
        worker, w_ready = _spawn(["worker", "--model", model, "--role", "both", "--port", "0", "--router",
                                  r_ready["url"], "--threads", "1", "--dtype", "float32"], env)
        procs.append(worker)
        with httpx.Client(timeout=60) as http:
            while http.get(r_ready["url"] + "/health").json()["workers"] < 1:
                time.sleep(0.05)
        direct = (w_ready["url"] + "/v1/generate",
                  {"prompt_token_ids": [5, 6, 7, 8], "sampling": {"max_tokens": 1, "temperature": 0}, "stream": False})
        routed = (r_ready["url"] + "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 1,
                                                     "temperature": 0})
        latency: dict[str, list[float]] = {"direct": [], "router": []}
        with httpx.Client(timeout=60, headers=auth) as http:  # the router, without an API key, ignores it
            for _ in range(20):  # warm up
                http.post(*direct[:1], json=direct[1])
                http.post(*routed[:1], json=routed[1])
            for i in range(args.requests):
                for name, (url, body) in (("direct", direct), ("router", routed))[:: 1 if i % 2 == 0 else -1]:
                    t0 = time.perf_counter()
                    r = http.post(url, json=body)
                    latency[name].append(time.perf_counter() - t0)
                    r.raise_for_status()
        capacity = {name: _capacity(url, body, args.concurrency, args.requests, auth) for name, (url, body)
                    in (("direct", direct), ("router", routed))}
        overload = _overload(routed[0], {**routed[1], "max_tokens": 32, "ignore_eos": True},
                             20 * args.concurrency, router.pid)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)
    result = {"model": args.model or "tiny (synthetic)", "requests": args.requests, "concurrency": args.concurrency,
              "latency_ms": {k: {"p50": _percentile(v, 0.5) * 1e3, "p99": _percentile(v, 0.99) * 1e3,
                                 "mean": statistics.mean(v) * 1e3} for k, v in latency.items()},
              "capacity_rps": capacity, "overload": overload}
    lat = result["latency_ms"]
    result["added_ms"] = {q: lat["router"][q] - lat["direct"][q] for q in ("p50", "p99")}
    return result


def _capacity(url: str, body: dict, concurrency: int, total: int, headers: dict) -> float:
    left = [total]
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=60, headers=headers) as http:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                http.post(url, json=body).raise_for_status()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total / (time.perf_counter() - t0)


def _overload(url: str, body: dict, clients: int, router_pid: int) -> dict:
    at_rest = memory_mib(router_pid)
    peak, statuses, done = [at_rest], [], threading.Event()
    start = threading.Barrier(clients + 1)

    def sample() -> None:
        while not done.is_set():
            peak.append(memory_mib(router_pid))
            time.sleep(0.02)

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            start.wait()
            try:
                statuses.append(http.post(url, json=body).status_code)
            except httpx.HTTPError as e:
                statuses.append(type(e).__name__)

    threads = [threading.Thread(target=client) for _ in range(clients)] + [threading.Thread(target=sample)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads[:-1]:
        t.join()
    done.set()
    threads[-1].join()
    counts = {str(k): statuses.count(k) for k in sorted(set(statuses), key=str)}
    return {"clients": clients, "answers": counts, "memory_mib_at_rest": at_rest, "memory_mib_peak": max(peak)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench-router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: a tiny synthetic model")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", default="results/bench_router.json")
    args = p.parse_args(argv)
    result = run(args)
    out = write_json(args.out, result)
    lat, cap = result["latency_ms"], result["capacity_rps"]
    print("| path | p50 | p99 | requests/s at concurrency %d |" % args.concurrency)
    print("| --- | --- | --- | --- |")
    for name in ("direct", "router"):
        print(f"| {name} | {lat[name]['p50']:.2f} ms | {lat[name]['p99']:.2f} ms | {cap[name]:.0f} |")
    ov = result["overload"]
    print(f"overload: {ov['clients']} clients at once -> {ov['answers']}; router memory {ov['memory_mib_at_rest']:.0f} MiB "
          f"at rest, {ov['memory_mib_peak']:.0f} MiB at peak")
    print(f"router adds {result['added_ms']['p50']:.2f} ms at p50, {result['added_ms']['p99']:.2f} ms at p99; "
          f"wrote {out}", file=sys.stderr)
    return 0
