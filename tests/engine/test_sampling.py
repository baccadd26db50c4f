"""Sampling settings, stop strings and streamed text."""

import pytest
import torch
from tokenizers import pre_tokenizers

from pdserve import SamplingParams
from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.engine.model_runner import sampling_batch
from pdserve.engine.request import Request
from pdserve.layers.sampler import Sampler
from tests.factories import assert_engine_idle, make_llm

PROMPTS = ["the model token prefill", "東京 and 北京 🙂", "def return class import"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


def sample_texts(llm, params):
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(PROMPTS, params)]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    first = sample_texts(llm, params)
    assert sample_texts(llm, params) == first
    # alone instead of in a batch: same draws
    alone = llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids
    assert alone == first[1][0]
    other = sample_texts(llm, params.clone(seed=99))
    assert other != first
    assert_engine_idle(llm)


def test_n_completions_share_the_prompt(llm):
    outs = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True))
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert_engine_idle(llm)


def row_requests(params: SamplingParams, rows: int) -> list[Request]:
    return [Request(f"s{i}", [1], params, 10) for i in range(rows)]


def test_top_k_top_p_min_p_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    sampler = Sampler(seed=0)
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # p = .64, .23, ...: two reach .7
        (SamplingParams(temperature=1.0, min_p=0.3), {0, 1}),  # .23/.64 >= .3, .09/.64 < .3
        (SamplingParams(temperature=1.0), {0, 1, 2, 3, 4, 5}),
    ]:
        got = set(sampler(logits, sampling_batch(row_requests(params, 400), logits.device)))
        assert got <= allowed and len(got) >= min(2, len(allowed)), (params, got)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.randn(6, 50)
    reqs = [Request(f"m{i}", [1], SamplingParams(temperature=0 if i % 2 else 1.0), 10) for i in range(6)]
    got = Sampler(seed=0)(logits, sampling_batch(reqs, logits.device))
    for i in range(1, 6, 2):
        assert got[i] == int(logits[i].argmax())


def test_stop_string_cuts_text_exactly(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = base.text
    stop = text[5:8]
    assert len(stop) == 3 and stop not in text[:5 + 2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.text == text[: text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    inc = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0]
    assert inc.outputs[0].text == text[: text.index(stop) + len(stop)]
    assert_engine_idle(llm)


def test_token_ids_only_when_not_detokenizing(llm):
    """What a worker runs: the same tokens, no text (the router makes it)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_text = llm.generate(PROMPTS[0], params)[0].outputs[0]
    ids_only = llm.generate(PROMPTS[0], params.clone(detokenize=False))[0].outputs[0]
    assert ids_only.token_ids == with_text.token_ids and with_text.text
    assert ids_only.text == "" and ids_only.finish_reason == "length"
    assert_engine_idle(llm)


def test_one_completion_of_n_stops_while_the_others_go_on(llm):
    """A router that finds a completion's stop string stops that one only; stopping the last one
    ends the request, with its final output and every block back."""
    engine = llm.engine
    params = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True, detokenize=False)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    outs = engine.step()
    engine.stop_completion("r", 0)
    engine.stop_completion("r", 0)  # idempotent
    engine.stop_completion("r", 7)  # no such completion: nothing happens
    while engine.has_unfinished_requests():
        outs += engine.step()
    last = outs[-1].outputs
    assert outs[-1].finished and [c.finish_reason for c in last] == ["stop", "length", "length"]
    assert len(last[0].token_ids) < 3 and len(last[1].token_ids) == len(last[2].token_ids) == 20
    assert_engine_idle(llm)

    engine.add_request("s", {"prompt_token_ids": [5, 6, 7, 8]}, params.clone(n=2))
    outs = engine.step()
    engine.stop_completion("s", 1)
    engine.stop_completion("s", 0)  # the last one: the request ends now
    outs += engine.step()
    assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["stop", "stop"]
    assert not engine.has_unfinished_requests()
    assert_engine_idle(llm)


def test_streamed_deltas_rebuild_text_and_never_split_characters(llm):
    tok = llm.get_tokenizer()
    # Token ids that are single bytes of multi-byte characters make the decoder see partial UTF-8.
    byte_tokens = tok.encode("東京北京🙂✨ über")
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)
    engine.add_request("stream", {"prompt_token_ids": byte_tokens}, params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    c = final.outputs[0]
    assert "".join(deltas) == c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_engine_idle(llm)


def test_detokenizer_holds_back_incomplete_characters(tiny_llama):
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_llama)
    text = "a東🙂b"
    # one token per byte: byte-level BPE has a token for each of the 256 byte symbols
    symbols = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]
    ids = [tok.token_to_id(ch) for ch in symbols]
    assert None not in ids and tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.take_delta(finished=False))
    assert [p for p in pieces if p] == ["a", "東", "🙂", "b"]
