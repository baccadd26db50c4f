"""Structured outputs through the whole engine (llguidance's matchers): the output matches its
structure whatever the model would rather say (a tiny random model here), greedy and sampled;
the mask removes only what the structure forbids; a request resumed elsewhere continues inside
its structure; a structure that cannot be built is refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve import SamplingParams
from pdserve.engine.structured import mask_logits
from pdserve.sampling_params import Structure
from tests.factories import assert_engine_idle, make_llm

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "level", "count"], "additionalProperties": False}
STRUCTURES = {
    "json schema": (Structure("json", json.dumps(SCHEMA)),
                    lambda t: set(json.loads(t)) == {"ok", "level", "count"} and json.loads(t)["level"] in ("low", "high")),
    "json object": (Structure("json", '{"type": "object"}'), lambda t: isinstance(json.loads(t), dict)),
    "regex": (Structure("regex", r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    "choice": (Structure("choice", json.dumps(["yes", "no", "maybe so"])), lambda t: t in ("yes", "no", "maybe so")),
    "grammar": (Structure("grammar", 'start: "(" NUMBER ")"\nNUMBER: /[1-9][0-9]?/'),
                lambda t: re.fullmatch(r"\([1-9][0-9]?\)", t)),
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.mark.parametrize("kind", sorted(STRUCTURES))
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)])
def test_the_output_matches_its_structure(llm, kind, sampling):
    structure, matches = STRUCTURES[kind]
    params = SamplingParams(max_tokens=64, structure=structure, **sampling)
    for prompt in ("hello there", "a longer prompt that says nothing of JSON at all"):
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.finish_reason == "stop" and matches(out.text), (kind, out.text)
    assert_engine_idle(llm)


def test_the_mask_removes_only_what_the_structure_forbids(llm):
    structures = llm.engine.structures
    matcher = structures.matcher(STRUCTURES["choice"][0], [])
    logits = torch.randn(2, llm.engine.model_config.vocab_size)
    masked = mask_logits(logits, [(matcher, []), None])
    assert torch.equal(masked[1], logits[1])  # an unstructured row is untouched
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    tok = llm.get_tokenizer()
    assert allowed and all(any(c.startswith(tok.decode([t])) for c in ("yes", "no", "maybe so")) for t in allowed)
    assert torch.equal(masked[0, allowed], logits[0, allowed])


def test_a_resumed_request_continues_inside_its_structure(llm):
    structure, _ = STRUCTURES["json schema"]
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=64, structure=structure)
    full = llm.generate({"prompt_token_ids": [1, 2, 3]}, params)[0].outputs[0].token_ids
    engine = llm.engine
    for cut in (1, len(full) // 2):
        engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, params, output_token_ids=full[:cut])
        while engine.has_unfinished_requests():
            outs = engine.step()
        assert outs[-1].outputs[0].token_ids == full
    assert_engine_idle(llm)


@pytest.mark.parametrize("structure, fragment", [
    (Structure("regex", "(unclosed"), "regex structure is not valid"),
    (Structure("grammar", "start: undefined_rule"), "grammar structure is not valid"),
    (Structure("json", '{"type": "object", "properties": 5}'), "json structure is not valid"),
    (Structure("choice", '"not a list"'), "choice structure is not valid"),
])
def test_a_structure_that_cannot_be_built_is_refused_by_name(llm, structure, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.generate("x", SamplingParams(max_tokens=4, structure=structure))
    assert_engine_idle(llm)


def test_tokens_so_far_outside_the_structure_are_refused(llm):
    tok = llm.get_tokenizer()
    with pytest.raises(ValueError, match="tokens so far do not match"):
        llm.engine.add_request("r", "x", SamplingParams(structure=STRUCTURES["regex"][0]),
                               output_token_ids=tok.encode("abc", add_special_tokens=False))
    assert_engine_idle(llm)


def test_a_first_token_from_elsewhere_outside_the_structure_is_not_taken(tiny_llama):
    from pdserve.engine.llm_engine import LLMEngine
    from tests.factories import engine_config

    engine = LLMEngine(engine_config(tiny_llama, "decode"))
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=4, structure=STRUCTURES["regex"][0])
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, params, remote_prefill=True)
    engine.step()  # its blocks are reserved: it waits for its KV
    with pytest.raises(ValueError, match="outside the request's structure"):
        engine.kv_landed("r", tok.encode("x", add_special_tokens=False)[0])
    assert engine.kv_landed("r", tok.encode("5", add_special_tokens=False)[0])  # a digit: allowed
    while engine.has_unfinished_requests():
        engine.step()
