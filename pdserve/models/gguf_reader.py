"""Read a GGUF file (llama.cpp's format) into a `Checkpoint`.

A GGUF carries what a Hugging Face directory does, under llama.cpp's names: the config as `{arch}.*`
metadata, the tokenizer as `tokenizer.ggml.*` arrays, the weights in quantized blocks. We dequantize
to float32 and undo what llama.cpp's convert script changed, so the result is what transformers
builds from the same file (`from_pretrained(dir, gguf_file=...)`):
1. tensor names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...; a mixture
   of experts' stacked experts (`ffn_gate_exps` [experts, intermediate, hidden], `ffn_up_exps`,
   `ffn_down_exps`) -> `mlp.experts.gate_up_proj` (gate and up side by side) and `down_proj`;
2. Llama's q/k rows: the script reorders each head's rotary halves into llama.cpp's interleaved
   pairs (Qwen2 is left alone);
3. the tokenizer: rebuilt by `gguf_tokenizer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from pdserve.models.checkpoint import Checkpoint
from pdserve.models.gguf_info import ROPE_FREQS, read_gguf_info

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts: parameter names of their own (no `.weight`); gate and up go into one tensor.
_EXPERT_TENSORS = {"ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
                   "ffn_down_exps": "mlp.experts.down_proj"}
_PERMUTED = ("llama", "mixtral")  # llama.cpp reorders these architectures' q/k rows

# Quantization types whose values `layers/quant.py` reproduces exactly from the dequantized weights.
_SERVED_AS_STORED = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}


def load_gguf(path: str | Path) -> Checkpoint:
    reader = GGUFReader(path)
    info = read_gguf_info(reader, path)
    tensors = _read_tensors(reader.tensors, info.hf_config["model_type"], info.hf_config)
    stored: dict[str, set] = {}  # HF name -> the bits of its GGUF tensors (stacked gate and up: two)
    for t in reader.tensors:
        if t.name != ROPE_FREQS:
            stored.setdefault(_hf_name(t.name), set()).add(_SERVED_AS_STORED.get(t.tensor_type))
    bits = {name: next(iter(b)) for name, b in stored.items() if len(b) == 1 and None not in b}
    return Checkpoint(info.hf_config, tensors, info.tokenizer, info.generation_config, bits)


# ---- tensors ----


def _read_tensors(
    gguf_tensors: list[ReaderTensor], arch: str, cfg: dict[str, Any]
) -> dict[str, torch.Tensor]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[str, np.ndarray]] = {}  # gate_up_proj -> its gate and up parts
    for t in gguf_tensors:
        if t.name == ROPE_FREQS:
            continue
        name = _hf_name(t.name)
        w = _dequantize(t)  # torch order: [out_features, in_features]
        if arch in _PERMUTED and ".self_attn.q_proj." in name:
            w = _unpermute_rotary(w, heads)
        elif arch in _PERMUTED and ".self_attn.k_proj." in name:
            w = _unpermute_rotary(w, kv_heads)
        elif name.endswith(".shared_expert_gate.weight") and w.ndim == 1:
            w = w.reshape(1, -1)  # llama.cpp stores the shared expert's gate as a vector
        if name.endswith(".experts.gate_up_proj"):
            stacked.setdefault(name, {})["up" if "ffn_up_exps" in t.name else "gate"] = w
            continue
        tensors[name] = torch.from_numpy(w)
    for name, parts in stacked.items():
        if set(parts) != {"gate", "up"}:
            raise ValueError(f"GGUF file has the experts' {' and '.join(parts)} weights of {name!r} without the other")
        tensors[name] = torch.from_numpy(np.concatenate([parts["gate"], parts["up"]], axis=1))
    return tensors


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERT_TENSORS:
        return f"model.layers.{parts[1]}.{_EXPERT_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama/Qwen2/MoE counterpart")


def _dequantize(t: ReaderTensor) -> np.ndarray:
    try:
        w = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {t.name!r} is stored as {t.tensor_type.name}, which gguf cannot dequantize"
        ) from None
    # GGUF lists dimensions fastest-first; the reader already hands the data over in torch order.
    expected = tuple(int(n) for n in reversed(t.shape))
    if w.shape != expected:
        raise ValueError(f"GGUF tensor {t.name!r} dequantized to shape {w.shape}, expected {expected}")
    # F32 comes back as a read-only view of the memory-mapped file.
    return w.copy() if t.tensor_type == GGMLQuantizationType.F32 else w.astype(np.float32, copy=False)


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert script maps each head's rows (half, i) -> (i, half), turning Hugging Face's
    # rotate-half layout into adjacent pairs. Swap back. Works for weights and biases alike.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


