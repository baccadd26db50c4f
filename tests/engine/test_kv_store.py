"""The shared KV tier (`--kv-store`): a real Valkey server on a private unix socket (as `pdserve
serve --local-kv-store` starts it). A conversation's second turn, on the engine whose pool evicted
its blocks or on another engine sharing the store (every full block a step computes is shared at
once), computes only its new tokens and writes what a fresh engine writes; a prompt another engine
computed is read, not computed, while it is still in that engine's pool; a block whose bytes changed in the store is found out, deleted and computed
again; a store that goes away leaves the engine serving, computing what it would have read."""

from __future__ import annotations

import pytest

from pdserve.prefix_hash import block_hashes
from pdserve.store_server import PASSWORD_ENV, LocalStore, parse_store_url, server_binary
from tests.engine.test_kv_tier import SMALL_POOL, second_turn, turn
from tests.factories import assert_engine_idle, make_llm

try:
    server_binary()
    import valkey  # noqa: F401
    HAVE_STORE = True
except (RuntimeError, ImportError):
    HAVE_STORE = False

needs_store = pytest.mark.skipif(not HAVE_STORE, reason="the store extra (a Valkey server) is not installed")
PREFIX = 52  # turn 1 and its answer but the last token, in whole blocks of 4 (see test_kv_tier)


@pytest.fixture()
def store(monkeypatch):
    server = LocalStore(64 << 20)
    monkeypatch.setenv(PASSWORD_ENV, server.password)
    yield server
    server.stop()


def sent(llm) -> None:
    assert llm.engine.block_manager.tier.store.flush()


@needs_store
def test_a_returning_conversation_comes_back_from_the_store_on_another_engine(tiny_llama, store):
    first = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)  # a host tier of 64 blocks stages
    second, out, added = second_turn(first)
    fresh = turn(make_llm(tiny_llama), second)
    assert out == fresh and added["computed"] == len(second) - PREFIX  # from its own host tier
    sent(first)
    assert first.engine.block_manager.tier.store.num_written > 0
    other = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)  # another worker: nothing of it here
    before = dict(other.engine.scheduler.tokens_by_source)
    assert turn(other, second) == fresh
    added = {k: v - before[k] for k, v in other.engine.scheduler.tokens_by_source.items()}
    shared = (len(second) - 1) // 4 * 4  # every full block of it: the first engine computed turn 2 too
    assert added["store"] == shared and added["computed"] == len(second) - shared
    assert other.engine.block_manager.tier.store.num_read == shared // 4
    assert_engine_idle(first)
    assert_engine_idle(other)


@needs_store
def test_a_prompt_computed_on_one_engine_is_read_by_another(tiny_llama, store):
    tokens = list(range(10, 10 + 45))
    one, other = (make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL) for _ in range(2))
    out = turn(one, tokens)  # its blocks stay in its pool: they reach the store as computed
    sent(one)
    assert turn(other, tokens) == out
    assert other.engine.scheduler.tokens_by_source["store"] == 44  # all but the last token, in whole blocks
    assert other.engine.scheduler.tokens_by_source["computed"] == 1
    assert_engine_idle(one)
    assert_engine_idle(other)


@needs_store
def test_a_waiting_requests_prefix_is_read_ahead_of_its_admission(tiny_llama, store):
    """Queued, a request's prefix blocks are read from the store on the prefetch thread; its
    admission takes them from there: each read once, none on the engine thread."""
    from tests.engine.test_kv_tier import GREEDY

    tokens = list(range(10, 10 + 45))
    one = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)
    out = turn(one, tokens)
    sent(one)
    other = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)
    engine, tier = other.engine, other.engine.block_manager.tier
    engine.add_request("r", {"prompt_token_ids": tokens}, GREEDY)
    assert tier.prefetcher.wait(10)
    assert tier.prefetcher.num_read == 11 and tier.prefetcher.num_used == 0  # read, before any step
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == out
    assert tier.prefetcher.num_used == 11 and tier.store.num_read == 11  # taken, not read again
    assert engine.scheduler.tokens_by_source["store"] == 44
    assert_engine_idle(other)


@needs_store
def test_a_corrupted_block_in_the_store_is_computed_again(tiny_llama, store):
    import valkey

    first = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)
    second, _, _ = second_turn(first)
    sent(first)
    fresh = turn(make_llm(tiny_llama), second)
    tier = first.engine.block_manager.tier.store
    client = valkey.Valkey(**parse_store_url(store.url), password=store.password)
    victim = tier.key(block_hashes(second, 4)[2])  # the conversation's third block
    good = client.get(victim)
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    client.set(victim, bytes(bad))
    other = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)
    assert turn(other, second) == fresh
    reader = other.engine.block_manager.tier.store
    assert reader.num_corrupt == 1
    assert other.engine.scheduler.tokens_by_source["store"] == 2 * 4  # the two blocks before it
    sent(other)  # the block it computed again is shared again, whole
    assert client.get(victim) == good
    assert_engine_idle(other)


@needs_store
def test_an_engine_whose_store_went_away_goes_on_without_it(tiny_llama, store):
    llm = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)
    store.stop()
    second, out, added = second_turn(llm)  # its own host tier still serves the second turn
    assert out == turn(make_llm(tiny_llama), second)
    other = make_llm(tiny_llama, kv_store=store.url, **SMALL_POOL)
    before = dict(other.engine.scheduler.tokens_by_source)
    assert turn(other, second) == out
    assert other.engine.scheduler.tokens_by_source["computed"] - before["computed"] == len(second)
    assert other.engine.block_manager.tier.store.num_errors >= 1
    assert_engine_idle(other)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "unix://", "valkey://:6379", "valkey://h:99999",
                                 "valkey://user:pw@h:6379", "valkey://h:6379/16", "unix:///s.sock?db=x"])
def test_bad_store_urls_are_refused(tiny_llama, url):
    with pytest.raises(ValueError, match="--kv-store"):
        make_llm(tiny_llama, kv_store=url)


def test_store_urls_parse():
    assert parse_store_url("unix:///run/x/valkey.sock?db=2") == {"unix_socket_path": "/run/x/valkey.sock", "db": 2}
    assert parse_store_url("valkey://10.0.0.5:6380/3") == {"host": "10.0.0.5", "port": 6380, "db": 3}
    assert parse_store_url("redis://cache") == {"host": "cache", "port": 6379, "db": 0}
