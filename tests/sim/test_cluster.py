"""The simulator against answers known in closed form, and its bookkeeping (no leaks)."""

from __future__ import annotations

import random

import pytest

from pdserve.workload.loadgen import arrival_times
from pdserve.router import routing
from pdserve.router.policy import DisaggregationPolicy
from pdserve.sim import cluster as sim_cluster
from pdserve.sim.cluster import SimCluster
from pdserve.sim.perf import LinearPerfModel

PREFILL = LinearPerfModel(base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.020,
                          kv_bytes_per_token=1000, link_bytes_per_s=1e6, link_latency_s=0.005)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def check_idle(cluster: SimCluster) -> None:
    for w in cluster.prefills + cluster.decodes:
        blocks = w.scheduler.blocks
        assert not w.scheduler.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks, w.name
        assert not w.routed, w.name


def test_a_lone_colocated_request():
    c = SimCluster(PREFILL, PREFILL, num_colocated=1)
    c.submit(0.0, prompt(300), max_tokens=10)
    (r,) = c.run()
    assert r.ttft == pytest.approx(0.010 + 300 * 0.001)  # one step computes the prompt
    assert r.e2e == pytest.approx(r.ttft + 9 * (0.010 + 0.020))  # then nine decode steps
    assert r.output_tokens == 10 and len(r.chunk_times) == 10
    check_idle(c)


def test_a_lone_disaggregated_request_is_prefill_plus_transfer_plus_steps():
    c = SimCluster(PREFILL, PREFILL, num_prefill=1, num_decode=1, policy=DisaggregationPolicy(min_remote_tokens=16))
    c.submit(0.0, prompt(300), max_tokens=10)
    (r,) = c.run()
    prefill = 0.010 + 300 * 0.001
    transfer = 0.005 + 300 * 1000 / 1e6
    assert r.ttft == pytest.approx(prefill + transfer)
    assert r.e2e == pytest.approx(prefill + transfer + 9 * (0.010 + 0.020))
    assert c.prefills[0].num_steps == 1
    check_idle(c)


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    c = SimCluster(PREFILL, PREFILL, num_colocated=1, worker_args={"max_num_batched_tokens": 128})
    c.submit(0.0, prompt(300), max_tokens=1)
    (r,) = c.run()
    assert r.ttft == pytest.approx(3 * 0.010 + 300 * 0.001)  # chunks of 128, 128, 44
    check_idle(c)


def test_md1_queue_mean_wait():
    """One server, one request at a time, deterministic service D, Poisson arrivals at rate λ:
    the mean wait in the queue is λD² / (2(1 - λD)) (Pollaczek-Khinchine)."""
    service = 0.010 + 100 * 0.001  # a 100-token prompt, one output token: one step
    model = LinearPerfModel(base_s=0.010, prefill_token_s=0.001)
    c = SimCluster(model, model, num_colocated=1, worker_args={"max_num_seqs": 1})
    rate = 0.6 / service
    rng = random.Random(5)
    for t in arrival_times(20000, rate, seed=3):  # fresh prompts: no prefix-cache hit shortens a service
        c.submit(t, [rng.randrange(10, 1000) for _ in range(100)], max_tokens=1)
    records = c.run()
    waits = [r.ttft - service for r in records]
    expected = rate * service**2 / (2 * (1 - rate * service))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.06)
    check_idle(c)


def test_a_loaded_cluster_finishes_everything_and_reports_bench_metrics():
    from pdserve.workload.metrics import summarize

    c = SimCluster(PREFILL, PREFILL, num_prefill=1, num_decode=2, worker_args={"num_blocks": 256},
                   policy=DisaggregationPolicy(min_remote_tokens=64))
    rng = random.Random(1)
    for t in arrival_times(300, rate=3.0, seed=2):
        c.submit(t, prompt(rng.randint(16, 600), seed=rng.randrange(1 << 30)), max_tokens=rng.randint(1, 40))
    records = c.run()
    summary = summarize(records, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert summary["completed"] == 300 and summary["failed"] == 0
    # no prompt (16+ tokens) is prefilled in less than 10 ms + 16 x 1 ms; a decode step is at least 30 ms
    assert summary["ttft"]["p50"] >= 26.0 and summary["tpot"]["p50"] >= 30.0
    assert c.prefills[0].num_steps > 0 and all(d.num_steps > 0 for d in c.decodes)
    check_idle(c)


def decisions_of(monkeypatch) -> list[routing.RoutingDecision]:
    """The routing decisions the simulator makes, in order."""
    made = []

    def spy(*args, **kwargs):
        made.append(routing.route(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(sim_cluster, "route", spy)
    return made


def test_a_burst_spreads_over_prefill_workers_before_they_hold_it(monkeypatch):
    """A prompt routed to a prefill worker reaches its scheduler only once the decode worker has
    reserved blocks for it: meanwhile the simulator counts it, as the router counts what it sent
    since a worker's last heartbeat."""
    made = decisions_of(monkeypatch)
    c = SimCluster(PREFILL, PREFILL, num_prefill=2, num_decode=1, policy=DisaggregationPolicy(min_remote_tokens=16))
    c.submit(0.0, prompt(8), max_tokens=20)  # short: the decode worker computes it, and is busy stepping
    for i in range(6):  # these wait for its step to end before it reserves their blocks
        c.submit(0.005, prompt(300, seed=i), max_tokens=2)
    c.run()
    assert [d.prefill_id for d in made] == [None] + ["prefill0", "prefill1"] * 3
    check_idle(c)


def test_prefix_aware_prefill_choice_at_the_workers_block_size(monkeypatch):
    made = decisions_of(monkeypatch)
    c = SimCluster(PREFILL, PREFILL, num_prefill=2, num_decode=1, worker_args={"block_size": 8},
                   policy=DisaggregationPolicy(min_remote_tokens=16))
    a, b, turn = prompt(300, seed=1), prompt(300, seed=2), prompt(100, seed=3)
    c.submit(0.0, a, max_tokens=2)
    c.submit(0.0, b, max_tokens=2)
    c.submit(10.0, b + turn, max_tokens=2)  # each next turn goes where its prefix is (b's first:
    c.submit(11.0, a + turn, max_tokens=2)  # the worker a tie would go to does not hold it)
    c.run()
    assert [d.prefill_id for d in made] == ["prefill0", "prefill1", "prefill1", "prefill0"]
    assert made[2].prefill_uncached == 400 - 296  # 37 blocks of 8 cached
    assert {r.block_size for d in made for r in d.records} == {8}
    check_idle(c)
