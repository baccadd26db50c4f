"""Speculative decoding with a draft model (`--speculative draft:PATH`): output equal to decoding
one token at a time whatever the draft model proposes (the target itself, its 4-bit self, another
model), both KV pools whole after rejected drafts, aborts and preemption, and a draft model that
would not share the target's tokens refused at load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm, make_speculating_llm, make_tiny_model
from tests.worker.cluster import CASES_WITH_MEMORY, prompt

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


def _stream(c, body) -> list[int]:
    with c.http.stream("POST", c.d.url + "/v1/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        return [t for line in r.iter_lines() for t in json.loads(line)["outputs"][0]["token_ids"]]


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_the_prefill_worker_ships_the_draft_kv_in_the_same_lease(tiny_llama, plain, backend):
    """1P1D, both workers drafting with the same 4-bit draft: the prefill worker computes the
    draft's prompt KV beside the target's and ships it in the lease; the decode worker computes no
    prompt token of the draft (0 in its metrics), its draft KV is what its own draft computes for
    the prompt, and the tokens are the colocated ones; both pools of both workers come back whole."""
    from tests.worker.cluster import Cluster

    tokens = PROMPTS[3]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    drafting = {"speculative": f"draft:{tiny_llama}", "draft_quantization": "int4"}
    with Cluster(tiny_llama, backend, prefill=drafting, decode=drafting) as c:
        engine = c.d.worker.engine
        engine.scheduler.observe_step = lambda rows, seconds: None  # every draft verified
        draft = engine.draft_model
        landed = {}
        adopt = draft.adopt

        def adopt_and_keep(request, num_tokens):  # the draft KV as it landed
            table = draft.blocks.block_table(request.request_id)
            slots = [b * draft.blocks.block_size + i for b in table for i in range(draft.blocks.block_size)]
            landed["kv"] = draft.runner.kv_cache[:, slots[:num_tokens]].clone()
            adopt(request, num_tokens)
        draft.adopt = adopt_and_keep
        got = [t for line in c.stream(tokens, max_tokens=40) for t in line["outputs"][0]["token_ids"]]
        assert got == want
        d, p = c.d.worker.stats(), c.p.worker.stats()
        assert d.kv_landed == 1 and d.draft_prompt_tokens == 0 and 0 < d.draft_tokens_accepted <= d.draft_tokens
        assert p.draft_prompt_tokens == len(tokens)
        metrics = c.http.get(c.d.url + "/metrics").text
        assert 'pdserve_worker_draft_prompt_tokens{method="draft"} 0.0' in metrics
        c.wait_idle()
        for worker in (c.p.worker, c.d.worker):
            blocks = worker.engine.draft_model.blocks
            assert blocks.num_free_blocks == blocks.num_blocks

        def own() -> torch.Tensor:  # the decode worker's draft computing the prompt itself
            ((table, _, _),) = draft.compute_prompts([("reference", tokens)])
            bs = draft.blocks.block_size
            kv = draft.runner.kv_cache[:, [b * bs + i for b in table for i in range(bs)][: len(tokens)]].clone()
            draft.drop("reference")
            return kv
        # Each worker times its 4-bit products at load and picks, by rows, byte dot products or
        # panels (`layers/quant.py`): two loads may round differently, by ~1% of the KV's scale
        # (the KV of wrong tokens or positions differs by its whole scale)
        reference = c.d.worker.loop.call_and_wait(own)
        assert (landed["kv"] - reference).abs().max() <= 0.02 * reference.abs().max()


def test_draft_kv_is_not_shipped_between_different_drafts_nor_lost_with_a_failed_lease(tiny_llama, plain):
    """A prefill worker whose draft differs (8-bit weights, the decode worker's 4-bit) ships none:
    the decode worker computes it. A lease that fails (no prefill worker answers) hands its draft
    blocks back like the target's. The tokens are the colocated ones every time."""
    from tests.worker.cluster import Cluster

    tokens = PROMPTS[1]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    prefill = {"speculative": f"draft:{tiny_llama}", "draft_quantization": "int8"}
    decode = {"speculative": f"draft:{tiny_llama}", "draft_quantization": "int4"}
    with Cluster(tiny_llama, "tcp", prefill=prefill, decode=decode) as c:
        assert _stream(c, c.body(tokens, max_tokens=24)) == want
        d, p = c.d.worker.stats(), c.p.worker.stats()
        assert d.kv_landed == 1 and d.draft_prompt_tokens == len(tokens) and p.draft_prompt_tokens == 0
        gone = {**c.body(tokens, max_tokens=24), "prefill_url": "http://127.0.0.1:9"}  # nobody listens there
        assert _stream(c, gone) == want
        assert c.d.worker.stats().kv_recomputed == 1
        c.wait_idle()
        blocks = c.d.worker.engine.draft_model.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
