"""Tiny Hugging Face checkpoints written as llama.cpp lays them out in a GGUF file: its tensor names,
Llama's q/k rows permuted, Gemma's norms as 1 + w, chosen tensors in block formats (by the `gguf`
package's own quantizer), the tokenizer as a gpt2 vocabulary. Each writer returns the values the
file holds, under Hugging Face names and in their form."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import Checkpoint, load_hf_dir

_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma's four norms a layer: its "post attention" norm is the attention output's
_GEMMA_NAMES = _LAYER_NAMES | {"post_attention_layernorm": "post_attention_norm",
                               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert script does to Llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model_dir: Path, path: Path, quant: dict[str, GGMLQuantizationType]) -> dict[str, torch.Tensor]:
    """The tiny Llama at `model_dir` as a `llama` GGUF file at `path`, the GGUF tensors named in
    `quant` in those formats."""
    ckpt = load_hf_dir(model_dir)
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)
    w = _start(path, "llama", cfg, ckpt)
    heads = lambda name: cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads  # noqa: E731
    rotary = lambda name: name.endswith(("attn_q.weight", "attn_k.weight"))  # noqa: E731
    return _finish(w, _tensors(w, ckpt, _LAYER_NAMES, quant,
                               stored=lambda name, x: permute(x, heads(name)) if rotary(name) else x,
                               restored=lambda name, x: unpermute(x, heads(name)) if rotary(name) else x))


def write_gemma3_gguf(model_dir: Path, path: Path, quant: dict[str, GGMLQuantizationType],
                      pattern: int) -> dict[str, torch.Tensor]:
    """The tiny Gemma 3 at `model_dir` as a `gemma3` GGUF file, as llama.cpp's convert script writes
    it: norms as 1 + w, the window, every `pattern`th layer global, the sliding layers' rotary base
    and the global layers' linear scaling in metadata."""
    ckpt = load_hf_dir(model_dir)
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)
    w = _start(path, "gemma3", cfg, ckpt)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope_scaling.factor)
    w.add_sliding_window(cfg.sliding_window)
    w.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    w.add_float32("gemma3.rope.freq_base_swa", cfg.local_rope_theta)
    norm = lambda name: name.endswith("norm.weight")  # noqa: E731
    return _finish(w, _tensors(w, ckpt, _GEMMA_NAMES, quant,
                               stored=lambda name, x: x + np.float32(1.0) if norm(name) else x,
                               restored=lambda name, x: x))


def _start(path: Path, arch: str, cfg: ArchConfig, ckpt: Checkpoint) -> GGUFWriter:
    w = GGUFWriter(str(path), arch)
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
    return w


def _tensors(w: GGUFWriter, ckpt: Checkpoint, layer_names: dict[str, str], quant: dict[str, GGMLQuantizationType],
             stored: Callable[[str, np.ndarray], np.ndarray],
             restored: Callable[[str, np.ndarray], np.ndarray]) -> dict[str, torch.Tensor]:
    """Every tensor under its GGUF name as `stored` makes it (in a block format where `quant` says);
    the values the file then holds, back in Hugging Face's form by `restored`."""
    values: dict[str, torch.Tensor] = {}
    for name, t in ckpt.tensors.items():
        if name.startswith("model.layers."):
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{layer_names[rest.removesuffix('.weight')]}.weight"
        else:
            gguf_name = _GLOBAL_NAMES[name]
        data = stored(gguf_name, t.numpy())
        if gguf_name not in quant:
            w.add_tensor(gguf_name, data)
            values[name] = t
            continue
        blocks = quantize(data, quant[gguf_name])
        w.add_tensor(gguf_name, blocks, raw_dtype=quant[gguf_name])
        expanded = restored(gguf_name, dequantize(blocks, quant[gguf_name]).astype(np.float32))
        values[name] = torch.from_numpy(np.ascontiguousarray(expanded))
    return values


def _finish(w: GGUFWriter, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values
