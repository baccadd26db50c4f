"""Bad input gets a ValueError that says what is wrong, and leaves nothing behind."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig, parse_size
from tests.factories import assert_engine_idle, make_llm


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_model_len=64)


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": list(range(1, 65))}, "maximum length is 64"),
    ("word " * 200, "maximum length is 64"),
    ({"prompt_token_ids": [1, 2, 100000]}, "outside the vocabulary"),
    ({"prompt_token_ids": "1 2 3"}, "list of integers"),
    (42, "a prompt is"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert_engine_idle(llm)


def test_bad_prompt_in_a_batch_leaves_no_request_behind(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", "also fine", ""], SamplingParams(max_tokens=2))
    assert_engine_idle(llm)
    assert llm.generate("fine again", SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n must be at least 1"),
    (dict(stop=[""]), "stop strings must not be empty"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": list(range(1, 60))},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert_engine_idle(llm)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_bad_engine_settings(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_llama), dtype="int3")
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(model="x", block_size=3)
    with pytest.raises(ValueError, match="memory size"):
        parse_size("lots")
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(str(tiny_llama), kv_cache_mem="1GiB")
    with pytest.raises(ValueError, match="not a model directory"):
        LLM(str(tmp_path))
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("512MiB") == 512 << 20
