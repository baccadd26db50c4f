"""Gemma 3 (text): tiny checkpoints made with transformers (two periods of local and global layers,
a window shorter than the prompts) computed token for token as transformers does, colocated and
disaggregated over every backend; and the same checkpoint written as llama.cpp lays out a
`gemma3` GGUF file (its names, its 1 + w norms, some tensors in blocks) computing as it does.
Prefill as a whole and in chunks, and continuous batching, are in test_llama_vs_hf.py and
tests/engine/test_generate_vs_hf.py, which run every tiny architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from pdserve import SamplingParams
from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import load_hf_dir
from tests.factories import make_llm, paged_logits
from tests.gguf_files import write_gemma3_gguf
from tests.worker.cluster import CASES, Cluster, prompt

LENGTHS = [3, 7, 8, 9, 15, 23, 40, 61]  # around the window of 8 and its blocks


@pytest.fixture(scope="module")
def gemma(tiny_models) -> Path:
    return tiny_models["gemma3"]


def greedy(llm, prompts: list[list[int]], n: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_the_layers_slide_as_configured(gemma):
    cfg = ArchConfig.from_hf_config(load_hf_dir(gemma).hf_config)
    assert cfg.sliding_window == 8 and cfg.sliding_layers == (0, 1, 3, 4)
    assert cfg.local_rope_theta == 100.0 and cfg.rope_theta == 1_000_000.0 and cfg.rope_scaling.factor == 2.0
    assert cfg.attention_scale == 24**-0.5 and cfg.activation == "gelu_tanh" and cfg.norm_offset == 1.0


@pytest.mark.parametrize("backend", CASES)
def test_disaggregated_equals_colocated(gemma, hf_models, backend):
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    colocated = make_llm(gemma, block_size=4)
    expected = greedy(colocated, prompts)
    hf = hf_models["gemma3"]
    with torch.no_grad():  # the colocated engine is transformers' own greedy text
        for p, tokens in zip(prompts[-2:], expected[-2:]):
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, pad_token_id=0)
            assert out[0, len(p):].tolist() == tokens
    # prefill chunks of 32 tokens, blocks of 4 on prefill and 8 on decode: a window of 8 spans both
    with Cluster(gemma, backend) as c:
        assert c.generate_many(prompts, max_tokens=10) == expected
        c.wait_idle()
        stats = c.d.worker.stats()
        assert stats.kv_landed == len(prompts) and stats.kv_recomputed == 0


# ---- the same checkpoint as a gemma3 GGUF file ----

_QUANTIZED = {"blk.0.attn_q.weight": GGMLQuantizationType.Q8_0, "blk.1.ffn_up.weight": GGMLQuantizationType.Q5_0,
              "blk.2.attn_output.weight": GGMLQuantizationType.Q4_0, "token_embd.weight": GGMLQuantizationType.Q8_0}


def test_a_gemma3_gguf_computes_as_its_values(gemma, tmp_path):
    """The file's logits equal those of a Hugging Face checkpoint holding the file's values (the
    blocks expanded), whose own logits equal transformers' (test_llama_vs_hf): names, norms,
    window, pattern and both rotary bases read as llama.cpp reads them."""
    from pdserve.models.gguf_reader import load_gguf

    values = write_gemma3_gguf(gemma, tmp_path / "tiny.gguf", _QUANTIZED, pattern=3)
    ckpt = load_gguf(tmp_path / "tiny.gguf")
    ours, theirs = ArchConfig.from_hf_config(ckpt.hf_config), ArchConfig.from_hf_config(load_hf_dir(gemma).hf_config)
    for field in ("sliding_window", "sliding_layers", "local_rope_theta", "rope_theta", "rope_scaling",
                  "activation", "norm_offset", "head_dim", "embedding_multiplier"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.attention_scale == ours.head_dim**-0.5  # a file has no query_pre_attn_scalar: llama.cpp's rule
    assert {n: b.format.name for n, b in ckpt.blocks.items()} == {
        "model.layers.0.self_attn.q_proj.weight": "Q8_0", "model.layers.1.mlp.up_proj.weight": "Q5_0",
        "model.layers.2.self_attn.o_proj.weight": "Q4_0", "model.embed_tokens.weight": "Q8_0"}
    for name, t in ckpt.float_tensors().items():  # norms back to w: exact up to float32 rounding of (1 + w) - 1
        torch.testing.assert_close(t, values[name], atol=1e-7, rtol=0, msg=name)
    reference = load_hf_dir(gemma)
    reference.tensors = values
    reference.hf_config["query_pre_attn_scalar"] = ours.head_dim
    reference.save(tmp_path / "values")
    p = prompt(30, seed=2)
    for quantization in ("none", "auto"):  # expanded, and the blocks as stored
        ours, _ = paged_logits(make_llm(tmp_path / "tiny.gguf", quantization=quantization), p, num_decode_steps=4)
        theirs, _ = paged_logits(make_llm(tmp_path / "values"), p, num_decode_steps=4)
        tolerance = 1e-4 if quantization == "none" else 5e-2  # "auto": activations quantized to 8 bits
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)
