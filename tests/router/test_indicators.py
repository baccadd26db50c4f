"""The operating indicators the design articles alert on, as a scrape of the router shows them:
SLA attainment over a window, the share of TTFT that KV transfer took, the decode pools' waiting
share, and the pools' utilisation spread."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.router.indicators import Indicators
from pdserve.router.metrics import RequestClock, RouterMetrics


def sample(registry, name: str, labels: str = "") -> float:
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith((f"{name}{labels} ", f"{name}{labels}{{")))
    return float(line.rsplit(" ", 1)[1])


def worker(role: str, running=0, waiting=0, waiting_for_kv=0, kv_usage=0.0):
    return SimpleNamespace(role=role, load=SimpleNamespace(running=running, waiting=waiting,
                                                           waiting_for_kv=waiting_for_kv, kv_usage=kv_usage))


def test_attainment_and_transfer_share_over_the_window(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("pdserve.router.indicators.time.monotonic", lambda: now[0])
    r = CollectorRegistry()
    ind = Indicators(r, ttft_slo_s=1.0, tpot_slo_s=0.05, window_s=60)
    assert sample(r, "pdserve_sla_attainment", '{metric="both"}') == 1.0  # nothing finished: nothing missed
    ind.finished(0.5, 0.01, transfer_s=0.1)  # meets both; remote, transfer 20% of its TTFT
    ind.finished(2.0, 0.01, transfer_s=0.9)  # misses TTFT
    ind.finished(0.4, 0.2, transfer_s=None)  # misses TPOT; prefilled where it decoded
    assert sample(r, "pdserve_sla_attainment", '{metric="ttft"}') == 2 / 3
    assert sample(r, "pdserve_sla_attainment", '{metric="tpot"}') == 2 / 3
    assert sample(r, "pdserve_sla_attainment", '{metric="both"}') == 1 / 3
    assert abs(sample(r, "pdserve_kv_transfer_ttft_share") - 1.0 / 2.5) < 1e-9
    now[0] += 61  # all out of the window
    assert sample(r, "pdserve_sla_attainment", '{metric="both"}') == 1.0
    assert sample(r, "pdserve_kv_transfer_ttft_share") == 0.0


def test_decode_waiting_share_and_pool_spread_from_heartbeats():
    r = CollectorRegistry()
    ind = Indicators(r, 1.0, 0.05)
    ind.workers([worker("prefill", running=4, waiting=9, kv_usage=0.2),  # a prefill queue is not decode's
                 worker("decode", running=6, waiting=1, waiting_for_kv=1, kv_usage=0.9),
                 worker("decode", running=2, kv_usage=0.7)])
    assert sample(r, "pdserve_decode_waiting_share") == 2 / 10
    assert abs(sample(r, "pdserve_pool_utilization", '{role="decode"}') - 0.8) < 1e-9
    assert abs(sample(r, "pdserve_pool_utilization_spread") - 0.6) < 1e-9
    ind.workers([worker("both", running=3, kv_usage=0.5)])  # one pool: no spread, nobody waiting
    assert sample(r, "pdserve_pool_utilization_spread") == 0.0 and sample(r, "pdserve_decode_waiting_share") == 0.0


def test_a_finished_request_reaches_the_indicators():
    m = RouterMetrics(ttft_slo_s=10.0, tpot_slo_s=10.0)
    clock = RequestClock(m, prompt_tokens=5, remote=True)
    clock.output_line(1, None)
    clock.output_line(2, {"queue_s": 0.0, "prefill_s": 0.01, "transfer_s": 0.0, "decode_s": 0.01})
    clock.finish("ok")
    assert sample(m.registry, "pdserve_sla_attainment", '{metric="both"}') == 1.0
    assert m.indicators.transfer_share() == 0.0 and len(m.indicators._window()) == 1
    RequestClock(m, prompt_tokens=5).finish("error")  # a failed request is an error, not an SLA sample
    assert len(m.indicators._window()) == 1
