"""A worker's stats in the Prometheus text format."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_HELP = {
    "running": "requests in the running batch",
    "waiting": "requests waiting for admission",
    "waiting_for_kv": "requests whose prompt KV is on its way from a prefill worker",
    "queued_prefill_tokens": "prompt tokens not yet computed",
    "kv_blocks_total": "KV cache blocks",
    "kv_blocks_used": "KV cache blocks in use",
    "step_latency_ewma_ms": "moving average of the engine step time",
    "num_preemptions": "requests preempted since start",
    "prefill_pauses": "steps a running prompt sat out, its KV kept, for a more urgent one, since start",
    "drafts": "speculative decoding: drafts verified since start (one a request a step)",
    "draft_tokens": "speculative decoding: tokens proposed and verified since start",
    "draft_tokens_accepted": "speculative decoding: proposed tokens the model kept since start",
    "draft_prompt_tokens": "speculative decoding: prompt tokens a draft model computed here since start",
    "draft_mean_accepted_length": "speculative decoding: tokens a verified draft gives on average "
                                  "(its kept tokens and the model's own next one)",
    "kv_landed": "prompts whose KV arrived from a prefill worker",
    "kv_recomputed": "prompts recomputed here after a failed transfer",
    "kv_stale_writes": "KV writes refused for a stale fence",
    "kv_bytes_received": "KV bytes received",
    "kv_bytes_sent": "KV bytes sent",
    "kv_notified": "prefills handed to decode workers",
    "kv_pool_generation": "durable KV pool: its attaches (1, plus each restart that found it)",
    "kv_resumed_requests": "durable KV pool: requests resumed from the KV they had before a restart",
    "kv_resume_rejected": "durable KV pool: journaled requests whose KV failed its checks, computed again",
    "kv_resume_recomputed_prompt_tokens": "durable KV pool: prompt tokens resumed requests computed again",
    "kv_resumable": "durable KV pool: requests whose kept KV waits for them to come back",
    "kv_store_blocks_written": "KV store tier: blocks sent to the shared store",
    "kv_store_blocks_read": "KV store tier: blocks read back from the shared store",
    "kv_store_blocks_corrupt": "KV store tier: blocks read back that failed their checks (computed again)",
    "kv_store_blocks_dropped": "KV store tier: blocks not sent, too many waiting to be sent already",
    "kv_store_errors": "KV store tier: calls to the store that failed (it is left alone for a few seconds)",
}


class _Snapshot:
    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def collect(self):
        stats = dict(self.stats)
        by_source = CounterMetricFamily("pdserve_prompt_tokens_by_source", "tokens whose KV requests started from, "
                                        "by where it came from: computed here, the prefix cache, the host or disk tier, "
                                        "the shared store, another worker (transferred), or this worker's pool kept "
                                        "through a restart (resumed)", labels=["source"])
        for source, count in stats.pop("tokens_by_source", {}).items():
            by_source.add_metric([source], count)
        yield by_source
        method = stats.pop("speculative", "off")
        drafts = {key: stats.pop(key) for key in _BY_METHOD if key in stats}
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"pdserve_worker_{key}", _HELP.get(key, key.replace("_", " ")), value=value)
        if drafts:  # by the method that proposed them, as vLLM's spec_decode series are
            done = drafts.get("drafts", 0)
            drafts["draft_mean_accepted_length"] = 1 + drafts.get("draft_tokens_accepted", 0) / done if done else 0.0
            for key, value in drafts.items():
                family = GaugeMetricFamily(f"pdserve_worker_{key}", _HELP[key], labels=["method"])
                family.add_metric([method], value)
                yield family


_BY_METHOD = ("drafts", "draft_tokens", "draft_tokens_accepted", "draft_prompt_tokens")


def render_metrics(stats: dict) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats))
    return generate_latest(registry).decode()
