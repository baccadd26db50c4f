"""The serving benchmark's arithmetic: per-request records in, the summary `pdserve bench` reports out.

Definitions (all times in milliseconds in the summary):
- TTFT: from sending the request to the first chunk that carries output.
- TPOT: (end - first token) / (output tokens - 1), per request; the first token is not counted, and
  a request with a single output token has no TPOT.
- ITL: every gap between consecutive chunks that carry output, over all requests.
- E2E: from sending to the last byte.
- Goodput: completed requests per second that met both the TTFT and the TPOT target (one without a
  TPOT meets that target); SLA attainment: their share of all requests sent, failures included.
- Throughputs are over the run's duration: first send to last end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    start: float  # seconds, one clock for the whole run
    prompt_tokens: int = 0
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks that carried output
    error: str | None = None
    turn: int = 0  # of its session (0: the first, or no session)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """mean and percentiles in milliseconds (linear interpolation between ranks); None when empty."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def meets_slo(r: RequestRecord, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    tpot = r.tpot
    return r.ok and r.ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s)


def summarize(records: list[RequestRecord], ttft_slo_s: float, tpot_slo_s: float) -> dict:
    done = [r for r in records if r.ok]
    if records:
        begin = min(r.start for r in records)
        end = max((r.end for r in records if r.end is not None), default=begin)
        duration = max(end - begin, 1e-9)
    else:
        duration = 1e-9
    met = sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in records)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "incomplete"] = errors.get(r.error or "incomplete", 0) + 1
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "ttft": distribution([r.ttft for r in done]),
        # a session's later turns: their prefix was computed before, wherever its KV is now
        "ttft_later_turns": distribution([r.ttft for r in done if r.turn > 0]),
        "tpot": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl": distribution([gap for r in done for gap in r.itls]),
        "e2e": distribution([r.e2e for r in done]),
        "request_throughput": len(done) / duration,
        "input_throughput": sum(r.prompt_tokens for r in done) / duration,
        "output_throughput": sum(r.output_tokens for r in done) / duration,
        "goodput": met / duration,
        "sla_attainment_pct": 100.0 * met / len(records) if records else 0.0,
        "slo_ms": {"ttft": ttft_slo_s * 1e3, "tpot": tpot_slo_s * 1e3},
        "errors": errors,
    }
