"""KV that outlives its engine (`engine/durable_kv.py`): an engine is dropped mid-generation as a
killed worker would be (nothing cleaned up), a new one attaches to the same pool file, checks the
journal, and resumes each request from its KV: the tokens those of an uninterrupted run, no prompt
token computed again. A corrupted record or block is detected, and its request computed again,
with the same tokens; nothing leaks."""

from __future__ import annotations

import json
import os
import secrets

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.durable_kv import DurableKV, journal_path
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.shm import SHM_DIR, shm_available
from tests.factories import assert_no_leaks
from tests.worker.cluster import prompt

pytestmark = pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")

PROMPTS = [prompt(37, seed=1), prompt(22, seed=2), prompt(50, seed=3)]
SAMPLING = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]


@pytest.fixture
def pool_path():
    path = os.path.join(SHM_DIR, f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}")
    yield path
    for p in (path, journal_path(path)):
        if os.path.exists(p):
            os.unlink(p)


def durable_engine(model, path: str) -> tuple[LLMEngine, DurableKV]:
    durable = DurableKV(path, f"{model}|test", interval_s=0.0)
    config = EngineConfig(model=str(model), dtype="float32", kv_cache_memory="4MiB", block_size=4,
                          max_num_batched_tokens=256)
    engine = LLMEngine(config, kv_allocator=durable.allocate)
    durable.recover(engine.block_manager)
    engine.scheduler.durable = durable
    return engine, durable


def run(engine: LLMEngine, durable: DurableKV | None, steps: int | None = None) -> dict[str, list[int]]:
    """Step (journaling between steps) until done, or `steps` steps: each request's tokens so far."""
    tokens: dict[str, list[int]] = {}
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        if durable is not None:
            durable.tick(engine.scheduler.running)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        n += 1
    return tokens


def uninterrupted(model) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory="4MiB", block_size=4,
                                    max_num_batched_tokens=256))
    for i, (p, s) in enumerate(zip(PROMPTS, SAMPLING)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, s)
    return run(engine, None)


def crash_and_resume(model, path: str, corrupt=None) -> tuple[dict[str, list[int]], LLMEngine, DurableKV]:
    first, durable = durable_engine(model, path)
    for i, (p, s) in enumerate(zip(PROMPTS, SAMPLING)):
        first.add_request(f"r{i}", {"prompt_token_ids": p}, s)
    before = run(first, durable, steps=12)  # prompts computed, some tokens decoded; then "killed"
    shape = tuple(first.runner.kv_cache.shape)
    del first
    if corrupt is not None:
        corrupt(path, shape)
    engine, durable = durable_engine(model, path)
    for i, (p, s) in enumerate(zip(PROMPTS, SAMPLING)):
        engine.add_request(f"r{i}-1", {"prompt_token_ids": p}, s, output_token_ids=before[f"r{i}"],
                           resume_of=f"r{i}")
    after = run(engine, durable)
    return {f"r{i}": before[f"r{i}"] + after[f"r{i}-1"] for i in range(len(PROMPTS))}, engine, durable


def test_a_restarted_engine_resumes_from_the_kv_it_finds(tiny_llama, pool_path):
    tokens, engine, durable = crash_and_resume(tiny_llama, pool_path)
    assert tokens == uninterrupted(tiny_llama)
    sources = engine.scheduler.tokens_by_source
    assert durable.generation == 2 and durable.resumed_requests == 3 and durable.rejected_records == 0
    assert durable.recomputed_prompt_tokens == 0
    assert sources["resumed"] >= sum(len(p) for p in PROMPTS)
    # each request computes only what it decoded after the last journal write (the step after it
    # here) and its last token (whose logits are the next token's)
    assert sources["computed"] == 2 * len(PROMPTS)
    assert not durable.held
    assert_no_leaks(engine.block_manager)


def _flip_record(path: str, shape: tuple[int, ...]) -> None:
    with open(journal_path(path)) as f:
        journal = json.load(f)
    record = journal["records"][0]
    record["body"] = record["body"].replace('"tokens":[', '"tokens":[1,', 1)  # its checksum now lies
    with open(journal_path(path), "w") as f:
        json.dump(journal, f)


def _flip_kv(path: str, shape: tuple[int, ...]) -> None:
    with open(journal_path(path)) as f:
        record = json.loads(json.load(f)["records"][0]["body"])
    slot_bytes = shape[2] * shape[3] * shape[4] * 4  # float32
    with open(path, "r+b") as f:  # the first layer's first slot of the record's first block
        f.seek(record["blocks"][0] * 4 * slot_bytes)
        f.write(b"\x7f" * 16)


@pytest.mark.parametrize("corrupt", [_flip_record, _flip_kv], ids=["journal", "kv"])
def test_corruption_is_detected_and_the_request_computed_again(tiny_llama, pool_path, corrupt):
    tokens, engine, durable = crash_and_resume(tiny_llama, pool_path, corrupt)
    assert tokens == uninterrupted(tiny_llama)
    assert durable.rejected_records == 1 and durable.resumed_requests == 2
    assert durable.recomputed_prompt_tokens > 0
    assert_no_leaks(engine.block_manager)


def test_a_pool_of_another_layout_starts_afresh(tiny_llama, pool_path):
    first, durable = durable_engine(tiny_llama, pool_path)
    first.add_request("r0", {"prompt_token_ids": PROMPTS[0]}, SAMPLING[0])
    run(first, durable, steps=3)
    other = DurableKV(pool_path, "another model", interval_s=0.0)
    other.allocate(tuple(first.runner.kv_cache.shape), first.runner.kv_cache.dtype)
    assert not other.reattached and other.generation == 1
