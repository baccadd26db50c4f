"""The operating indicators the design articles alert on, as Prometheus gauges computed when
scraped: over the requests that finished in the last `window_s` seconds, and the workers' last
heartbeats.

- `pdserve_sla_attainment{metric="ttft"|"tpot"|"both"}`: the share of those requests within the
  TTFT target, the TPOT target, and both (1 when none finished: nothing missed).
- `pdserve_kv_transfer_ttft_share`: of the requests whose prompt was prefilled remotely, the time
  their KV transfer added (what prefill compute did not hide) over their time to first token,
  summed (the articles alert above 0.2).
- `pdserve_decode_waiting_share`: of the requests decode (and colocated) workers hold, the share
  waiting: queued, or for their prompt's KV (the articles alert above 0.15).
- `pdserve_pool_utilization{role}` and `pdserve_pool_utilization_spread`: each pool's mean KV use,
  and how far the prefill and decode pools' are apart (0 while either pool is empty).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Gauge

WINDOW_S = 300.0
MAX_KEPT = 100_000  # finished requests held for the window, at most


class Indicators:
    def __init__(self, registry: CollectorRegistry, ttft_slo_s: float, tpot_slo_s: float,
                 window_s: float = WINDOW_S) -> None:
        self.ttft_slo_s, self.tpot_slo_s, self.window_s = ttft_slo_s, tpot_slo_s, window_s
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, float, float, float | None]] = deque(maxlen=MAX_KEPT)
        attainment = Gauge("pdserve_sla_attainment", f"share of the requests finished in the last {window_s:.0f} s "
                           "within the TTFT target, the TPOT target, or both", ["metric"], registry=registry)
        for metric in ("ttft", "tpot", "both"):
            attainment.labels(metric).set_function(lambda metric=metric: self.attainment(metric))
        Gauge("pdserve_kv_transfer_ttft_share", "of remotely prefilled requests finished in the window, the KV "
              "transfer time their prefill did not hide over their time to first token", registry=registry
              ).set_function(self.transfer_share)
        self.decode_waiting = Gauge("pdserve_decode_waiting_share", "of the requests decode and colocated workers "
                                    "hold, the share waiting (queued, or for their prompt's KV)", registry=registry)
        self.pool_utilization = Gauge("pdserve_pool_utilization", "mean KV use of a pool's workers", ["role"],
                                      registry=registry)
        self.pool_spread = Gauge("pdserve_pool_utilization_spread", "how far the prefill and decode pools' mean "
                                 "KV use are apart (0 while either pool is empty)", registry=registry)

    def finished(self, ttft_s: float, tpot_s: float, transfer_s: float | None) -> None:
        """A request that ended well: its TTFT, TPOT (0 for one token) and, where its prompt was
        prefilled remotely, the KV transfer time its decode worker reported."""
        with self._lock:
            self._recent.append((time.monotonic(), ttft_s, tpot_s, transfer_s))

    def _window(self) -> list[tuple[float, float, float, float | None]]:
        cutoff = time.monotonic() - self.window_s
        with self._lock:
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            return list(self._recent)

    def attainment(self, metric: str) -> float:
        recent = self._window()
        if not recent:
            return 1.0
        ttft_ok = [ttft <= self.ttft_slo_s for _, ttft, _, _ in recent]
        tpot_ok = [tpot <= self.tpot_slo_s for _, _, tpot, _ in recent]
        met = {"ttft": ttft_ok, "tpot": tpot_ok, "both": [a and b for a, b in zip(ttft_ok, tpot_ok)]}[metric]
        return sum(met) / len(met)

    def transfer_share(self) -> float:
        remote = [(ttft, transfer) for _, ttft, _, transfer in self._window() if transfer is not None]
        total = sum(ttft for ttft, _ in remote)
        return sum(transfer for _, transfer in remote) / total if total > 0 else 0.0

    def workers(self, workers) -> None:
        """Set the pools' gauges from the workers' last heartbeats (at scrape time)."""
        held = waiting = 0
        for w in workers:
            if w.role in ("decode", "both"):
                load = w.load
                waiting += load.waiting + load.waiting_for_kv
                held += load.running + load.waiting + load.waiting_for_kv
        self.decode_waiting.set(waiting / held if held else 0.0)
        means = {}
        for role in ("prefill", "decode", "both"):
            usage = [w.load.kv_usage for w in workers if w.role == role]
            means[role] = sum(usage) / len(usage) if usage else None
            self.pool_utilization.labels(role).set(means[role] or 0.0)
        both = means["prefill"] is not None and means["decode"] is not None
        self.pool_spread.set(abs(means["prefill"] - means["decode"]) if both else 0.0)
