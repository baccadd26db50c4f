"""`pdserve bench`: load against any OpenAI-compatible endpoint, measured from the client side.

1. Build the workload from the seed (loadgen.py) and the load points of the sweep: request rates
   (`inf` = all at once) or concurrencies, one list of them.
2. For each point: send every request at its arrival time as a streaming `/v1/completions` call
   (at most `--concurrency` in flight), record when each chunk with output arrives, show progress.
3. Summarize (metrics.py), add the per-phase breakdown the server reports when it is pdserve (its
   `/metrics` before and after), and write JSON, a markdown table and PNG plots.

`pdserve bench compare` (compare.py) runs the same sweep against local clusters of each kind;
`pdserve bench shift` (shift.py) runs a workload that changes halfway against the P:D controller
and static splits.
`pdserve bench soak` (soak/) and `pdserve bench chaos` (chaos/) start a cluster of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import httpx

from pdserve.workload.host_cpu import HostCpu, noisy
from pdserve.workload.loadgen import BenchRequest, WorkloadSpec, arrival_times, build_requests
from pdserve.workload.metrics import RequestRecord, summarize
from pdserve.workload.results import write_json
from pdserve.workload.args import add_workload_args, load_points, markdown, point_label, spec_from_args
from pdserve.credentials import API_KEY_ENV, add_secret_args, read_secret

_PHASE = re.compile(r'^pdserve_phase_seconds_(sum|count)\{phase="(\w+)"\} (\S+)$')


class Progress:
    """One line on stderr, rewritten in place on a terminal, every tenth otherwise."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._shown = -1

    def step(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        tenth = self.done * 10 // max(1, self.total)
        if self.tty or tenth != self._shown or self.done == self.total:
            self._shown = tenth
            bar = "#" * (self.done * 30 // max(1, self.total))
            end = "\n" if self.done == self.total else ("\r" if self.tty else "\n")
            print(f"{self.label} [{bar:<30}] {self.done}/{self.total} done, {self.failed} failed, "
                  f"{time.perf_counter() - self.t0:.1f} s", end=end, file=sys.stderr, flush=True)


async def _send(http: httpx.AsyncClient, url: str, payload: dict, record: RequestRecord) -> None:
    try:
        async with http.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                await r.aread()
                record.error = f"HTTP {r.status_code}"
                return
            usage_tokens = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"].get("type") or "error event"
                    return
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    record.first_token = record.first_token or now
                    record.chunk_times.append(now)
            record.end = time.perf_counter()
            record.output_tokens = usage_tokens if usage_tokens is not None else len(record.chunk_times)
    except (httpx.HTTPError, ValueError) as e:
        record.error = type(e).__name__


async def run_load(url: str, model: str, requests: list[BenchRequest], rate: float, concurrency: int | None,
                   burstiness: float = 1.0, seed: int = 0, api_key: str = "", temperature: float = 0.0,
                   label: str = "", timeout_s: float = 600.0, offsets: list[float] | None = None,
                   extra_body: dict | None = None) -> list[RequestRecord]:
    """Send the requests at their arrival times (`offsets` in seconds from the start, or drawn from
    `rate`, `burstiness` and `seed`); returns one record per request, in order. `extra_body`: added
    to every request's body (a response_format, structured_outputs, tools...)."""
    if offsets is None:
        offsets = arrival_times(len(requests), rate, burstiness, seed)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    progress = Progress(len(requests), label or "bench")
    records = [RequestRecord(start=0.0, prompt_tokens=r.prompt_tokens, turn=r.turn) for r in requests]
    turn_done: dict[tuple[int, int], asyncio.Event] = {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(requests) or 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers) as http:
        t0 = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            if req.turn:  # a session's next turn follows its previous one, after the user's think time
                await turn_done[(req.session, req.turn - 1)].wait()
                await asyncio.sleep(req.think_s)
            payload = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                       **(extra_body or {})}
            try:
                if slots:
                    await slots.acquire()
                records[i].start = time.perf_counter()
                await _send(http, url.rstrip("/") + "/v1/completions", payload, records[i])
            finally:
                if slots:
                    slots.release()
                if req.session >= 0:
                    turn_done[(req.session, req.turn)].set()
                progress.step(records[i].ok)

        for req in requests:
            if req.session >= 0:
                turn_done[(req.session, req.turn)] = asyncio.Event()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return records


def scrape_phases(url: str) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of pdserve's per-phase seconds so far (empty when there are none), or None when
    the server has no metrics to read."""
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    text = r.text
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if m := _PHASE.match(line):
            found.setdefault(m[2], [0.0, 0.0])["sum count".split().index(m[1])] = float(m[3])
    return {k: (v[0], v[1]) for k, v in found.items()}


def phase_means_ms(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Mean milliseconds per phase over the requests that finished in between; None if unknown."""
    if before is None or not after:
        return None
    out = {}
    for phase, (s, n) in after.items():
        s0, n0 = before.get(phase, (0.0, 0.0))
        if n > n0:
            out[phase] = (s - s0) / (n - n0) * 1e3
    return out or None


def server_info(url: str, api_key: str = "") -> dict:
    """The first model the endpoint lists (id, and pdserve's vocab_size when given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def sweep(url: str, model: str, spec: WorkloadSpec, points: list[dict], args: argparse.Namespace,
          label: str = "", server_pids: list[int] | None = None) -> tuple[list[dict], dict[str, list[RequestRecord]]]:
    """Run every load point; (summaries, records by point label). Each point draws prompts of its
    own (seed + its index), so no point finds the last one's prompts in a prefix cache; the same
    seed gives every server the same prompts at each point. With the server's `server_pids` (on
    this machine), each summary says how many cores the rest of the machine took meanwhile."""
    summaries, records_by_point = [], {}
    for i, point in enumerate(points):
        requests = build_requests(dataclasses.replace(spec, seed=spec.seed + i))
        name = point_label(point)
        before = scrape_phases(url)
        meter = HostCpu([os.getpid(), *server_pids]) if server_pids else None
        records = asyncio.run(run_load(url, model, requests, point["request_rate"], point["concurrency"],
                                       args.burstiness, spec.seed, args.api_key, args.temperature,
                                       f"{label}{name}", extra_body=getattr(args, "extra_body", None)))
        summary = {"load": {k: (None if v == math.inf else v) for k, v in point.items()},
                   **summarize(records, args.ttft_slo / 1e3, args.tpot_slo / 1e3)}
        summary["phases_ms"] = phase_means_ms(before, scrape_phases(url))
        if meter is not None:
            summary["host_cpu"] = meter.cores()
            if noisy(summary["host_cpu"]):
                print(f"[bench] {label}{name}: other processes took {summary['host_cpu']['others']:.2f} cores "
                      f"(steal {summary['host_cpu']['steal']:.2f}) meanwhile; its latencies include their noise",
                      file=sys.stderr, flush=True)
        summaries.append(summary)
        records_by_point[name] = records
    return summaries, records_by_point


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not JSON") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, please")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="an OpenAI-compatible server")
    p.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    add_secret_args(p, "api-key", API_KEY_ENV, "the server's API key")
    add_workload_args(p)
    p.add_argument("--extra-body", type=_json_object, default=None, metavar="JSON",
                   help="a JSON object added to every request's body, e.g. '{\"response_format\": {\"type\": "
                        "\"json_object\"}}' for structured outputs, or tools and a tool_choice")
    p.add_argument("--result-json", default="results/bench_serving.json")
    p.add_argument("--plot-dir", default="results/plots")
    args = p.parse_args(argv)
    try:
        args.api_key = read_secret(args.api_key_file, API_KEY_ENV)
        info = server_info(args.url, args.api_key)
        spec = spec_from_args(args, args.vocab_size or int(info.get("vocab_size") or 256))
        points = load_points(args.request_rate, args.concurrency)
    except (ValueError, httpx.HTTPError) as e:
        p.error(str(e))
    model = args.model or info["id"]
    summaries, records = sweep(args.url, model, spec, points, args)
    result = {"settings": {"url": args.url, "model": model, **spec.describe(), "burstiness": args.burstiness,
                           "temperature": args.temperature, "extra_body": args.extra_body}, "runs": summaries}
    if len(summaries) == 1:
        result.update(summaries[0])
    out = write_json(args.result_json, result)
    from pdserve.workload import plots

    plot_dir = Path(args.plot_dir)
    written = [plots.latency_cdfs(records, plot_dir / "latency_cdf.png", f"{model}: latency CDFs")]
    if len(summaries) > 1:
        key = "request_rate" if len({s["load"]["request_rate"] for s in summaries}) > 1 else "concurrency"
        written.append(plots.load_curves({model: summaries}, key, plot_dir / "goodput_vs_load.png"))
    print(markdown(summaries))
    print(f"wrote {out} and {', '.join(str(w) for w in written)}", file=sys.stderr)
    return 0
