"""Decode steps that repeat unchanged, taken as one event (SimWorker._repeats), give exactly the
records step-by-step simulation gives: every token's time, first tokens, ends, preemptions and
the controller's moves, in colocated and disaggregated clusters, with KV to spare and without."""

from __future__ import annotations

import pytest

from pdserve.workload.loadgen import LengthDist, WorkloadSpec, build_requests
from pdserve.router.policy import DisaggregationPolicy
from pdserve.router.rebalance import RebalancePolicy
from pdserve.sim.cluster import SimCluster, SimWorker
from pdserve.sim.perf import LinearPerfModel
from pdserve.sim.simulate import simulate_point

PERF = LinearPerfModel(base_s=0.004, prefill_token_s=2e-5, prefill_attention_s=1e-9, decode_seq_s=3e-4,
                       decode_context_s=2e-7, kv_bytes_per_token=1 << 14, link_bytes_per_s=5e9, link_latency_s=1e-4)
SLOW_PREFILL = LinearPerfModel(base_s=0.004, prefill_token_s=2e-4, decode_seq_s=3e-4, decode_context_s=2e-7)

SCENARIOS = {
    "colocated": lambda repeat: SimCluster(PERF, PERF, num_colocated=2, prefix_caching=False, repeat_steps=repeat),
    "disaggregated": lambda repeat: SimCluster(PERF, PERF, 2, 2, prefix_caching=False, repeat_steps=repeat,
                                               policy=DisaggregationPolicy(min_remote_tokens=32)),
    "preempting": lambda repeat: SimCluster(PERF, PERF, num_colocated=1, prefix_caching=False, repeat_steps=repeat,
                                            worker_args={"num_blocks": 60, "max_num_seqs": 16}),
    "rebalancing": lambda repeat: SimCluster(SLOW_PREFILL, PERF, 1, 3, prefix_caching=False, repeat_steps=repeat,
                                             policy=DisaggregationPolicy(min_remote_tokens=32),
                                             rebalance=RebalancePolicy(ttft_target_s=0.2, tpot_target_s=0.05,
                                                                       confirm_s=1, dwell_s=2)),
}


def records(make, rate: float, concurrency=None):
    spec = WorkloadSpec(num_requests=120, input_len=LengthDist.parse("20-300"), output_len=LengthDist.parse("1-90"),
                        vocab_size=1000, seed=3)
    cluster = []
    out = simulate_point(lambda: cluster.append(make()) or cluster[0], build_requests(spec), rate, concurrency, 1.0, 3)
    return out, cluster[0]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("rate", [5.0, 40.0])
def test_repeated_steps_change_nothing(name, rate, monkeypatch):
    each, c1 = records(lambda: SCENARIOS[name](False), rate)
    repeated = []
    apply = SimWorker._apply_repeats
    monkeypatch.setattr(SimWorker, "_apply_repeats", lambda self, out, d, start: repeated.append(len(d)) or
                        apply(self, out, d, start))
    once, c2 = records(lambda: SCENARIOS[name](True), rate)
    assert sum(repeated) > (100 if rate < 10 else 0)  # steps taken together, not one by one
    assert [(r.start, r.first_token, r.end, r.output_tokens, r.chunk_times) for r in each] == \
        [(r.start, r.first_token, r.end, r.output_tokens, r.chunk_times) for r in once]
    assert c1.moves == c2.moves
    workers = lambda c: [(w.name, w.scheduler.num_preemptions, w.num_steps, w.busy_s) for w in c.prefills + c.decodes]  # noqa: E731
    assert workers(c1) == workers(c2)
    if name == "preempting":
        assert sum(w.scheduler.num_preemptions for w in c1.decodes) > 0  # the case it names happened
