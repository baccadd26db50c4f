"""The compiled decode step gives the tokens the eager engine gives, over batches whose contexts
differ, with continuous batching and preemption, without a recompile per context length, and
leaves the pool as clean as eager does."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm

PROMPTS = ["the model token prefill", "def return class import", "a", "one two three four five six seven"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engines(request, tiny_models):
    model = tiny_models[request.param]
    return make_llm(model), compiled_llm(model)


def compiled_llm(model, **kwargs):
    """An engine whose decode graphs are compiled before it runs."""
    llm = make_llm(model, compile_decode=True, **kwargs)
    assert llm.engine.runner.compiled.warm_up()
    return llm


def greedy(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_compiled_and_eager_give_the_same_greedy_tokens(engines):
    eager, compiled = engines
    torch._dynamo.utils.counters.clear()
    graphs = compiled.engine.runner.compiled
    steps_before = graphs.num_steps
    for batch in ([PROMPTS[0]], PROMPTS, PROMPTS[1:3]):
        assert greedy(compiled, batch) == greedy(eager, batch)
    assert not graphs.failed and graphs.num_steps - steps_before >= 3 * 23  # every decode step compiled
    # the graphs of the warm-up serve every context length: no compile while running
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    assert_engine_idle(compiled)


def test_seeded_sampling_is_the_same_compiled(engines):
    eager, compiled = engines
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True, n=2)
    assert ([c.token_ids for o in compiled.generate(PROMPTS, params) for c in o.outputs]
            == [c.token_ids for o in eager.generate(PROMPTS, params) for c in o.outputs])
    assert_engine_idle(compiled)


def test_preemption_under_a_small_pool_matches_eager(tiny_llama):
    small = dict(kv_cache_memory="160KiB", max_num_seqs=8)
    eager, compiled = make_llm(tiny_llama, **small), compiled_llm(tiny_llama, kv_cache_memory="160KiB")
    prompts = [p * 3 for p in PROMPTS] * 2
    assert greedy(compiled, prompts, 40) == greedy(eager, prompts, 40)
    assert_engine_idle(compiled)


def test_decodes_are_grouped_by_context_length():
    from pdserve.engine.model_runner import decode_groups

    assert decode_groups([5, 300, 40]) == [[0, 2, 1]]  # short contexts: one call
    assert decode_groups([2000, 10, 1100, 30, 4000]) == [[1, 3], [2, 0], [4]]
    assert sorted(i for g in decode_groups(list(range(1, 5000, 37))) for i in g) == list(range(len(range(1, 5000, 37))))


def test_a_long_context_among_short_ones_gives_the_tokens_it_gives_alone(tiny_llama):
    """Decodes of very different lengths attend in separate groups; each answer is its own."""
    llm = make_llm(tiny_llama, kv_cache_memory="16MiB")
    long_prompt = {"prompt_token_ids": [(7 * j) % 250 + 1 for j in range(700)]}
    short = ["a b c", "the model"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in
             (llm.generate(long_prompt, params) + llm.generate(short[0], params) + llm.generate(short[1], params))]
    together = [o.outputs[0].token_ids for o in llm.generate([long_prompt, *short], params)]
    assert together == alone
    assert_engine_idle(llm)


def test_quantized_weights_decode_eager_with_a_warning_not_a_failed_compile(tiny_llama, caplog):
    with caplog.at_level("WARNING", logger="pdserve.engine"):
        llm = make_llm(tiny_llama, compile_decode=True, quantization="int8")
    assert llm.engine.runner.compiled is None
    assert "compiled decode needs dense weights" in caplog.text
    assert greedy(llm, PROMPTS[:2], 8) == greedy(make_llm(tiny_llama, quantization="int8"), PROMPTS[:2], 8)
    assert_engine_idle(llm)
