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
    (dict(max_tokens=0), r"max_tokens must be an integer in \[1, "),
    (dict(temperature=-0.5), r"temperature must be a number in \[0, 100\]"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), r"n must be an integer in \[1, "),
    (dict(n=True), "n must be an integer"),
    (dict(stop=[""]), "stop strings must not be empty"),
    (dict(stop=[1, 2]), "stop must be a string or a list of strings"),
    (dict(stop={"a": 1}), "stop must be a string or a list of strings"),
    (dict(stop=["x"] * 17), "at most 16 stop strings"),
    (dict(stop=["x" * 257]), "at most 256 characters"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be non-negative integers"),
    (dict(stop_token_ids=list(range(65))), "at most 64 stop_token_ids"),
    (dict(seed=-1), r"seed must be an integer in \[0, 9223372036854775807\]"),
    (dict(seed=1 << 64), "seed must be an integer"),
    (dict(top_k=1 << 40), "top_k"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
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
