"""The serving benchmark's arithmetic and workloads, on synthetic timestamps and seeds."""

import math
import random

import pytest

from pdserve.workload.loadgen import LengthDist, WorkloadSpec, arrival_times, build_requests
from pdserve.workload.metrics import RequestRecord, distribution, summarize


def record(start, first, end, tokens, chunks=None, error=None):
    return RequestRecord(start=start, prompt_tokens=10, first_token=first, end=end, output_tokens=tokens,
                         chunk_times=chunks if chunks is not None else [], error=error)


def test_percentiles_interpolate_and_report_milliseconds():
    d = distribution([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5) and d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token_and_itl_takes_every_gap():
    r = record(0.0, 0.5, 1.4, 10, chunks=[0.5, 0.6, 0.8, 1.4])
    assert r.ttft == 0.5 and r.e2e == 1.4
    assert r.tpot == pytest.approx(0.1)  # (1.4 - 0.5) / (10 - 1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.6])
    assert record(0.0, 0.5, 0.5, 1).tpot is None  # one token: no TPOT


def test_goodput_and_attainment():
    records = [
        record(0.0, 0.2, 1.0, 5),  # ttft 200 ms, tpot 200 ms: misses TPOT (100 ms)
        record(1.0, 1.1, 1.5, 5),  # ttft 100, tpot 100: meets both
        record(2.0, 2.5, 2.5, 1),  # ttft 500: meets (no TPOT)
        record(3.0, 4.0, 4.0, 1),  # ttft 1000: misses TTFT (600 ms)
        record(3.5, None, None, 0, error="HTTP 429"),
    ]
    s = summarize(records, ttft_slo_s=0.6, tpot_slo_s=0.1)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["sla_attainment_pct"] == pytest.approx(40.0)  # failures count as misses
    assert s["request_throughput"] == pytest.approx(1.0) and s["output_throughput"] == pytest.approx(3.0)
    assert s["tpot"]["mean"] == pytest.approx(150.0)  # only requests with 2+ tokens
    assert s["errors"] == {"HTTP 429": 1}
    assert s["ttft"]["p50"] == pytest.approx(350.0)


def test_length_distributions():
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128
    u = LengthDist.parse("10-20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    n = LengthDist.parse("12000+-3000")
    values = [n.sample(rng) for _ in range(4000)]
    assert abs(sum(values) / len(values) - 12000) < 200 and min(values) >= 1
    assert LengthDist.parse("300±100") == LengthDist("normal", 300, 100)
    for bad in ("", "abc", "0", "20-10", "-5"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_workloads_are_seeded_and_share_prefixes_and_turns():
    spec = WorkloadSpec(12, LengthDist.parse("5-9"), LengthDist.parse("3"), seed=4, vocab_size=100,
                        shared_prefix_len=16, num_prefixes=2, turns=3, think_time=1.5)
    a, b = build_requests(spec), build_requests(spec)
    assert [r.think_s for r in a[:3]] == [0.0, 1.5, 1.5]  # the user thinks before each later turn
    assert [r.prompt for r in a] == [r.prompt for r in b]  # the seed decides everything
    assert len({tuple(r.prompt[:16]) for r in a}) <= 2  # one of two shared prefixes
    for prev, nxt in zip(a, a[1:]):
        if nxt.turn:  # a session's next turn extends the previous prompt and its (stand-in) reply
            assert nxt.session == prev.session and nxt.prompt[: len(prev.prompt)] == prev.prompt
            assert len(nxt.prompt) >= len(prev.prompt) + 3 + 5
    assert all(10 <= t < 100 for r in a for t in r.prompt)


def test_later_turns_have_a_ttft_of_their_own():
    records = [RequestRecord(start=0.0, first_token=ttft, end=1.0, output_tokens=1, turn=turn)
               for ttft, turn in ((0.8, 0), (0.1, 1), (0.3, 2))]
    summary = summarize(records, ttft_slo_s=1.0, tpot_slo_s=1.0)
    assert summary["ttft_later_turns"]["mean"] == pytest.approx(200.0)
    assert summary["ttft"]["mean"] == pytest.approx(400.0)
    assert summarize(records[:1], 1.0, 1.0)["ttft_later_turns"]["mean"] is None


def test_arrivals():
    assert arrival_times(5, math.inf) == [0.0] * 5
    t = arrival_times(4000, rate=4.0, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02
    bursty = arrival_times(4000, rate=4.0, burstiness=0.25, seed=1)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    var = lambda g: sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)  # noqa: E731
    assert var(bgaps) > 2 * var(gaps)  # same mean rate, burstier
    with pytest.raises(ValueError):
        arrival_times(3, rate=0.0)
