"""Speculative decoding with prompt lookup: greedy output equal to decoding one token at a time,
drafts accepted where the output repeats, every KV block back in the pool after rejected drafts,
aborts and stops."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.engine.speculative import NgramProposer, accepted, speculates
from pdserve.engine.request import Request
from tests.factories import make_llm
from tests.worker.cluster import prompt


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    p = NgramProposer(num_tokens=3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], 10) == [4, 9, 1]  # the 3-gram [1, 2, 3] seen before
    assert p.propose([5, 6, 7, 5, 6, 8, 5, 6], 10) == [8, 5, 6]  # the latest occurrence wins
    assert p.propose([1, 2, 3, 4], 10) == []  # nothing repeats
    assert p.propose([7, 7, 7, 7], 2) == [7, 7]  # at most the limit
    assert p.propose([1, 2, 1, 2], 0) == []


def test_a_draft_keeps_what_the_model_agrees_with_and_its_own_next_choice():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted([4, 5, 6], [8, 5, 6, 7]) == [8]


def test_only_requests_decided_by_the_argmax_alone_speculate():
    def req(**kw) -> Request:
        return Request("r", [1, 2], SamplingParams(max_tokens=4, **kw), 16)

    assert speculates(req(temperature=0))
    assert not speculates(req(temperature=0.7))
    assert not speculates(req(temperature=0, presence_penalty=0.5))
    assert not speculates(req(temperature=0, logit_bias={3: 1.0}))
    assert not speculates(req(temperature=0, logprobs=1))


PROMPTS = [prompt(23, seed=1), prompt(40, seed=2), prompt(7, seed=3) * 4, prompt(60, seed=4)]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make_llm(tiny_llama)


@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_greedy_output_equals_decoding_one_token_at_a_time(tiny_llama, plain, num_tokens):
    """float32, tiny model: the drafts' logits come from a chunk over cached tokens where plain
    decoding computes them one at a time; the greedy tokens are the same. Several requests at once
    (a batch mixing verifying and plain rows), with stops on length."""
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    fast = make_llm(tiny_llama, speculative="ngram", num_speculative_tokens=num_tokens)
    free = fast.engine.block_manager.num_free_blocks
    got = [o.outputs[0].token_ids for o in fast.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    assert got == want
    scheduler = fast.engine.scheduler
    assert scheduler.num_drafted > 0 and 0 < scheduler.num_accepted <= scheduler.num_drafted
    assert fast.engine.block_manager.num_free_blocks == free  # rejected drafts' blocks came back


def test_stops_and_sampled_batch_mates_are_unchanged(tiny_llama, plain):
    """A stop token among accepted drafts ends the output there; sampled requests beside
    speculating ones keep their own tokens (seeded)."""
    greedy = SamplingParams(temperature=0, max_tokens=40)  # stops at the end of sequence if it comes
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = plain.generate(prompts, [greedy, seeded, greedy, seeded])
    fast = make_llm(tiny_llama, speculative="ngram")
    got = fast.generate(prompts, [greedy, seeded, greedy, seeded])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]


def test_an_aborted_speculating_request_leaves_no_block(tiny_llama):
    fast = make_llm(tiny_llama, speculative="ngram")
    engine = fast.engine
    free = engine.block_manager.num_free_blocks
    rid = engine.add_request(None, {"prompt_token_ids": PROMPTS[2]},
                             SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        engine.step()
    engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == free


def test_a_disaggregated_decode_worker_speculates_and_keeps_the_tokens(tiny_llama, plain):
    """1P1D over tcp: the prompt's KV comes from the prefill worker, the decode worker proposes and
    verifies; the tokens are the colocated ones, and both workers end with every block free."""
    from tests.worker.cluster import Cluster

    tokens = PROMPTS[2]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    with Cluster(tiny_llama, "tcp", decode={"speculative": "ngram"}) as c:
        got = [t for line in c.stream(tokens, max_tokens=40) for t in line["outputs"][0]["token_ids"]]
        assert got == want
        assert c.d.worker.stats().kv_landed == 1
        stats = c.d.worker.stats()
        assert 0 < stats.draft_tokens_accepted <= stats.draft_tokens
        assert "pdserve_worker_draft_tokens_accepted" in c.http.get(c.d.url + "/metrics").text
        c.wait_idle()
