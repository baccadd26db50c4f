"""Log-probabilities through the whole engine, against transformers' `log_softmax` of the same
tiny model in float32, position by position. Tolerance 1e-4: the two compute the same float32
logits in a different order of operations (paged attention, fused projections), which moves them by
~1e-5 on this model; a log-probability a rank apart differs by far more than that."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm

TOLERANCE = 1e-4


def hf_logprobs(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: the log-probabilities each generated token was drawn from."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + generated])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3, top_k=20),
                                      dict(temperature=0, frequency_penalty=1.0)])
@pytest.mark.parametrize("top", [0, 5])
def test_each_tokens_logprob_and_the_top_ones_are_the_models(llm, hf_models, sampling, top):
    prompt = [5, 17, 99, 3, 42, 8, 250, 11]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=top, **sampling)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    reference = hf_logprobs(hf_models["llama"], prompt, out.token_ids)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    for entry, row in zip(out.logprobs, reference):
        # the model's own distribution: penalties and sampling settings do not change the values
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=TOLERANCE)
        values, ids = row.topk(top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
        assert len(entry.top) == top and all(abs(float(row[t]) - lp) < TOLERANCE for t, lp in entry.top)
    assert_engine_idle(llm)


def test_streamed_deltas_add_up_to_the_whole(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, n=2, seed=1)
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, params)
    deltas: dict[int, list] = {0: [], 1: []}
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            for c in o.outputs:
                deltas[c.index] += c.delta_logprobs
            final = o
    assert all(c.logprobs == deltas[c.index] and len(c.logprobs) == 6 for c in final.outputs)


def test_no_logprobs_unless_asked(llm):
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert out.logprobs is None and out.delta_logprobs == []


@pytest.mark.parametrize("bad", [-1, 21, True, 2.5])
def test_a_count_out_of_bounds_is_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


@pytest.mark.parametrize("chunk", [7, 256])
def test_prompt_logprobs_are_the_models_in_every_chunk_and_never_from_the_cache(tiny_llama, hf_models, chunk):
    llm = make_llm(tiny_llama, max_num_batched_tokens=chunk)
    prompt = [5, 17, 99, 3, 42, 8, 250, 11, 5, 17, 99, 3, 9, 10, 77, 1, 2]
    with torch.no_grad():
        reference = torch.log_softmax(hf_models["llama"](torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):  # the second time its blocks are cached, and still computed for their values
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry.token_id == prompt[i]
            assert entry.logprob == pytest.approx(float(reference[i - 1, prompt[i]]), abs=TOLERANCE)
            assert [t for t, _ in entry.top] == reference[i - 1].topk(2).indices.tolist()
        assert out.num_cached_tokens == 0
    assert_engine_idle(llm)
