"""Routing policies without a model: decode score, hot spots, prefix-aware prefill choice,
conditional disaggregation, admission bounds, hot-spot relief."""

from pdserve.engine.block_manager import BlockManager
from pdserve.prefix_hash import block_hashes
from pdserve.router.policy import (
    Admission, DecodeWeights, DisaggregationPolicy, HotSpotRelief, PrefixIndex, RunningStream, WorkerLoad,
    choose_decode, choose_migrations, choose_prefill, decode_score, prefill_remotely,
)
from pdserve.wire import WorkerStats
from tests.factories import make_request


def load(**kw) -> WorkerLoad:
    return WorkerLoad(**{"kv_blocks_total": 100, **kw})


def test_decode_score_follows_each_term():
    idle = decode_score(load())
    assert abs(idle - 1.0) < 1e-9
    for busier in (load(running=32), load(waiting=50), load(kv_blocks_used=50), load(step_latency_ewma_ms=125)):
        assert decode_score(busier) < idle
    assert decode_score(load(running=64, waiting=100, kv_blocks_used=100, step_latency_ewma_ms=500)) == 0.0


def test_choose_decode_prefers_the_least_loaded_and_avoids_hot_spots():
    loads = {"a": load(running=10), "b": load(running=2), "c": load(running=0, kv_blocks_used=90)}
    assert choose_decode(loads) == "b"  # c is idle but above 85% of its KV: a hot spot
    assert choose_decode(loads, exclude=frozenset({"b"})) == "a"
    assert choose_decode({"c": loads["c"]}) == "c"  # when every worker is hot, still serve
    assert choose_decode({}) is None
    assert choose_decode(loads, DecodeWeights(hot_kv_usage=1.0)) == "b"  # no hot-spot rule: the score decides


def test_choose_prefill_weighs_cached_prefix_against_queue():
    index = PrefixIndex()
    prompt = list(range(1, 41))
    hashes = block_hashes(prompt, 4)
    assert len(hashes) == 10
    index.record("warm", 4, hashes[:8])  # 32 tokens already in its prefix cache
    loads = {"warm": load(queued_prefill_tokens=20), "cold": load(queued_prefill_tokens=0)}
    assert index.cached_tokens("warm", 4, hashes) == 32 and index.cached_tokens("cold", 4, hashes) == 0
    cached = {k: index.cached_tokens(k, 4, hashes) for k in loads}
    assert choose_prefill(loads, cached, len(prompt)) == "warm"  # 20 + 8 < 0 + 40
    loads["warm"] = load(queued_prefill_tokens=100)
    assert choose_prefill(loads, cached, len(prompt)) == "cold"
    assert choose_prefill({}, cached, 40) is None


def test_prefix_index_is_bounded_and_chained():
    index = PrefixIndex(max_blocks_per_worker=3)
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    b = block_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same block, different prefix: a different hash
    index.record("w", 2, a)
    assert index.cached_tokens("w", 2, a) == 0  # the first block was evicted, so no prefix survives
    index.record("w", 2, a[:2])
    assert index.cached_tokens("w", 2, a) == 4
    index.forget("w")
    assert index.cached_tokens("w", 2, a) == 0


def test_prefix_index_keeps_each_block_size_apart():
    index = PrefixIndex()
    prompt = list(range(1, 33))
    index.record("w", 8, block_hashes(prompt, 8))
    assert index.cached_tokens("w", 8, block_hashes(prompt, 8)) == 32
    assert index.cached_tokens("w", 16, block_hashes(prompt, 16)) == 0  # never recorded in blocks of 16
    index.record("w", 16, block_hashes(prompt, 16)[:1])
    index.forget("w")
    assert index.cached_tokens("w", 8, block_hashes(prompt, 8)) == 0
    assert index.cached_tokens("w", 16, block_hashes(prompt, 16)) == 0


def test_router_hashes_are_the_engines_prefix_cache_hashes():
    """The index is only right if it names blocks as the engines' prefix caches do."""
    prompt = list(range(100, 150))  # 6 full blocks of 8 and a partial one
    request = make_request(prompt=prompt)
    assert BlockManager(num_blocks=16, block_size=8).find_cached_prefix(request) == []  # hashes its blocks
    assert request.block_hashes == block_hashes(prompt, 8)


def test_conditional_disaggregation():
    policy = DisaggregationPolicy(min_remote_tokens=64, saturated_queue_tokens=1000)
    prefills = {"p1": load(queued_prefill_tokens=10), "p2": load(queued_prefill_tokens=5000)}
    assert prefill_remotely(500, prefills, policy)
    assert not prefill_remotely(32, prefills, policy)  # short: decode prefills it
    assert not prefill_remotely(500, {"p2": prefills["p2"]}, policy)  # the pool is saturated
    assert not prefill_remotely(500, {}, policy)  # no prefill worker


def test_admission_bounds_requests_and_tokens():
    adm = Admission(max_requests=2, max_tokens=100)
    assert adm.try_admit("a", 60) and not adm.try_admit("b", 50) and adm.try_admit("b", 40)
    assert not adm.try_admit("c", 1)
    adm.release("a")
    adm.release("a")  # idempotent
    assert adm.requests == 1 and adm.tokens == 40 and adm.try_admit("c", 60)


def test_worker_load_from_stats_ignores_other_fields():
    got = WorkerLoad.from_stats(WorkerStats(running=3, kv_blocks_used=5, kv_blocks_total=10, role="decode",
                                            kv_landed=4))
    assert got.running == 3 and got.kv_usage == 0.5


def test_hot_spot_relief_moves_the_biggest_request_to_a_cool_worker():
    loads = {"hot": load(kv_blocks_used=90, running=3), "warm": load(kv_blocks_used=70), "cool": load(kv_blocks_used=10),
             "idle": load()}
    streams = [RunningStream("s1", "hot", 300, 100), RunningStream("s2", "hot", 900, 100),
               RunningStream("s3", "hot", 2000, 5),  # about to finish: stays
               RunningStream("s4", "warm", 5000, 100)]  # warm is not hot: stays
    assert choose_migrations(loads, streams) == [("s2", "idle")]
    # two hot workers, one cool target: only one move this round
    loads2 = {"h1": load(kv_blocks_used=95), "h2": load(kv_blocks_used=90), "c": load(kv_blocks_used=0)}
    moves = choose_migrations(loads2, [RunningStream("a", "h1", 10, 50), RunningStream("b", "h2", 10, 50)])
    assert moves == [("a", "c")]  # the hottest first
    # nowhere cool enough, or nothing hot: nothing moves
    assert choose_migrations({"h": load(kv_blocks_used=90), "w": load(kv_blocks_used=65)},
                             [RunningStream("a", "h", 10, 50)]) == []
    assert choose_migrations({"a": load(kv_blocks_used=80), "b": load()}, [RunningStream("x", "a", 10, 50)]) == []
    relief = HotSpotRelief(target_max_kv_usage=0.7, min_remaining_tokens=1)
    assert choose_migrations({"h": load(kv_blocks_used=90), "w": load(kv_blocks_used=65)},
                             [RunningStream("a", "h", 10, 2)], relief=relief) == [("a", "w")]
