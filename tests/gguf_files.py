"""Tiny Hugging Face checkpoints written as llama.cpp lays them out in a GGUF file: its tensor names,
Llama's q/k rows permuted, chosen tensors in block formats (by the `gguf` package's own quantizer),
the tokenizer as a gpt2 vocabulary. Returns the values the file holds, under Hugging Face names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import load_hf_dir

_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert script does to Llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model_dir: Path, path: Path, quant: dict[str, GGMLQuantizationType]) -> dict[str, torch.Tensor]:
    """The tiny Llama at `model_dir` as a `llama` GGUF file at `path`, the GGUF tensors named in
    `quant` in those formats."""
    ckpt = load_hf_dir(model_dir)
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    vocab = ckpt.tokenizer.backend.get_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_merges([" ".join(m) for m in json.loads(ckpt.tokenizer.backend.to_str())["model"]["merges"]])
    w.add_eos_token_id(ckpt.hf_config["eos_token_id"])
    values: dict[str, torch.Tensor] = {}
    for name, t in ckpt.tensors.items():
        data = t.numpy()
        if name.startswith("model.layers."):
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            role = rest.removesuffix(".weight")
            gguf_name = f"blk.{layer}.{_LAYER_NAMES[role]}.weight"
            if role in ("self_attn.q_proj", "self_attn.k_proj"):
                data = permute(data, cfg.num_heads if role == "self_attn.q_proj" else cfg.num_kv_heads)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if gguf_name in quant:
            blocks = quantize(data, quant[gguf_name])
            w.add_tensor(gguf_name, blocks, raw_dtype=quant[gguf_name])
            expanded = dequantize(blocks, quant[gguf_name]).astype(np.float32)
            if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):  # back to Hugging Face's rows
                heads = cfg.num_heads if "attn_q" in gguf_name else cfg.num_kv_heads
                expanded = _unpermute(expanded, heads)
            values[name] = torch.from_numpy(np.ascontiguousarray(expanded))
        else:
            w.add_tensor(gguf_name, data)
            values[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
