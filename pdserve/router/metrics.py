"""The router's Prometheus metrics: latency histograms per request, queue depth, workers, tokens,
KV bytes moved (from the workers' heartbeats), SLA attainment against configured targets, and the
indicators the design articles alert on (`indicators.py`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.router.indicators import Indicators
from pdserve.router.rebalance import RecentTTFT
from pdserve.router.request_trace import RequestTrace
from pdserve.router.rollout import STATES, Rollout
from pdserve.router.shadow import ShadowCopy

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_WORKER_GAUGES = {
    "kv_blocks_used": "KV blocks in use on the worker",
    "kv_blocks_total": "KV blocks of the worker",
    "kv_usage": "fraction of the worker's KV blocks in use",
    "running": "requests in the worker's running batch",
    "waiting": "requests queued on the worker",
    "waiting_for_kv": "requests on the worker waiting for their prompt's KV",
    "step_latency_ewma_ms": "moving average of the worker's step time",
    "heartbeat_age_seconds": "time since the worker's last heartbeat",
    "uptime_seconds": "time since the worker process started (its last heartbeat's)",
    "kv_landed": "prompts whose KV arrived from a prefill worker, since the worker started",
    "kv_recomputed": "prompts the worker computed again after their KV transfer failed, since it started",
}
# speculative decoding, per worker that speculates (from its heartbeats), by the method it drafts with
_DRAFT_GAUGES = {
    "draft_tokens": "draft tokens the worker verified since it started",
    "draft_tokens_accepted": "draft tokens the worker's model kept since it started",
    "draft_prompt_tokens": "prompt tokens the worker's draft model computed since it started (a decode "
                           "worker's stays 0 where its prefill workers ship the draft's KV)",
}
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.1) -> None:
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("pdserve_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "time per output token after the first", buckets=_TOKEN_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "gap between streamed chunks", buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "request latency, end to end", buckets=_LATENCY_BUCKETS, registry=r)
        self.phases = Histogram("pdserve_phase_seconds", "time of finished requests per phase: queue (on "
                                "decode and prefill workers), prefill (computing the prompt, wherever), transfer "
                                "(KV hand-off and transfer not hidden behind prefill compute), decode",
                                ["phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdserve_requests", "requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("pdserve_generated_tokens", "tokens generated", registry=r)
        self.disaggregated = Counter("pdserve_disaggregated_requests", "requests sent through a prefill worker",
                                     registry=r)
        self.migrations = Counter("pdserve_migrations", "running requests moved to another decode worker, by "
                                  "reason: hot_spot (KV use), failure (the worker was lost) or resumed (its restarted self took it back "
                                  "with its KV)", ["reason"], registry=r)
        self.prefix_copies = Counter("pdserve_hot_prefix_copies", "hot prefixes' KV copied to another decode worker, "
                                     "by outcome: copied, failed, or dropped (cooled: routing no longer counts it)",
                                     ["outcome"], registry=r)
        self.prefix_copies_held = Gauge("pdserve_hot_prefix_copies_held", "copies of hot prefixes routing counts now",
                                        registry=r)
        self.sla_met = Counter("pdserve_sla_met_requests", "finished requests meeting both the TTFT and TPOT targets",
                               registry=r)
        self.queue = Gauge("pdserve_queue_requests", "requests the router holds", registry=r)
        self.queue_tokens = Gauge("pdserve_queue_prompt_tokens", "prompt tokens the router holds", registry=r)
        self.workers = Gauge("pdserve_workers", "registered workers", ["role"], registry=r)
        self.kv_bytes = Gauge("pdserve_kv_bytes_received", "KV bytes decode workers received (last heartbeats)",
                              registry=r)
        self.workers_dropped = Counter("pdserve_workers_dropped", "workers taken out of the registry (lease lapsed, "
                                       "or a request failed on them)", registry=r)
        self.worker_rejoins = Counter("pdserve_worker_rejoins", "workers that registered again at an address "
                                      "that registered before (a restart, or a worker dropped and back)", ["role"],
                                      registry=r)
        self.recent_ttft = RecentTTFT()  # what the P:D controller reads (time.perf_counter)
        self.rebalances = Counter("pdserve_rebalances", "workers the P:D controller moved to the other pool, "
                                  "by direction", ["direction"], registry=r)
        self.requeued = Counter("pdserve_requests_requeued", "times a request found every worker's queue full and "
                                "waited in the router to try again", registry=r)
        self.silent_streams = Counter("pdserve_silent_streams", "streams given up on after their worker said nothing "
                                      "for the silence deadline (the worker stays while it heartbeats)", registry=r)
        # One series per registered worker, from its last heartbeat: one scrape of the router shows the pools.
        self.worker_gauges = {
            key: Gauge(f"pdserve_worker_{key}", help_text, ["worker", "role"], registry=r)
            for key, help_text in _WORKER_GAUGES.items()
        }
        self.draft_gauges = {
            key: Gauge(f"pdserve_worker_{key}", help_text, ["worker", "role", "method"], registry=r)
            for key, help_text in _DRAFT_GAUGES.items()
        }
        self.sla_targets = Gauge("pdserve_sla_target_seconds", "SLA targets", ["metric"], registry=r)
        self.sla_targets.labels("ttft").set(ttft_slo_s)
        self.sla_targets.labels("tpot").set(tpot_slo_s)
        self.indicators = Indicators(r, ttft_slo_s, tpot_slo_s)  # the articles' alerting indicators
        self.rollouts = Counter("pdserve_rollouts", "canary rollouts that ended, by how: promoted, rolled_back "
                                "(by itself) or aborted (by hand)", ["outcome"], registry=r)

    def track_leading(self, leading) -> None:
        Gauge("pdserve_router_leading", "1 if this router acts for the cluster (the P:D controller, hot-spot "
              "relief, hot-prefix copies, rollout steps), 0 if another router does", registry=self.registry
              ).set_function(lambda: float(leading()))

    def track_shadow(self, current) -> None:
        """Gauges of the shadow traffic that `current()` returns (None: none runs), read when scraped."""
        r = self.registry

        def value(key: str, pick=lambda shadow, key: shadow.counts[key]) -> float:
            shadow = current()
            got = pick(shadow, key) if shadow is not None else None
            return float("nan") if got is None else float(got)

        counts = Gauge("pdserve_shadow_requests", "shadow traffic since it started: requests mirrored, skipped "
                       "(busy: at its concurrency bound; no_worker), failed on either side, compared",
                       ["outcome"], registry=r)
        for key in ("mirrored", "skipped_busy", "skipped_no_worker", "shadow_failed", "primary_failed", "compared"):
            counts.labels(key).set_function(lambda key=key: value(key))
        Gauge("pdserve_shadow_in_flight", "shadow requests running now", registry=r).set_function(
            lambda: value("", lambda shadow, _: shadow.in_flight))
        Gauge("pdserve_shadow_greedy_agreement", "of greedy requests' tokens, the share the shadow produced alike "
              "from the start (mean over the last comparisons)", registry=r).set_function(
            lambda: value("", lambda shadow, _: shadow.agreement_mean()))
        ratio = Gauge("pdserve_shadow_latency_ratio", "the shadow's median over the primary's, over the last "
                      "comparisons", ["metric"], registry=r)
        for metric in ("ttft_s", "e2e_s"):
            ratio.labels(metric).set_function(lambda metric=metric: value(
                metric, lambda shadow, key: shadow.medians(key).get("ratio")))

    def track_rollout(self, rollout: Rollout) -> None:
        """Gauges of the canary rollout, read when scraped."""
        r = self.registry
        Gauge("pdserve_rollout_canary_share", "share of new requests the canary version gets now",
              registry=r).set_function(lambda: rollout.share)
        state = Gauge("pdserve_rollout_state", "the canary rollout's state (1 for the current one)", ["state"],
                      registry=r)
        for name in STATES:
            state.labels(name).set_function(lambda name=name: float(rollout.state == name))

    def render(self, admission, workers) -> bytes:
        self.queue.set(admission.requests)
        self.queue_tokens.set(admission.tokens)
        for role in ("prefill", "decode", "both"):
            self.workers.labels(role).set(sum(1 for w in workers if w.role == role))
        self.kv_bytes.set(sum(w.stats.kv_bytes_received for w in workers))
        self.indicators.workers(workers)
        for gauge in (*self.worker_gauges.values(), *self.draft_gauges.values()):
            gauge.clear()  # workers that left have no series
        for w in workers:
            load = w.load
            values = {"kv_blocks_used": load.kv_blocks_used, "kv_blocks_total": load.kv_blocks_total,
                      "kv_usage": load.kv_usage, "running": load.running, "waiting": load.waiting,
                      "waiting_for_kv": load.waiting_for_kv, "step_latency_ewma_ms": load.step_latency_ewma_ms,
                      "heartbeat_age_seconds": max(0.0, time.monotonic() - w.last_heartbeat),
                      "uptime_seconds": w.stats.uptime_s, "kv_landed": w.stats.kv_landed,
                      "kv_recomputed": w.stats.kv_recomputed}
            for key, value in values.items():
                self.worker_gauges[key].labels(w.worker_id, w.role).set(value)
            if w.stats.speculative != "off":
                for key, gauge in self.draft_gauges.items():
                    gauge.labels(w.worker_id, w.role, w.stats.speculative).set(getattr(w.stats, key))
        return generate_latest(self.registry)


@dataclass(slots=True)
class RequestClock:
    """One request's timings, observed into the metrics when it ends."""

    metrics: RouterMetrics
    prompt_tokens: int
    remote: bool = False  # first sent through a prefill worker
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    phase_times: dict | None = None  # the decode worker's, from its last output line
    trace: RequestTrace | None = None  # its spans, where the router traces
    rollout: Rollout | None = None  # told whether it met its targets, for the version that served it
    version: str | None = None
    shadow: ShadowCopy | None = None  # its copy on the shadow version, compared when both end
    ended: bool = False

    def output_line(self, num_tokens: int, phase_times: dict | None) -> None:
        self.tokens_arrived(num_tokens)
        if phase_times is not None:
            self.phase_times = phase_times

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            if self.trace is not None:
                self.trace.first_token()
            self.metrics.ttft.observe(now - self.start)
            self.metrics.recent_ttft.add(now, now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += n

    def finish(self, outcome: str) -> None:
        """Observe the request's end (once: a second call, e.g. a response's closing, is a no-op)."""
        if self.ended:
            return
        self.ended = True
        m = self.metrics
        m.requests.labels(outcome).inc()
        end = time.perf_counter()
        if self.trace is not None:
            self.trace.finish(outcome, self.prompt_tokens, self.tokens)
        if self.shadow is not None:
            first = self.first - self.start if self.first is not None else None
            self.shadow.primary_done(outcome == "ok", first, end - self.start, self.phase_times)
        if outcome != "ok" or self.first is None:
            return
        m.e2e.observe(end - self.start)
        m.prompt_tokens.inc(self.prompt_tokens)
        for phase, seconds in (self.phase_times or {}).items():
            m.phases.labels(phase.removesuffix("_s")).observe(seconds)
        m.generated_tokens.inc(self.tokens)
        tpot = (end - self.first) / (self.tokens - 1) if self.tokens > 1 else 0.0
        if self.tokens > 1:
            m.tpot.observe(tpot)
        met = self.first - self.start <= m.ttft_slo_s and tpot <= m.tpot_slo_s
        if met:
            m.sla_met.inc()
        if self.rollout is not None and self.version is not None:
            self.rollout.request_finished(self.version, met)
        transfer = (self.phase_times or {}).get("transfer_s", 0.0) if self.remote else None
        m.indicators.finished(self.first - self.start, tpot, transfer)
