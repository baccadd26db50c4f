"""Speculative decoding with a draft model (`--speculative draft:PATH`): output equal to decoding
one token at a time whatever the draft model proposes (the target itself, its 4-bit self, another
model), both KV pools whole after rejected drafts, aborts and preemption, and a draft model that
would not share the target's tokens refused at load."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm, make_speculating_llm, make_tiny_model
from tests.worker.cluster import prompt

PROMPTS = [prompt(23, seed=1), prompt(40, seed=2), prompt(7, seed=3) * 4, prompt(60, seed=4)]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Another architecture with the same tokenizer: a draft the target mostly disagrees with."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "qwen2", "qwen2")


def drafting_llm(target, draft, quantization="none", **engine_args):
    return make_speculating_llm(target, speculative=f"draft:{draft}", draft_quantization=quantization,
                                **engine_args)


def assert_draft_pool_whole(llm) -> None:
    blocks = llm.engine.scheduler.proposer.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("draft, quantization", [("self", "none"), ("self", "int4"), ("other", "none")],
                         ids=["self", "self-4bit", "other-model"])
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_greedy_output_equals_decoding_one_token_at_a_time(tiny_llama, plain, other_model, draft, quantization,
                                                           num_tokens):
    """Several requests at once, each draft verified: the tokens are plain decoding's. The target
    as its own draft (float32) agrees with itself; its 4-bit self and another model miss at times,
    and their drafts' KV is rolled back and written again."""
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    llm = drafting_llm(tiny_llama, tiny_llama if draft == "self" else other_model, quantization,
                       num_speculative_tokens=num_tokens)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_drafted > 0 and 0 < sched.num_accepted <= sched.num_drafted
    if (draft, quantization) == ("self", "none"):
        assert sched.num_accepted >= 0.9 * sched.num_drafted  # the same model: its drafts are its tokens
    if draft == "other":
        assert sched.num_accepted < sched.num_drafted  # rejections happened: the rollback was exercised
    assert sched.proposer.prompt_tokens_computed == sum(len(p) for p in PROMPTS)  # each prompt once
    assert_engine_idle(llm)
    assert_draft_pool_whole(llm)


def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(tiny_llama, plain, other_model):
    params = [SamplingParams(temperature=0.8, seed=s, top_k=20, logit_bias={5: 6.0, 6: 6.0}, max_tokens=32,
                             ignore_eos=True) for s in (3, 4)]
    prompts = [{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[0]}]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = drafting_llm(tiny_llama, tiny_llama, "int4", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.scheduler.num_accepted > 0
    assert_draft_pool_whole(llm)


def test_aborted_and_preempted_requests_leave_no_draft_block(tiny_llama, plain):
    """A pool small enough that requests preempt one another, and an abort mid-way: every block of
    both pools comes back, and the finished requests' tokens are plain decoding's."""
    # 2 KiB per block: 40 blocks cannot hold the four requests at full length (the draft gets 10)
    llm = drafting_llm(tiny_llama, tiny_llama, "int4", kv_cache_memory=40 * 2048, max_num_batched_tokens=64,
                       num_speculative_tokens=4)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp) for p in PROMPTS]
    for _ in range(5):
        engine.step()
    engine.abort(ids[1])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0  # the scenario preempted, or it tested nothing
    want = plain.generate([{"prompt_token_ids": PROMPTS[i]} for i in (0, 2, 3)], sp)
    assert [done[ids[i]] for i in (0, 2, 3)] == [o.outputs[0].token_ids for o in want]
    assert_engine_idle(llm)
    assert_draft_pool_whole(llm)


def test_a_draft_model_that_splits_text_otherwise_is_refused(tiny_llama, tmp_path):
    other = shutil.copytree(tiny_llama, tmp_path / "renumbered")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: the same words, other numbers
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer"):
        drafting_llm(tiny_llama, other)
    with pytest.raises(ValueError, match="draft:PATH"):
        make_llm(tiny_llama, speculative="draft:")


def test_a_disaggregated_decode_worker_drafts_with_a_draft_model(tiny_llama, plain):
    """1P1D over tcp: the decode worker's draft model computes the prompt itself (the prefill worker
    ships the target's KV only), drafts and verifies; the tokens are the colocated ones, its
    metrics count the draft's prompt tokens, and every block of both pools comes back."""
    from tests.worker.cluster import Cluster

    tokens = PROMPTS[2]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    decode = {"speculative": f"draft:{tiny_llama}", "draft_quantization": "int4"}
    with Cluster(tiny_llama, "tcp", decode=decode) as c:
        engine = c.d.worker.engine
        engine.scheduler.observe_step = lambda rows, seconds: None  # every draft verified
        got = [t for line in c.stream(tokens, max_tokens=40) for t in line["outputs"][0]["token_ids"]]
        assert got == want
        stats = c.d.worker.stats()
        assert stats.kv_landed == 1 and stats.speculative == "draft"
        assert 0 < stats.draft_tokens_accepted <= stats.draft_tokens
        assert stats.draft_prompt_tokens == len(tokens)
        metrics = c.http.get(c.d.url + "/metrics").text
        assert f'pdserve_worker_draft_prompt_tokens{{method="draft"}} {float(len(tokens))}' in metrics
        c.wait_idle()
        blocks = engine.scheduler.proposer.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
