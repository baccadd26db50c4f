"""Speculative decoding with prompt lookup: output equal to decoding one token at a time (greedy,
and seeded sampling with every setting that changes the distribution), the target distribution
kept where nothing is seeded, drafts accepted where the output repeats, every KV block back in
the pool after rejected drafts, aborts and stops."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from pdserve.engine.spec.ngram import NgramProposer
from pdserve.engine.spec.verify import speculates, verified
from pdserve.engine.request import Request
from tests.factories import assert_engine_idle, every_draft_verified, make_llm, make_speculating_llm
from tests.worker.cluster import prompt


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    p = NgramProposer(num_tokens=3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], 10) == [4, 9, 1]  # the 3-gram [1, 2, 3] seen before
    assert p.propose([5, 6, 7, 5, 6, 8, 5, 6], 10) == [8, 5, 6]  # the latest occurrence wins
    assert p.propose([1, 2, 3, 4], 10) == []  # nothing repeats
    assert p.propose([7, 7, 7, 7], 2) == [7, 7]  # at most the limit
    assert p.propose([1, 2, 1, 2], 0) == []


def test_a_draft_keeps_what_the_model_sampled_and_its_own_next_token():
    assert verified([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert verified([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert verified([4, 5, 6], [8, 5, 6, 7]) == [8]


def test_every_request_that_decodes_here_speculates_unless_it_opts_out():
    def req(remote_prefill: bool = False, **kw) -> Request:
        return Request("r", [1, 2], SamplingParams(max_tokens=4, **kw), 16, remote_prefill=remote_prefill)

    for kw in ({"temperature": 0}, {"temperature": 0.7, "seed": 3}, {"presence_penalty": 0.5},
               {"logit_bias": {3: 1.0}}, {"logprobs": 1}):
        assert speculates(req(**kw))
    assert not speculates(req(speculate=False))
    assert not speculates(req(remote_prefill=True))  # its KV is still on its way


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
    fast = make_speculating_llm(tiny_llama, num_speculative_tokens=num_tokens)
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
    fast = make_speculating_llm(tiny_llama)
    got = fast.generate(prompts, [greedy, seeded, greedy, seeded])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]


def test_an_aborted_speculating_request_leaves_no_block(tiny_llama):
    fast = make_speculating_llm(tiny_llama)
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


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_disaggregated_decode_worker_speculates_and_keeps_the_tokens(tiny_llama, plain, method):
    """1P1D over tcp: the prompt's KV comes from the prefill worker, the decode worker proposes and
    verifies; the tokens are the colocated ones, and both workers end with every block free."""
    from tests.worker.cluster import Cluster

    tokens = PROMPTS[2]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    with Cluster(tiny_llama, "tcp", decode={"speculative": method}) as c:
        every_draft_verified(c.d.worker.engine)
        got = [t for line in c.stream(tokens, max_tokens=40) for t in line["outputs"][0]["token_ids"]]
        assert got == want
        assert c.d.worker.stats().kv_landed == 1
        stats = c.d.worker.stats()
        assert 0 < stats.draft_tokens_accepted <= stats.draft_tokens and stats.speculative == method
        metrics = c.http.get(c.d.url + "/metrics").text
        assert f'pdserve_worker_draft_tokens_accepted{{method="{method}"}} {float(stats.draft_tokens_accepted)}' in metrics
        mean = 1 + stats.draft_tokens_accepted / stats.drafts
        assert f'pdserve_worker_draft_mean_accepted_length{{method="{method}"}} {mean}' in metrics
        c.wait_idle()


FEW = {5: 8.0, 6: 8.0}  # the tiny model's tokens are nearly uniform: these two make output repeat
SAMPLED = [
    SamplingParams(temperature=0.6, seed=5, logit_bias=FEW, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=6, top_k=20, top_p=0.9, logit_bias=FEW, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, min_p=0.1, presence_penalty=0.4, frequency_penalty=0.2,
                   logit_bias=FEW, logprobs=2, max_tokens=40, ignore_eos=True),
]
PENALIZED = SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={5: 2.0}, logprobs=3, max_tokens=40,
                           ignore_eos=True)


@pytest.mark.parametrize("params", [SAMPLED, [PENALIZED]], ids=["seeded", "penalized"])
def test_seeded_and_penalized_requests_give_the_tokens_they_give_without_speculation(tiny_llama, plain, params):
    """The drafts ahead of a position count as output for its penalties, and a seeded request's
    position j draws its generator's j-th next row: the tokens (and log-probabilities) are those of
    decoding one at a time, while drafts are accepted."""
    prompts = [{"prompt_token_ids": PROMPTS[2]}] * len(params)
    want = [o.outputs[0] for o in plain.generate(prompts, params)]
    fast = make_speculating_llm(tiny_llama, num_speculative_tokens=3)
    free = fast.engine.block_manager.num_free_blocks
    got = [o.outputs[0] for o in fast.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert fast.engine.scheduler.num_accepted > 0
    assert [e.token_id for e in got[-1].logprobs] == got[-1].token_ids
    for mine, theirs in zip(got[-1].logprobs, want[-1].logprobs, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    assert fast.engine.block_manager.num_free_blocks == free


def test_verifying_a_draft_keeps_the_target_distribution(plain):
    """Unseeded rows (the sampler's shared noise): the first token follows p0 and, where it is the
    draft, the second follows p1, so the pair is distributed as sampling twice would give it."""
    runner = plain.engine.runner
    p0 = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.8, 0.2, -0.6])
    p1 = torch.tensor([-0.5, 0.9, 0.3, 0.0, 1.1, -1.0, 0.4, 0.2])
    draft, rows = [5], 8000
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=1.3, max_tokens=8), 16) for i in range(rows)]
    positions = [(r, ahead) for r in requests for ahead in ([], draft)]
    logits = torch.stack([p0, p1]).repeat(rows, 1)
    tokens = runner.sample(logits, positions)
    kept = [verified(draft, tokens[2 * i : 2 * i + 2]) for i in range(rows)]
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=8).double()
    second = torch.bincount(torch.tensor([k[1] for k in kept if len(k) == 2]), minlength=8).double()
    assert all(len(k) == 2 for k in kept if k[0] == draft[0]) and all(len(k) == 1 for k in kept if k[0] != draft[0])
    # chi-square with 7 degrees of freedom exceeds 24.32 with probability 0.001
    assert chi_square(first, (p0 / 1.3).softmax(-1).double()) < 24.32
    assert chi_square(second, (p1 / 1.3).softmax(-1).double()) < 24.32
    assert chi_square(second, (p0 / 1.3).softmax(-1).double()) > 100  # the test can tell


def test_structured_requests_draft_only_what_their_structure_allows(tiny_llama, plain):
    """A draft is cut to the tokens the structure allows; the output matches the structure and is
    the one decoding without speculation gives."""
    from pdserve.sampling_params import Structure

    text = "abab" * 12
    structure = Structure("regex", "(ab)+")
    sp = SamplingParams(temperature=0, max_tokens=30, structure=structure)
    prompt_ids = plain.get_tokenizer().encode(text)
    want = plain.generate([{"prompt_token_ids": prompt_ids}], sp)[0].outputs[0]
    fast = make_speculating_llm(tiny_llama)
    free = fast.engine.block_manager.num_free_blocks
    got = fast.generate([{"prompt_token_ids": prompt_ids}], sp)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert fast.engine.scheduler.num_drafted > 0
    assert fast.engine.block_manager.num_free_blocks == free


def test_a_request_that_opts_out_is_never_drafted(tiny_llama, plain):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculate=False)
    fast = make_speculating_llm(tiny_llama)
    got = fast.generate([{"prompt_token_ids": PROMPTS[2]}], sp)[0].outputs[0].token_ids
    assert got == plain.generate([{"prompt_token_ids": PROMPTS[2]}], sp)[0].outputs[0].token_ids
    assert fast.engine.scheduler.num_drafted == 0


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_stop_strings_and_several_completions_end_where_they_end_without_speculation(tiny_llama, plain):
    """Several tokens land in one step: a stop string among them ends the text where decoding one
    token at a time would (the tokens past it dropped), and each of n seeded completions keeps its
    own tokens."""
    prompts = [{"prompt_token_ids": PROMPTS[2]}]
    free_text = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = free_text[len(free_text) // 2 : len(free_text) // 2 + 3]
    settings = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                SamplingParams(temperature=0.7, seed=9, n=3, logit_bias=FEW, max_tokens=30, ignore_eos=True)]
    fast = make_speculating_llm(tiny_llama)
    free = fast.engine.block_manager.num_free_blocks
    outputs = []
    for sp in settings:
        want = plain.generate(prompts, sp)[0].outputs
        got = fast.generate(prompts, sp)[0].outputs
        assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [(o.text, o.token_ids, o.finish_reason)
                                                                          for o in want]
        outputs.append(got)
    stopped, several = outputs
    assert stopped[0].finish_reason == "stop" and stopped[0].text == free_text[: free_text.index(stop)]
    assert len(several) == 3 and all(o.finish_reason == "length" for o in several)
    assert fast.engine.scheduler.num_accepted > 0
    assert fast.engine.block_manager.num_free_blocks == free


def test_the_suffix_index_drafts_the_clear_majority_follower_of_the_longest_known_tail():
    from pdserve.engine.spec.suffix import SuffixIndex

    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 4, 5, 7])
    index.add([9, 2, 3, 8])
    assert index.propose([0, 1, 2, 3], 3) == [4, 5]  # after 4, 5: 6 and 7 tie, no majority
    assert index.propose([7, 2, 3], 3) == [4, 5]  # tail [2, 3]: 4 twice, 8 once
    assert index.propose([5, 5], 3) == []
    small = SuffixIndex(capacity=5)
    small.add(list(range(40)))
    assert len(small.counts) == 5 and small.propose([37, 38], 2) == [39]  # the latest kept


def test_suffix_decoding_drafts_what_an_earlier_request_wrote(tiny_llama, plain):
    """A second request with the same question: prompt lookup has little to go on, the suffix
    index has the first answer; the tokens are those of decoding one at a time either way."""
    prompts = [{"prompt_token_ids": PROMPTS[3]}]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate(prompts, sp)[0].outputs[0].token_ids
    kept = {}
    for method in ("ngram", "suffix"):
        fast = make_speculating_llm(tiny_llama, speculative=method)
        assert fast.generate(prompts, sp)[0].outputs[0].token_ids == want
        before = fast.engine.scheduler.num_accepted
        assert fast.generate(prompts, sp)[0].outputs[0].token_ids == want
        kept[method] = fast.engine.scheduler.num_accepted - before
        assert_engine_idle(fast)
    assert kept["suffix"] >= 30 > kept["ngram"]
