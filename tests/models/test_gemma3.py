"""Gemma 3 (text): tiny checkpoints made with transformers (two periods of local and global layers,
a window shorter than the prompts) computed token for token as transformers does, colocated and
disaggregated over every backend; and the same checkpoint written as llama.cpp lays out a
`gemma3` GGUF file (its names, its 1 + w norms, some tensors in blocks) computing as it does.
Prefill as a whole and in chunks, and continuous batching, are in test_llama_vs_hf.py and
tests/engine/test_generate_vs_hf.py, which run every tiny architecture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from pdserve import SamplingParams
from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import load_hf_dir
from tests.factories import make_llm, paged_logits
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

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_QUANTIZED = {"blk.0.attn_q.weight": GGMLQuantizationType.Q8_0, "blk.1.ffn_up.weight": GGMLQuantizationType.Q5_0,
              "blk.2.attn_output.weight": GGMLQuantizationType.Q4_0, "token_embd.weight": GGMLQuantizationType.Q8_0}


def _gemma_gguf(model_dir: Path, path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as llama.cpp's convert script writes it (norms as 1 + w, pattern and window
    in metadata; the tokenizer as a gpt2 vocabulary); returns the values the file holds, in
    Hugging Face names and form."""
    ckpt = load_hf_dir(model_dir)
    cfg, hf = ArchConfig.from_hf_config(ckpt.hf_config), ckpt.hf_config
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    w.add_sliding_window(cfg.sliding_window)
    w.add_uint32("gemma3.attention.sliding_window_pattern", 3)
    w.add_float32("gemma3.rope.freq_base_swa", cfg.local_rope_theta)
    vocab = ckpt.tokenizer.backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in json.loads(ckpt.tokenizer.backend.to_str())["model"]["merges"]])
    w.add_eos_token_id(hf["eos_token_id"])
    values: dict[str, torch.Tensor] = {}
    for name, t in ckpt.tensors.items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if name.startswith("model.layers."):
            gguf_name = f"blk.{layer}.{_NAMES[rest.removesuffix('.weight')]}.weight"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        data = t.numpy() + (np.float32(1.0) if name.endswith("norm.weight") else 0)
        if gguf_name in _QUANTIZED:
            kind = _QUANTIZED[gguf_name]
            blocks = quantize(data, kind)
            w.add_tensor(gguf_name, blocks, raw_dtype=kind)
            values[name] = torch.from_numpy(dequantize(blocks, kind).astype(np.float32))
        else:
            w.add_tensor(gguf_name, data)
            values[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def test_a_gemma3_gguf_computes_as_its_values(gemma, tmp_path):
    """The file's logits equal those of a Hugging Face checkpoint holding the file's values (the
    blocks expanded), whose own logits equal transformers' (test_llama_vs_hf): names, norms,
    window, pattern and both rotary bases read as llama.cpp reads them."""
    from pdserve.models.gguf_reader import load_gguf

    values = _gemma_gguf(gemma, tmp_path / "tiny.gguf")
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
