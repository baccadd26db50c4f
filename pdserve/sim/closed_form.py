"""Closed-form estimates of one instance's capacity within an SLA, to start the simulated search
near its answer (plan.py). They are estimates, not answers: the simulation decides.

- A prefill instance is a queue of prompts served one at a time, each taking the steps its chunks
  take (S seconds), with Poisson arrivals: an M/D/1 queue. Its first-token time is S, the KV
  transfer's exposed time, and the wait, whose distribution is Erlang's:
  P(W <= t) = (1 - rho) * sum_{k=0}^{floor(t/S)} (lam (kS - t))^k / k! * exp(-lam (kS - t)).
  The estimate is the highest rate at which that percentile stays within the TTFT bound.
- A decode instance beside a free prefill runs every request it holds in each step, so by Little's
  law it holds rate * OSL * step time of them; the estimate is the highest rate whose batch still
  steps within the TPOT bound, within the batch limit and the KV the instance holds.
"""

from __future__ import annotations

import math

from pdserve.sim.perf import LinearPerfModel, StepShape


def prefill_seconds(perf: LinearPerfModel, isl: int, chunk_tokens: int) -> float:
    """A prompt alone, chunk by chunk, each chunk attending to the prompt before it and itself."""
    total, done = 0.0, 0
    while done < isl:
        n = min(chunk_tokens, isl - done)
        total += perf.step_time(StepShape(prefill_tokens=n, prefill_context=done + n // 2))
        done += n
    return total


def md1_wait_cdf(t: float, rate: float, service_s: float) -> float:
    """P(wait <= t) in an M/D/1 queue (Erlang's formula)."""
    rho = rate * service_s
    if rho >= 1:
        return 0.0
    return (1 - rho) * sum((rate * (k * service_s - t)) ** k / math.factorial(k) * math.exp(-rate * (k * service_s - t))
                           for k in range(int(t // service_s) + 1))


def prefill_rate(perf: LinearPerfModel, isl: int, chunk_tokens: int, ttft_s: float, percentile: float) -> float:
    service = prefill_seconds(perf, isl, chunk_tokens)
    slack = ttft_s - service - perf.transfer_time(isl)
    if slack < 0 or service <= 0:
        return 0.0
    if slack > 15 * service:  # the series cancels badly in floats past this; the queue barely matters here
        return 0.95 / service
    lo, hi = 0.0, 1.0 / service
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if md1_wait_cdf(slack, mid, service) >= percentile / 100 else (lo, mid)
    return lo


def decode_rate(perf: LinearPerfModel, isl: int, osl: int, tpot_s: float, batch: int, kv_tokens: int) -> float:
    most = min(batch, kv_tokens // max(1, isl + osl))
    best = 0.0
    for b in range(1, most + 1):
        step = perf.step_time(StepShape(decode_seqs=b, decode_context=b * (isl + osl // 2)))
        if step > tpot_s:
            break
        best = b / (osl * step) if step > 0 else math.inf
    return best
