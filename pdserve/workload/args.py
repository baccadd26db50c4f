"""A workload as the command line gives it (lengths, load points, targets), and the table of its
results: shared by `pdserve bench` (measured) and `pdserve simulate` (simulated)."""

from __future__ import annotations

import argparse
import math

from pdserve.workload.loadgen import LengthDist, WorkloadSpec


def load_points(rates: str, concurrencies: str | None) -> list[dict]:
    rate_list = [math.inf if x.strip() in ("inf", "") else float(x) for x in rates.split(",")]
    conc_list = [int(x) for x in concurrencies.split(",")] if concurrencies else [None]
    if len(rate_list) > 1 and len(conc_list) > 1:
        raise ValueError("sweep either request rates or concurrencies, not both")
    return [{"request_rate": r, "concurrency": c} for r in rate_list for c in conc_list]


def point_label(point: dict) -> str:
    rate = "inf" if point["request_rate"] == math.inf else f"{point['request_rate']:g}"
    return f"rate {rate}" + (f", concurrency {point['concurrency']}" if point["concurrency"] else "")


def markdown(summaries: list[dict]) -> str:
    head = ("| load | done/sent | req/s | out tok/s | goodput | SLA % | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
            "| ITL p99 ms | E2E p50 ms |")
    lines = [head, "|" + " --- |" * 10]
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for s in summaries:
        lines.append(
            f"| {point_label({**s['load'], 'request_rate': s['load']['request_rate'] or math.inf})} "
            f"| {s['completed']}/{s['num_requests']} | {s['request_throughput']:.3f} | {s['output_throughput']:.1f} "
            f"| {s['goodput']:.3f} | {s['sla_attainment_pct']:.0f} | {f(s['ttft']['p50'])} / {f(s['ttft']['p99'])} "
            f"| {f(s['tpot']['p50'])} / {f(s['tpot']['p99'])} | {f(s['itl']['p99'])} | {f(s['e2e']['p50'])} |")
    later = [s for s in summaries if s.get("ttft_later_turns", {}).get("p50") is not None]
    if later:  # sessions: what a turn costs once its prefix was computed before
        lines += ["", "| load | later turns' TTFT p50 / p99 ms |", "| --- | --- |"]
        lines += [f"| {point_label({**s['load'], 'request_rate': s['load']['request_rate'] or math.inf})} "
                  f"| {f(s['ttft_later_turns']['p50'])} / {f(s['ttft_later_turns']['p99'])} |" for s in later]
    return "\n".join(lines)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=100, help="requests per load point")
    g.add_argument("--request-rate", default="inf",
                   help="requests per second, Poisson arrivals (inf: all at once); a comma list sweeps")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    g.add_argument("--concurrency", default=None, help="most requests in flight; a comma list sweeps")
    g.add_argument("--input-len", default="512", help="prompt tokens: N, A-B (uniform) or M+-S (normal)")
    g.add_argument("--output-len", default="128", help="output tokens (max_tokens, EOS ignored), same forms")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a shared system prompt")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    g.add_argument("--turns", type=int, default=1, help="turns per session (each prompt extends the last)")
    g.add_argument("--think-time", type=float, default=0.0,
                   help="seconds between a turn's answer and the session's next turn")
    g.add_argument("--dataset", default=None, help='JSONL of {"prompt": str | [ids], "max_tokens"?: int}')
    g.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this (default: asked)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ttft-slo", type=float, default=2000.0, help="TTFT target in ms, for goodput")
    g.add_argument("--tpot-slo", type=float, default=100.0, help="TPOT target in ms, for goodput")


def spec_from_args(args: argparse.Namespace, vocab_size: int) -> WorkloadSpec:
    if args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.think_time < 0:
        raise ValueError("--think-time must not be negative")
    return WorkloadSpec(args.num_requests, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len),
                        args.seed, vocab_size, args.shared_prefix_len, args.num_prefixes, args.turns, args.dataset,
                        args.think_time)


def chosen(p: argparse.ArgumentParser, given: str, known, what: str = "setting") -> list[str]:
    """A benchmark's comma-separated settings (or cases), each one it knows; an argparse error
    naming those it does not."""
    names = given.split(",")
    if unknown := [n for n in names if n not in known]:
        p.error(f"unknown {what}(s) {unknown}: choose from {', '.join(known)}")
    return names
