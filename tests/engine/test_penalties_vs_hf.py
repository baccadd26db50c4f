"""Penalties and biases through the whole engine, greedy, against transformers: its own
`repetition_penalty` and `sequence_bias` in `generate`, and, for OpenAI's frequency and presence
penalties (which transformers does not have), its logits step by step with the definitions
applied element by element in the test."""

from __future__ import annotations

import pytest
import torch

from pdserve import SamplingParams
from tests.factories import assert_engine_idle, make_llm
from tests.layers.test_penalties import reference as penalized

NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    # short prompts repeat few tokens; the long one repeats many, so the penalties have work to do
    return [torch.randint(0, 60, (n,), generator=g).tolist() for n in (3, 17, 40)]


def hf_generate(hf_model, prompt: list[int], **processors) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **processors)
    return out[0, len(prompt):].tolist()


def hf_step_by_step(hf_model, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].tolist()
            x = penalized(logits, params, prompt, out)
            out.append(max(range(len(x)), key=x.__getitem__))  # the first largest, as argmax
    return out


def ours(llm, prompt: list[int], **sampling) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
    return llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers(llm, hf_models, penalty):
    got = [ours(llm, p, repetition_penalty=penalty) for p in prompts()]
    assert got == [hf_generate(hf_models["llama"], p, repetition_penalty=penalty) for p in prompts()]
    assert got != [ours(llm, p) for p in prompts()]  # the penalty changed answers: the comparison means something
    assert_engine_idle(llm)


def test_logit_bias_matches_transformers_sequence_bias(llm, hf_models):
    for p in prompts():
        plain = hf_generate(hf_models["llama"], p)
        bias = {plain[0]: -100.0, plain[1]: 4.0}  # ban the first answer, favour the second
        expected = hf_generate(hf_models["llama"], p, sequence_bias={(t,): b for t, b in bias.items()})
        assert expected != plain  # the bias changed the answer: the comparison means something
        assert ours(llm, p, logit_bias=bias) == expected


@pytest.mark.parametrize("sampling", [dict(frequency_penalty=1.2), dict(presence_penalty=1.5),
                                      dict(frequency_penalty=-0.5, presence_penalty=0.8, repetition_penalty=1.2)])
def test_frequency_and_presence_penalties_follow_their_definitions(llm, hf_models, sampling):
    params = SamplingParams(**sampling)
    got = [ours(llm, p, **sampling) for p in prompts()]
    assert got == [hf_step_by_step(hf_models["llama"], p, params) for p in prompts()]
    assert got != [ours(llm, p) for p in prompts()]


def test_a_penalized_request_leaves_its_batch_mates_unchanged(llm):
    ps = prompts()
    alone = [ours(llm, p) for p in ps]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             **({"frequency_penalty": 2.0, "logit_bias": {5: 50.0}} if i == 1 else {}))
              for i in range(len(ps))]
    together = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    got = [o.outputs[0].token_ids for o in together]
    assert got[0] == alone[0] and got[2] == alone[2] and got[1] != alone[1]


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias names token id"):
        ours(llm, [1, 2, 3], logit_bias={vocab: 1.0})
    assert_engine_idle(llm)
