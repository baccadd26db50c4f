"""`pdserve top`: a running cluster in a terminal, from the router's /metrics alone, for a cluster
without Grafana. The router reports every worker's load from its heartbeats, so one endpoint
shows the whole cluster.

Lifecycle of a view:
1. Poll GET /metrics and parse it (`Scrape.parse`).
2. Wait `--interval` seconds and poll again.
3. `render(before, after)`: counters and histograms as what grew between the two polls (rates,
   percentiles of the requests that finished in between), gauges as the second poll has them. A
   pure function of the two scrapes.
4. Draw it (over the last one on a terminal), and go on from 2 with the second poll as the first.
A router that does not answer is one line on stderr, and polling goes on (`--once`: exit 1).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.telemetry.thresholds import ALERT_ABOVE

DEFAULT_ROUTER = "http://127.0.0.1:8000"
CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase the screen
WORKER_COLUMNS = ("worker", "role", "running", "waiting", "for KV", "KV use", "step ms", "heartbeat")

Labels = dict[str, str]


@dataclass(slots=True)
class Scrape:
    """One poll of the router's /metrics: every sample by its name (`_total`, `_bucket` included)."""

    at: float  # seconds on any clock: only the difference between two scrapes is read
    samples: dict[str, list[tuple[Labels, float]]]

    @classmethod
    def parse(cls, text: str, at: float) -> Scrape:
        samples: dict[str, list[tuple[Labels, float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
        return cls(at, samples)

    def value(self, name: str, **labels: str) -> float:
        """`name` summed over its series whose labels include `labels` (0 where none has them)."""
        return sum(value for have, value in self.samples.get(name, ()) if labels.items() <= have.items())

    def by(self, name: str, label: str) -> dict[str, float]:
        return {have[label]: value for have, value in self.samples.get(name, ()) if label in have}


def grew(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    """What a counter added between two scrapes (a router restarted in between counts from 0)."""
    old, new = before.value(name, **labels), after.value(name, **labels)
    return new - old if new >= old else new


def buckets(before: Scrape, after: Scrape, histogram: str) -> list[tuple[float, float]]:
    """(upper bound, observations at or below it) of what `histogram` observed between two scrapes,
    over all its series."""
    def cumulative(scrape: Scrape) -> dict[float, float]:
        counts: dict[float, float] = {}
        for labels, value in scrape.samples.get(f"{histogram}_bucket", ()):
            le = float(labels["le"])
            counts[le] = counts.get(le, 0.0) + value
        return counts

    old, new = cumulative(before), cumulative(after)
    if any(new.get(le, 0.0) < count for le, count in old.items()):  # the router restarted
        old = {}
    return sorted((le, count - old.get(le, 0.0)) for le, count in new.items())


def quantile(q: float, counts: list[tuple[float, float]]) -> float | None:
    """As Prometheus's histogram_quantile: linear within the bucket the rank falls in; the highest
    finite bound where it falls in +Inf; None without observations."""
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in counts:
        if count >= rank:
            return lower if math.isinf(upper) else lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render(before: Scrape, after: Scrape, router: str = "") -> str:
    """The view of what happened between two scrapes of one router's /metrics."""
    seconds = max(after.at - before.at, 1e-9)

    def per_s(name: str, **labels: str) -> float:
        return grew(before, after, name, **labels) / seconds

    def percentiles(histogram: str) -> str:
        counts = buckets(before, after, histogram)
        return f"p50 {duration(quantile(0.5, counts))}  p95 {duration(quantile(0.95, counts))}"

    finished = grew(before, after, "pdserve_requests_total")
    errors = grew(before, after, "pdserve_requests_total", outcome="error") / finished if finished else None
    lines = [
        f"pdserve top  {router}  over the last {seconds:.1f} s",
        f"requests {per_s('pdserve_requests_total'):.2f}/s   tokens out {per_s('pdserve_generated_tokens_total'):.1f}/s"
        f"   errors {share(errors)}   goodput {per_s('pdserve_sla_met_requests_total'):.2f} req/s"
        f"   KV in {per_s('pdserve_kv_bytes_received') / 1e6:.2f} MB/s",
        f"TTFT {percentiles('pdserve_ttft_seconds')}    TPOT {percentiles('pdserve_tpot_seconds')}",
        "SLA (last 5 min)  " + "  ".join(f"{metric} {share(after.value('pdserve_sla_attainment', metric=metric))}"
                                         for metric in ("ttft", "tpot", "both"))
        + f"    router queue {after.value('pdserve_queue_requests'):.0f} requests, "
          f"{after.value('pdserve_queue_prompt_tokens'):.0f} prompt tokens",
        "workers  " + "  ".join(f"{role} {after.value('pdserve_workers', role=role):.0f}"
                                for role in ("prefill", "decode", "both")),
        "since the router started  " + "  ".join(f"{what} {after.value(name):.0f}" for what, name in (
            ("rebalances", "pdserve_rebalances_total"), ("restarts", "pdserve_worker_rejoins_total"),
            ("dropped", "pdserve_workers_dropped_total"), ("migrations", "pdserve_migrations_total"))),
        "",
        *indicators(after),
        "",
        *workers(after),
    ]
    return "\n".join(lines) + "\n"


def indicators(scrape: Scrape) -> list[str]:
    """The indicators the design articles alert on, with their levels, ALERT where one is crossed."""
    rows = [("decode waiting share", "pdserve_decode_waiting_share"),
            ("KV transfer share of TTFT", "pdserve_kv_transfer_ttft_share")]
    lines = [f"{'indicator':<32}{'now':>8}  alert above"]
    for what, name in rows:
        value, level = scrape.value(name), ALERT_ABOVE[name]
        lines.append(f"{what:<32}{share(value):>8}  {share(level):>6}" + ("  ALERT" if value > level else ""))
    pools = "  ".join(f"{role} {share(scrape.value('pdserve_pool_utilization', role=role))}"
                      for role in ("prefill", "decode", "both"))
    spread = share(scrape.value("pdserve_pool_utilization_spread"))
    return [*lines, f"pools' mean KV use  {pools}    prefill/decode spread {spread}"]


def workers(scrape: Scrape) -> list[str]:
    """One row per worker the router has, from its last heartbeat."""
    running = scrape.samples.get("pdserve_worker_running", ())
    keys = sorted({(labels["role"], labels["worker"]) for labels, _ in running})

    def gauge(key: str, role: str, worker: str) -> float:
        return scrape.value(f"pdserve_worker_{key}", worker=worker, role=role)

    rows = [(worker, role, f"{gauge('running', role, worker):.0f}", f"{gauge('waiting', role, worker):.0f}",
             f"{gauge('waiting_for_kv', role, worker):.0f}", share(gauge("kv_usage", role, worker)),
             f"{gauge('step_latency_ewma_ms', role, worker):.1f}",
             f"{gauge('heartbeat_age_seconds', role, worker):.1f} s") for role, worker in keys]
    if not rows:
        return ["no workers registered"]
    width = max(len(WORKER_COLUMNS[0]), *(len(row[0]) for row in rows))
    return [f"{row[0]:<{width}}  {row[1]:<8}" + "".join(f"{cell:>10}" for cell in row[2:])
            for row in (WORKER_COLUMNS, *rows)]


class Unreachable(Exception):
    """The router did not answer its /metrics (the message is the line to show)."""


def poll(client: httpx.Client, url: str) -> Scrape:
    try:
        response = client.get(url)
        response.raise_for_status()
        return Scrape.parse(response.text, time.monotonic())
    except httpx.HTTPStatusError as e:
        raise Unreachable(f"pdserve top: {url} answered {e.response.status_code}") from None
    except httpx.HTTPError as e:
        raise Unreachable(f"pdserve top: cannot reach the router at {url}: {e or type(e).__name__}") from None
    except ValueError as e:  # answered, but not with Prometheus's text format
        raise Unreachable(f"pdserve top: {url} is not a router's /metrics ({e})") from None


def watch(client: httpx.Client, router: str, interval: float, once: bool) -> int:
    url = router.rstrip("/") + "/metrics"
    clear = CLEAR if sys.stdout.isatty() else ""
    before: Scrape | None = None
    while True:
        try:
            after = poll(client, url)
        except Unreachable as e:
            print(e, file=sys.stderr, flush=True)
            if once:
                return 1
            before = None  # rates start again from the next answer
        else:
            if before is not None:
                sys.stdout.write(clear + render(before, after, router) + ("" if clear else "\n"))
                sys.stdout.flush()
                if once:
                    return 0
            before = after
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve top", description="A running cluster in a terminal, from its "
                                     "router's /metrics: rates, latency percentiles, SLA, indicators, workers.")
    parser.add_argument("--router", default=DEFAULT_ROUTER, metavar="URL", help=f"default: {DEFAULT_ROUTER}")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between polls; rates and percentiles cover the last one (default: 2)")
    parser.add_argument("--once", action="store_true", help="print one view (two polls --interval apart) and exit; "
                        "exit 1 if the router does not answer")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be above 0")
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        try:
            return watch(client, args.router, args.interval, args.once)
        except KeyboardInterrupt:
            return 0
