"""Greedy generation through the whole engine equals transformers' `generate`, token for token,
under every scheduling situation: whole prefill, chunked prefill, prefix-cache hits, preemption."""

import pytest
import torch

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, every_draft_verified, make_llm

NEW_TOKENS = 12
SYSTEM = list(range(200, 224))  # a shared 24-token prefix (6 blocks of 4)


def mixed_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [1, 3, 9, 16, 17, 30, 41, 64]
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # an explicit mask: otherwise transformers masks every prompt token equal to the pad id
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(hf_models):
    prompts = mixed_prompts() + [SYSTEM + p for p in mixed_prompts()[:4]]
    return {tuple(p): hf_greedy(hf_models["llama"], p, NEW_TOKENS) for p in prompts}


def generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("speculative", ["off", "ngram", "draft"])
@pytest.mark.parametrize("scenario", ["whole", "chunked", "preemption"])
def test_greedy_matches_transformers(tiny_llama, reference, scenario, speculative):
    """With speculative decoding too: drafts verified beside chunks, and requests preempted with
    draft slots allocated (the draft model: the tiny model's own 4-bit weights)."""
    args = {
        "whole": dict(max_num_batched_tokens=1024),
        "chunked": dict(max_num_batched_tokens=7),
        # 2 KiB per block: 40 blocks cannot hold all eight requests at full length
        "preemption": dict(kv_cache_memory=40 * 2048, max_num_batched_tokens=64),
    }[scenario]
    if speculative == "draft":  # its drafts take step budget from prefills: fewer requests overlap
        args.update(speculative=f"draft:{tiny_llama}", draft_quantization="int4")
        if scenario == "preemption":
            args.update(kv_cache_memory=24 * 2048)
    else:
        args.update(speculative=speculative)
    llm = make_llm(tiny_llama, **args)
    every_draft_verified(llm.engine)
    prompts = mixed_prompts()
    got, _ = generate(llm, prompts)
    for p, tokens in zip(prompts, got):
        assert tokens == reference[tuple(p)], f"prompt of {len(p)} tokens diverged"
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if speculative != "off":
        assert llm.engine.scheduler.num_accepted > 0
    assert_engine_idle(llm)


def test_prefix_cache_hits_give_identical_output(tiny_llama, reference):
    llm = make_llm(tiny_llama, max_num_batched_tokens=32)
    prompts = [SYSTEM + p for p in mixed_prompts()[:4]]
    first, outs1 = generate(llm, prompts[:1])
    assert outs1[0].num_cached_tokens == 0
    rest, outs2 = generate(llm, prompts[1:])
    assert all(o.num_cached_tokens >= len(SYSTEM) for o in outs2)
    for p, tokens in zip(prompts, first + rest):
        assert tokens == reference[tuple(p)]
    # the very same prompt again: everything but the last token comes from the cache
    again, outs3 = generate(llm, prompts[3:])
    assert again == rest[2:] and outs3[0].num_cached_tokens == (len(prompts[3]) - 1) // 4 * 4
    assert_engine_idle(llm)


@pytest.mark.parametrize("variant", ["mistral", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_matches_transformers_other_architectures(tiny_models, hf_models, variant):
    llm = make_llm(tiny_models[variant], max_num_batched_tokens=16)
    prompts = mixed_prompts()[2:6]
    got, _ = generate(llm, prompts)
    for p, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf_models[variant], p, NEW_TOKENS)
    assert_engine_idle(llm)
