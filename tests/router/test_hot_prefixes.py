"""Hot prefixes as the router counts them (pure bookkeeping), and routing's preference for the
decode worker whose prefix cache holds the prompt."""

from __future__ import annotations

import pytest

from pdserve.prefix_hash import block_hashes
from pdserve.router.hot_prefixes import MIN_BLOCKS, HotPrefixes
from pdserve.router.policy import DecodeWeights, PrefixIndex, WorkerLoad, choose_decode
from pdserve.router.routing import Candidate, route

BS = 4
SHARED = list(range(100, 100 + 6 * BS))  # six blocks every request of the burst starts with


def prompt(i: int) -> list[int]:
    return SHARED + [1000 + i, 2000 + i, 3000 + i, 4000 + i, 5000 + i]


def observe(hot: HotPrefixes, ids: list[int], now: float):
    return hot.observe(ids, BS, block_hashes(ids, BS), now)


def test_a_shared_prefix_becomes_hot_and_wants_a_copy_per_rate():
    hot = HotPrefixes(rate_per_copy=1.0, window_s=10.0)
    found = [observe(hot, prompt(i), now=0.0) for i in range(35)]  # 35 requests at once: 3.5 per second
    assert found[:19] == [None] * 19  # a second copy (2 per second) needs 20 in the window
    assert found[19] is not None
    prefix = found[-1]
    assert prefix is not None and prefix.hashes == tuple(block_hashes(SHARED, BS))  # the shared blocks, no more
    assert prefix.token_ids == tuple(prompt(34)[:len(SHARED) + 1])  # and the token after them
    assert prefix.num_tokens == len(SHARED)
    assert hot.tracked(0.0) == [(prefix, 3)]
    # it cools: 3.5/s decays with the window
    assert hot.tracked(10.0 * 1.0)[0][1] == 1  # 3.5 * e^-1 = 1.29/s
    assert hot.tracked(60.0)[0][1] == 0  # 3.5 * e^-6: below a twentieth of the rate per copy, to forget
    hot.forget(prefix)
    assert hot.tracked(60.0) == []


def test_prompts_that_share_too_little_have_no_hot_prefix():
    hot = HotPrefixes(rate_per_copy=1.0)
    short = SHARED[: (MIN_BLOCKS - 1) * BS]  # hot, but one block short; each next block seen once
    for i in range(50):
        assert observe(hot, short + [7000 + i] * BS, 0.0) is None
    assert hot.tracked(0.0) == []


def test_nested_hot_prefixes_are_tracked_apart():
    hot = HotPrefixes(rate_per_copy=1.0)
    document = SHARED + list(range(500, 500 + 4 * BS))
    for i in range(30):
        observe(hot, prompt(i), 0.0)
    for i in range(25):
        observe(hot, document + [9000 + i], 0.0)
    wants = {p.num_tokens: n for p, n in hot.tracked(0.0)}
    assert wants == {len(SHARED): 5, len(document): 2}  # 55 and 25 in a 10 s window


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        HotPrefixes(rate_per_copy=0.0)
    with pytest.raises(ValueError):
        HotPrefixes(rate_per_copy=1.0, window_s=-1.0)


def test_decode_choice_prefers_the_worker_holding_the_prompt_unless_it_is_hot():
    idle, busy = WorkerLoad(), WorkerLoad(running=8, kv_blocks_used=30, kv_blocks_total=100)
    w = DecodeWeights()
    assert choose_decode({"a": idle, "b": busy}, w) == "a"
    assert choose_decode({"a": idle, "b": busy}, w, cached_share={"b": 1.0}) == "b"
    assert choose_decode({"a": idle, "b": busy}, DecodeWeights(prefix=0.0), cached_share={"b": 1.0}) == "a"
    hot = WorkerLoad(running=8, kv_blocks_used=90, kv_blocks_total=100)
    assert choose_decode({"a": idle, "b": hot}, w, cached_share={"b": 1.0}) == "a"


def test_routing_counts_what_the_index_says_each_decode_worker_holds():
    index = PrefixIndex()
    ids = prompt(0)
    index.record("b", BS, block_hashes(ids, BS))
    workers = [Candidate("a", "decode", WorkerLoad(), block_size=BS),
               Candidate("b", "decode", WorkerLoad(running=4), block_size=BS)]
    decision = route(workers, ids, index)
    assert decision.decode_id == "b" and decision.decode_uncached == len(ids) - len(ids) // BS * BS
    assert route(workers, [1, 2, 3, 4, 5, 6, 7, 8, 9], index).decode_id == "a"


def test_a_prompt_computed_on_one_worker_counts_as_cached_on_every_worker_of_its_store():
    """Every full block a worker computes goes to its KV store: a worker of the same store reads the
    prompt, so it is not sent to a prefill worker, and a worker of another store (or none) is."""
    index = PrefixIndex()
    ids = list(range(1000, 1000 + 300 * BS))  # 1200 tokens: past the 256 a decode worker computes itself
    first = [Candidate("a", "decode", WorkerLoad(), block_size=BS, store="s1"),
             Candidate("p", "prefill", WorkerLoad(), block_size=BS)]
    decision = route(first, ids, index)
    assert decision.decode_id == "a" and decision.prefill_id == "p"
    for r in decision.records:
        index.record(r.worker_id, r.block_size, r.hashes)
    assert {r.worker_id for r in decision.records} == {"a", "p", "store:s1"}
    same_store = [Candidate("b", "decode", WorkerLoad(), block_size=BS, store="s1"), first[1]]
    d = route(same_store, ids, index)
    assert d.decode_id == "b" and d.prefill_id is None and d.decode_uncached == 0
    other_store = [Candidate("c", "decode", WorkerLoad(), block_size=BS, store="s2"), first[1]]
    assert route(other_store, ids, index).prefill_id == "p"
