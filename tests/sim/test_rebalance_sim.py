"""The router's P:D controller, run by the simulator on the same rule: a load heavy on prompts moves
decode workers to prefill, one heavy on tokens moves prefill workers to decode, each move only
after the moved worker drained, and the requests end sooner than with the split held fixed."""

from __future__ import annotations

import random
import statistics

from pdserve.router.policy import DisaggregationPolicy
from pdserve.router.rebalance import RebalancePolicy
from pdserve.sim.cluster import SimCluster
from pdserve.sim.perf import LinearPerfModel

PERF = LinearPerfModel(base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.020,
                       kv_bytes_per_token=1000, link_bytes_per_s=1e8, link_latency_s=0.001)
POLICY = RebalancePolicy(ttft_target_s=2.0, tpot_target_s=0.1, confirm_s=2.0, dwell_s=5.0)


def run(p: int, d: int, rebalance: RebalancePolicy | None, prompt_len: int, output_len: int, every_s: float,
        n: int) -> SimCluster:
    c = SimCluster(PERF, PERF, num_prefill=p, num_decode=d, rebalance=rebalance,
                   policy=DisaggregationPolicy(min_remote_tokens=64))
    rng = random.Random(0)
    for i in range(n):
        c.submit(i * every_s, [rng.randrange(10, 1000) for _ in range(prompt_len)], max_tokens=output_len)
    c.records_list = c.run()
    return c


def check_idle(c: SimCluster) -> None:
    for w in c.prefills + c.decodes:
        assert not w.scheduler.has_unfinished() and w.scheduler.blocks.num_free_blocks == w.scheduler.blocks.num_blocks
        assert w.moving_to is None, w.name


def test_a_prompt_heavy_load_takes_decode_workers_into_prefill():
    args = dict(prompt_len=1000, output_len=4, every_s=0.5, n=240)
    fixed, moving = run(1, 3, None, **args), run(1, 3, POLICY, **args)
    assert [role for _, _, role, _ in moving.moves] == ["prefill", "prefill"]  # down to the one decode left
    assert (len(moving.prefills), len(moving.decodes)) == (3, 1)
    assert all("prefill at" in reason for *_, reason in moving.moves)
    ttft = lambda c: statistics.mean(r.ttft for r in c.records_list)  # noqa: E731
    assert ttft(moving) < ttft(fixed) / 2
    assert all(r.output_tokens == 4 for r in moving.records_list)
    check_idle(moving)


def test_a_token_heavy_load_takes_prefill_workers_into_decode():
    args = dict(prompt_len=100, output_len=300, every_s=0.1, n=300)
    fixed, moving = run(3, 1, None, **args), run(3, 1, POLICY, **args)
    assert moving.moves and {role for _, _, role, _ in moving.moves} == {"decode"}
    assert len(moving.decodes) > 1 and len(moving.prefills) >= 1
    e2e = lambda c: statistics.mean(r.e2e for r in c.records_list)  # noqa: E731
    assert e2e(moving) < e2e(fixed)
    assert all(r.output_tokens == 300 for r in moving.records_list)
    check_idle(moving)


def test_without_the_controller_nothing_moves():
    c = run(1, 3, None, prompt_len=1000, output_len=4, every_s=0.5, n=40)
    assert c.moves == [] and (len(c.prefills), len(c.decodes)) == (1, 3)
