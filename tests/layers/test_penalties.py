"""Penalties and biases on the logits, against a reference written element by element from the
definitions (OpenAI's frequency and presence penalties, vLLM's repetition penalty, logit_bias)."""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.penalties import RowPenalties, apply_penalties
from pdserve.sampling_params import SamplingParams

VOCAB = 40


def reference(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    x = list(logits)
    for token, bias in p.logit_bias.items():
        x[token] += bias
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
    return x


CASES = {
    "logit_bias": SamplingParams(logit_bias={3: -100.0, 7: 5.5, 39: 0.25}),
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition below 1": SamplingParams(repetition_penalty=0.6),
    "frequency and presence": SamplingParams(frequency_penalty=0.8, presence_penalty=-0.4),
    "all of them": SamplingParams(logit_bias={2: 3.0}, repetition_penalty=1.3, frequency_penalty=-1.5,
                                  presence_penalty=2.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_penalty_follows_its_definition(case):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g) * 4
    prompt, output = [1, 2, 2, 9, 30], [2, 5, 5, 5, 11, 30]
    rows = [None, RowPenalties(CASES[case], prompt, output), None]
    out = apply_penalties(logits, rows)
    expected = reference(logits[1].tolist(), CASES[case], prompt, output)
    assert out[1].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # others bit for bit


def test_a_step_without_penalties_is_handed_back_untouched():
    logits = torch.randn(2, VOCAB)
    assert apply_penalties(logits, [None, None]) is logits


def test_the_first_token_has_no_output_to_count_but_the_prompt_counts_for_repetition():
    logits = torch.full((1, VOCAB), 2.0)
    out = apply_penalties(logits, [RowPenalties(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0,
                                                               presence_penalty=1.0), [4, 4], [])])
    assert out[0, 4] == 1.0 and out[0, 5] == 2.0  # only the prompt's token, and only by the repetition penalty


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=11.0), "repetition_penalty"),
    (dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={-2: 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"), (dict(logit_bias={i: 0.0 for i in range(301)}), "logit_bias"),
])
def test_a_value_out_of_bounds_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)
