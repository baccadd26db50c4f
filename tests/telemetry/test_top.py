"""`pdserve top`: the view of two real scrapes of the router's /metrics, and the command against a
router on 127.0.0.1 and against a port where none listens."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.telemetry.top import Scrape, buckets, quantile, render
from tests.telemetry.scrapes import exposition, finish_request, worker_entry


def top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "top", *args], capture_output=True, text=True,
                          timeout=60)


def scrapes(*, decode_waiting: int, transfer_s: float) -> tuple[Scrape, Scrape]:
    """Two scrapes 10 s apart of one router: before them a slow request; between them five ok
    requests with TTFT 60 ms (the 50-100 ms bucket), each prefilled remotely with its KV transfer
    taking `transfer_s`, one error, and 50 MB of KV landing on the decode worker."""
    metrics = RouterMetrics(ttft_slo_s=2.0, tpot_slo_s=0.1)
    finish_request(metrics, ttft_s=3.0)  # before the first scrape: in no rate or percentile

    def pool(kv_bytes: int) -> list:
        return [worker_entry("prefill-0", "prefill", running=2, kv_blocks_used=10, kv_blocks_total=100),
                worker_entry("decode-0", "decode", running=6, waiting=decode_waiting, waiting_for_kv=decode_waiting,
                             kv_blocks_used=90, kv_blocks_total=100, step_latency_ewma_ms=12.5,
                             kv_bytes_received=kv_bytes)]

    before = Scrape.parse(exposition(metrics, pool(0)), at=100.0)
    for _ in range(5):
        finish_request(metrics, ttft_s=0.06, tokens=4, transfer_s=transfer_s)
    finish_request(metrics, ttft_s=0.06, outcome="error")
    after = Scrape.parse(exposition(metrics, pool(50_000_000), queued_requests=2), at=110.0)
    return before, after


def number(pattern: str, view: str) -> float:
    found = re.search(pattern, view)
    assert found, f"{pattern!r} not in\n{view}"
    return float(found.group(1))


def test_the_view_of_an_interval():
    before, after = scrapes(decode_waiting=1, transfer_s=0.005)
    view = render(before, after, "http://127.0.0.1:8000")
    assert view.startswith("pdserve top  http://127.0.0.1:8000  over the last 10.0 s")
    assert number(r"requests ([\d.]+)/s", view) == 0.6  # 5 ok and 1 error in 10 s
    assert number(r"tokens out ([\d.]+)/s", view) == 2.0  # 4 tokens each of the 5 ok
    assert number(r"errors ([\d.]+)%", view) == 16.7
    assert number(r"goodput ([\d.]+) req/s", view) == 0.5  # the 5 ok ones met both targets
    assert number(r"KV in ([\d.]+) MB/s", view) == 5.0
    # all six first tokens in the 50-100 ms bucket, interpolated as Prometheus does (the slow request
    # before the interval is not in it)
    assert number(r"TTFT p50 ([\d.]+) ms", view) == 75.0 and number(r"TTFT p50 \S+ ms  p95 ([\d.]+) ms", view) == 97.5
    assert number(r"TPOT p50 \S+ ms  p95 ([\d.]+) ms", view) < 100  # observed (the real clock's value)
    assert number(r"router queue (\d+) requests", view) == 2
    assert "prefill 1  decode 1  both 0" in view
    rows = {line.split()[0]: line.split() for line in view.splitlines() if line.startswith(("prefill-0", "decode-0"))}
    assert rows["decode-0"] == ["decode-0", "decode", "6", "1", "1", "90.0%", "12.5", "0.0", "s"]
    assert rows["prefill-0"][:6] == ["prefill-0", "prefill", "2", "0", "0", "10.0%"]


def test_alert_beside_an_indicator_past_its_level_only():
    # decode holds 6 running, 1 queued, 1 waiting for KV: 25% waiting, past 15%; transfer 5 of 60 ms
    view = render(*scrapes(decode_waiting=1, transfer_s=0.005))
    lines = {line[:32].strip(): line for line in view.splitlines()}
    assert lines["decode waiting share"].endswith("ALERT") and "25.0%" in lines["decode waiting share"]
    assert "ALERT" not in lines["KV transfer share of TTFT"]
    # nobody waits; transfer 35 of 60 ms: over half the first token's time, past 20%
    view = render(*scrapes(decode_waiting=0, transfer_s=0.035))
    lines = {line[:32].strip(): line for line in view.splitlines()}
    assert "ALERT" not in lines["decode waiting share"]
    assert lines["KV transfer share of TTFT"].endswith("ALERT")
    assert view.count("ALERT") == 1


def test_percentiles_as_prometheus_interpolates():
    counts = [(0.1, 0.0), (0.2, 4.0), (float("inf"), 4.0)]
    assert quantile(0.5, counts) == pytest.approx(0.15) and quantile(1.0, counts) == 0.2
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 2.0)]) == 0.1  # in +Inf: the highest finite bound
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    before, after = scrapes(decode_waiting=0, transfer_s=0.0)
    assert buckets(before, after, "pdserve_ttft_seconds")[-1][1] == 6
    # fewer in the second scrape than in the first: a restarted router, whose counts are all new
    assert buckets(after, before, "pdserve_ttft_seconds")[-1][1] == 1


def test_top_once_against_a_router(tiny_llama):
    from tests.router_server import RouterServer  # here: the tests above start no server

    with RouterServer(tiny_llama) as rs:
        out = top("--once", "--interval", "0.2", "--router", rs.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"pdserve top  {rs.url}  over the last ")
    assert "requests 0.00/s" in out.stdout and "no workers registered" in out.stdout
    assert "\x1b[" not in out.stdout  # not a terminal: no screen clearing


def test_top_once_without_a_router():
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = top("--once", "--interval", "0.1", "--router", f"http://127.0.0.1:{port}")
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdserve top: cannot reach the router at http://127.0.0.1:{port}"
                                                   "/metrics: "), out.stderr
