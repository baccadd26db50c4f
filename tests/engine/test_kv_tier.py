"""The host KV tier (`--host-kv-memory`): a conversation's second turn after its prefix left the pool
computes only its new tokens and writes what a fresh engine writes; int8 blocks come back close;
the tier is bounded, least recently used first; pools and tier balance; the worker's metrics
count tokens by where their KV came from."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.prefix_hash import block_hashes
from tests.factories import assert_engine_idle, make_llm
from tests.worker.cluster import prompt

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SMALL_POOL = dict(kv_cache_memory=24 * 2048, block_size=4)  # 24 blocks of 4 tokens: one conversation and a bit


def turn(llm, tokens: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": tokens}], GREEDY)[0].outputs[0].token_ids


def second_turn(llm) -> tuple[list[int], list[int], dict]:
    """Turn 1, then other prompts that evict its blocks from the pool, then turn 2 (turn 1, its
    answer and a new question): turn 2's tokens and the tokens' sources it added."""
    first = prompt(40, seed=1)
    answer = turn(llm, first)
    for seed in range(2, 5):
        turn(llm, prompt(60, seed=seed))  # the pool has room for one of these at a time
    second = first + answer + prompt(9, seed=7)
    sources = dict(llm.engine.scheduler.tokens_by_source)
    out = turn(llm, second)
    added = {k: v - sources[k] for k, v in llm.engine.scheduler.tokens_by_source.items()}
    return second, out, added


def test_a_returning_conversation_computes_only_its_new_tokens(tiny_llama):
    llm = make_llm(tiny_llama, host_kv_memory="4MiB", **SMALL_POOL)
    second, out, added = second_turn(llm)
    assert out == turn(make_llm(tiny_llama), second)  # raw blocks: exactly the computed prefix
    prefix = (40 + 16 - 1) // 4 * 4  # turn 1 and its answer but the last token (never fed), in whole blocks
    assert added["host"] == prefix and added["prefix_cache"] == 0
    assert added["computed"] == len(second) - prefix  # its new tokens (and the partial block before them)
    tier = llm.engine.block_manager.tier
    assert tier.num_loaded == prefix // 4 and tier.num_saved > 0
    assert_engine_idle(llm)


def test_without_the_tier_the_prefix_is_computed_again(tiny_llama):
    llm = make_llm(tiny_llama, **SMALL_POOL)
    second, out, added = second_turn(llm)
    assert added["host"] == 0 and added["computed"] == len(second)
    assert llm.engine.block_manager.tier is None


def test_int8_blocks_come_back_close(tiny_llama):
    llm = make_llm(tiny_llama, host_kv_memory="2MiB", host_kv_encoding="int8", **SMALL_POOL)
    second, out, added = second_turn(llm)
    assert added["host"] == 52 and len(out) == 16
    want = turn(make_llm(tiny_llama), second)
    assert sum(a == b for a, b in zip(out, want)) >= 8  # close: most tokens agree (greedy can drift after one)
    assert_engine_idle(llm)


def test_the_tier_is_bounded(tiny_llama):
    """A tier of 8 blocks keeps 8, however many the pool evicts (the least recently used go)."""
    cache = make_llm(tiny_llama, **SMALL_POOL).engine.runner.kv_cache
    per_block = cache[:, :4].numel() * cache.element_size()
    small = make_llm(tiny_llama, host_kv_memory=8 * per_block, **SMALL_POOL)
    tier = small.engine.block_manager.tier
    assert tier.capacity == 8
    for seed in range(1, 6):
        turn(small, prompt(60, seed=seed))
    assert len(tier) == 8 and tier.num_saved > 8
    assert_engine_idle(small)


@pytest.mark.parametrize("flags, message", [({"host_kv_memory": "-1"}, "memory size"),
                                            ({"host_kv_encoding": "fp4"}, "host_kv_encoding"),
                                            ({"host_kv_memory": 10}, "holds no block")])
def test_bad_tier_flags_are_refused(tiny_llama, flags, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, **flags)


def test_the_workers_metrics_count_tokens_by_source(tiny_llama):
    """1P1D: the decode worker's tokens came transferred (beyond its own prefix hits), the prefill
    worker's computed; both under pdserve_prompt_tokens_by_source_total."""
    from tests.worker.cluster import Cluster

    tokens = prompt(30, seed=3)
    with Cluster(tiny_llama, "tcp") as c:
        c.generate(tokens, max_tokens=4)
        c.generate(tokens, max_tokens=4)  # the decode worker's own prefix cache, the rest transferred
        d, p = c.d.worker.stats().tokens_by_source, c.p.worker.stats().tokens_by_source
        assert d["transferred"] + d["prefix_cache"] == 2 * len(tokens) and d["prefix_cache"] > 0
        assert p["computed"] + p["prefix_cache"] == 2 * len(tokens) and d["computed"] == 0
        text = c.http.get(c.d.url + "/metrics").text
        assert f'pdserve_prompt_tokens_by_source_total{{source="transferred"}} {float(d["transferred"])}' in text
        c.wait_idle()


DISK = dict(host_kv_memory=4 * 4 * 2048, **SMALL_POOL)  # a host tier of 4 blocks: the rest goes to disk


@pytest.mark.parametrize("host_blocks", [4, 1])
def test_blocks_the_host_tier_lets_go_come_back_from_disk(tiny_llama, tmp_path, host_blocks):
    """Through the host tier's slots, or straight to the pool where they are all spoken for."""
    llm = make_llm(tiny_llama, disk_kv_path=str(tmp_path), **{**DISK, "host_kv_memory": host_blocks * 4 * 2048})
    second, out, added = second_turn(llm)
    assert out == turn(make_llm(tiny_llama), second)
    assert added["disk"] > 0 and added["host"] + added["disk"] == 52 and added["computed"] == len(second) - 52
    assert llm.engine.block_manager.tier.spill.num_read * 4 == added["disk"]
    assert_engine_idle(llm)


def test_the_disk_tier_outlives_its_engine_and_refuses_a_corrupted_block(tiny_llama, tmp_path):
    """A new engine on the same directory starts from the blocks the last one wrote; a file whose
    bytes changed is found out, deleted, and its block computed again: the tokens are the same."""
    first = make_llm(tiny_llama, disk_kv_path=str(tmp_path), **DISK)
    second, _, _ = second_turn(first)
    fresh = turn(make_llm(tiny_llama), second)
    assert first.engine.block_manager.tier.spill.flush()  # written by the tier's writer thread
    files = sorted(first.engine.block_manager.tier.spill.dir.glob("*.kv"))
    assert files
    again = make_llm(tiny_llama, disk_kv_path=str(tmp_path), **DISK)
    before = dict(again.engine.scheduler.tokens_by_source)
    assert turn(again, second) == fresh
    assert again.engine.scheduler.tokens_by_source["disk"] > before["disk"]  # nothing of it was in this engine
    spill = again.engine.block_manager.tier.spill
    victim = spill.dir / f"{block_hashes(second, 4)[2]:032x}.kv"  # the conversation's third block
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    third = make_llm(tiny_llama, disk_kv_path=str(tmp_path), **DISK)
    assert turn(third, second) == fresh
    assert third.engine.block_manager.tier.spill.num_corrupt == 1 and not victim.exists()
