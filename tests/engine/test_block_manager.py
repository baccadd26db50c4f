from pdserve.engine.block_manager import BlockManager, hash_block
from tests.factories import assert_no_leaks, make_request


def test_allocate_grows_table_and_free_returns_all():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(num_prompt_tokens=6)
    assert bm.allocate(req, 6)
    assert len(bm.block_table(req.request_id)) == 2
    req.num_computed_tokens = 6
    assert bm.allocate(req, 1)  # 7 tokens: still two blocks
    assert len(bm.block_table(req.request_id)) == 2
    req.num_computed_tokens = 8
    assert bm.allocate(req, 1)  # the 9th token needs a third block
    assert len(bm.block_table(req.request_id)) == 3
    bm.free(req)
    assert_no_leaks(bm)


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request(num_prompt_tokens=12)
    assert not bm.allocate(req, 12)
    assert bm.num_free_blocks == 2
    assert bm.block_table(req.request_id) == []


def test_prefix_cache_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))  # three full blocks
    a = make_request(prompt=prompt)
    assert bm.find_cached_prefix(a) == []
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = make_request(prompt=prompt)
    hits = bm.find_cached_prefix(b)
    # all 12 tokens are cached, but the last token must be recomputed for its logits
    assert hits == bm.block_table(a.request_id)[:2]
    assert bm.allocate(b, 4, hits)
    assert bm.block_table(b.request_id)[:2] == hits
    assert bm.blocks[hits[0]].ref_count == 2
    bm.free(a)
    bm.free(b)
    assert_no_leaks(bm)


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request(prompt=[1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    table_a = list(bm.block_table(a.request_id))
    bm.free(a)
    assert_no_leaks(bm)
    # Same prefix: revived from the free queue without recomputation.
    b = make_request(prompt=[1, 2, 3, 4, 9])
    hits = bm.find_cached_prefix(b)
    assert hits == table_a[:2]
    assert bm.allocate(b, 1, hits)
    bm.free(b)
    # A different request needing every block evicts the cached ones.
    c = make_request(prompt=[50, 51, 52, 53, 54, 55, 56, 57])
    assert bm.allocate(c, 8)
    assert bm.find_cached_prefix(make_request(prompt=[1, 2, 3, 4, 9])) == []
    bm.free(c)
    assert_no_leaks(bm)


def test_tail_blocks_are_evicted_before_head_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request(prompt=[1, 2, 3, 4, 5, 6, 7])
    bm.allocate(a, 7)
    a.num_computed_tokens = 7
    bm.cache_full_blocks(a)
    bm.free(a)
    other = make_request(prompt=[9, 9])
    bm.allocate(other, 2)  # takes one block: the partial tail, never the cached head
    b = make_request(prompt=[1, 2, 3, 4, 5, 6, 0])
    assert len(bm.find_cached_prefix(b)) == 3
    bm.free(other)
    assert_no_leaks(bm)


def test_block_hash_is_chained():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
