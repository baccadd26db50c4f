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
