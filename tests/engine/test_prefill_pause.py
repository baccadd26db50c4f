"""A running prompt of a less urgent request pauses between chunks for a more urgent one and goes
on from its own KV: both outputs are what each writes alone, and nothing is recomputed."""

from __future__ import annotations

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm
from tests.worker.cluster import prompt


def test_the_urgent_prompt_goes_first_and_the_paused_one_loses_nothing(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=32)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long, short = prompt(200, seed=1), prompt(20, seed=2)
    low = engine.add_request(None, {"prompt_token_ids": long}, sp, priority=1)
    engine.step()
    high = engine.add_request(None, {"prompt_token_ids": short}, sp, priority=0)
    sched = engine.scheduler
    urgent, paused = sched.requests[high], sched.requests[low]
    engine.step()
    assert len(urgent.output_token_ids) == 1 and paused.num_computed_tokens == 32  # its first step was the urgent one's
    while engine.has_unfinished_requests():
        engine.step()
    assert sched.num_prefill_pauses >= 1 and sched.num_preemptions == 0
    assert sched.tokens_by_source["computed"] == len(long) + len(short)  # nothing computed twice
    alone = make_llm(tiny_llama, max_num_batched_tokens=32)
    assert paused.output_token_ids == alone.generate([{"prompt_token_ids": long}], sp)[0].outputs[0].token_ids
    assert urgent.output_token_ids == alone.generate([{"prompt_token_ids": short}], sp)[0].outputs[0].token_ids
    assert_engine_idle(llm)


def test_a_prompt_preempted_for_memory_resumes_from_its_cached_blocks(tiny_llama):
    """Preempted mid-prompt (by recompute), a prompt's computed full blocks stay in the prefix
    cache, or in the host tier once the pool reuses them: it goes on from them, computing again
    only its last partial block, and writes what it writes alone."""
    llm = make_llm(tiny_llama, max_num_batched_tokens=32, block_size=4, host_kv_memory="1MiB")
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long = prompt(200, seed=1)
    rid = engine.add_request(None, {"prompt_token_ids": long}, sp)
    for _ in range(3):
        engine.step()
    sched = engine.scheduler
    req = sched.requests[rid]
    assert req.num_computed_tokens == 96
    sched._preempt(req)  # the pool may now reuse its blocks: the tier keeps those it does
    while engine.has_unfinished_requests():
        engine.step()
    by_source = sched.tokens_by_source
    assert by_source["prefix_cache"] + by_source["host"] == 96  # resumed from what it computed
    assert by_source["computed"] == 200 + (200 - 96)  # its first admission, then only the rest
    alone = make_llm(tiny_llama, max_num_batched_tokens=32, block_size=4)
    assert req.output_token_ids == alone.generate([{"prompt_token_ids": long}], sp)[0].outputs[0].token_ids
    assert_engine_idle(llm)
