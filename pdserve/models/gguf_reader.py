"""Read a GGUF file (llama.cpp's format) into a `Checkpoint`.

A GGUF carries what a Hugging Face directory does, under llama.cpp's names: the config as `{arch}.*`
metadata, the tokenizer as `tokenizer.ggml.*` arrays, the weights in quantized blocks. Matmul
weights in a block format pdserve serves (`layers/block_formats.py`) stay in their file's bytes
(`Checkpoint.blocks`, views of the mapped file: nothing is converted at load); other tensors are
read as float32, and what llama.cpp's convert script changed is undone, so that the values are
what transformers builds from the same file (`from_pretrained(dir, gguf_file=...)`):
1. tensor names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...; a mixture
   of experts' stacked experts (`ffn_gate_exps` [experts, intermediate, hidden], `ffn_up_exps`,
   `ffn_down_exps`) -> `mlp.experts.gate_up_proj` (gate and up side by side) and `down_proj`
   (expanded to float32: the experts' products run on `QuantizedWeight`s or dense ones);
2. Llama's q/k rows: the script reorders each head's rotary halves into llama.cpp's interleaved
   pairs (Qwen2 and Gemma are left alone); blocks are whole rows, so their rows move back as bytes;
3. Gemma's norms: the script stores 1 + w; the checkpoint holds w, as Hugging Face's;
4. the tokenizer: rebuilt by `gguf_tokenizer`.
Every tensor's type is checked before any is read: a file with a type neither served nor
expandable is refused whole, naming the tensor, its type and what is supported.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pdserve.layers.block_formats import FLOAT_TYPES, FORMATS, StoredBlocks
from pdserve.models.checkpoint import Checkpoint
from pdserve.models.gguf_file import GgufFile, GgufTensorInfo, float_values, type_name
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
# Gemma's four norms a layer: its "post attention" norm is the attention output's
_GEMMA_LAYER_TENSORS = _LAYER_TENSORS | {"post_attention_norm": "post_attention_layernorm",
                                         "ffn_norm": "pre_feedforward_layernorm",
                                         "post_ffw_norm": "post_feedforward_layernorm"}
# Stacked experts: parameter names of their own (no `.weight`); gate and up go into one tensor.
_EXPERT_TENSORS = {"ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
                   "ffn_down_exps": "mlp.experts.down_proj"}
_PERMUTED = ("llama", "mixtral")  # llama.cpp reorders these architectures' q/k rows
_NORM_SHIFTED = ("gemma3",)  # llama.cpp stores these architectures' norms as 1 + w
# The tensors a product multiplies by (kept in their blocks); a router's stays float: its logits pick experts.
_MATMUL_TENSORS = {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                   "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}

# Quantization types whose values `layers/quant.py` reproduces exactly from the dequantized weights:
# the stacked experts' (expanded at load), and any expanded for tensor parallel ranks, are quantized
# again by that rule.
_SERVED_AS_STORED = {GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}


def load_gguf(path: str | Path) -> Checkpoint:
    with GgufFile(path) as gguf:  # the blocks' views keep the mapping after close
        info = read_gguf_info(gguf)
        arch = gguf.metadata["general.architecture"]
        _check_types(gguf)
        names = {t.name: _hf_name(t.name, arch) for t in gguf.tensors if t.name != ROPE_FREQS}
        kept = [t for t in gguf.tensors if t.name in names and _kept_in_blocks(t)]
        expanded = [t for t in gguf.tensors if t.name in names and not _kept_in_blocks(t)]
        blocks = {names[t.name]: _blocks(gguf, t, names[t.name], arch, info.hf_config) for t in kept}
        tensors = _read_tensors(gguf, expanded, names, arch, info.hf_config)
    # HF name -> the bits its GGUF tensors' values re-quantize to exactly (stacked gate and up: two);
    # blocks too, for where they are expanded (tensor parallel ranks serve those bits)
    stored: dict[str, set] = {}
    for t in kept + expanded:
        stored.setdefault(names[t.name], set()).add(_SERVED_AS_STORED.get(t.type))
    bits = {name: next(iter(b)) for name, b in stored.items() if len(b) == 1 and None not in b}
    return Checkpoint(info.hf_config, tensors, info.tokenizer, info.generation_config, bits, blocks)


def matmul_tensor_bytes(path: str | Path) -> int:
    """The bytes of a GGUF file's matmul weights as it stores them (the head's table once): what a
    decode step that reads the file's own blocks reads of its weights."""
    with GgufFile(path) as gguf:
        tensors = gguf.tensors
    untied = any(t.name == "output.weight" for t in tensors)  # then the embedding is looked up, not multiplied
    return sum(int(t.n_bytes) for t in tensors
               if (_tensor_kind(t.name) in _MATMUL_TENSORS or _tensor_kind(t.name) in _EXPERT_TENSORS)
               and not (untied and t.name == "token_embd.weight"))


def _tensor_kind(gguf_name: str) -> str:  # "blk.3.attn_q.weight" -> "attn_q"; "output.weight" -> "output"
    stem = gguf_name.rpartition(".")[0]
    return stem.rpartition(".")[2] if stem.startswith("blk.") else stem


def _check_types(gguf: GgufFile) -> None:
    """Every tensor's type is served as stored, or expandable: checked before any is read."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    for t in gguf.tensors:
        if t.type in FLOAT_TYPES or t.type in FORMATS:
            continue
        try:
            kind = GGMLQuantizationType(t.type)
            dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except (KeyError, ValueError, NotImplementedError):
            served = ", ".join(["F32", "F16", "BF16", *(f.name for f in FORMATS.values())])
            raise ValueError(f"{gguf.path}: GGUF tensor {t.name!r} is stored as {type_name(t.type)}, which pdserve "
                             f"cannot read; supported: {served}") from None


def _kept_in_blocks(t: GgufTensorInfo) -> bool:
    return t.type in FORMATS and len(t.shape) == 2 and _tensor_kind(t.name) in _MATMUL_TENSORS


def _blocks(gguf: GgufFile, t: GgufTensorInfo, name: str, arch: str, cfg: dict[str, Any]) -> StoredBlocks:
    inputs, outputs = (int(n) for n in t.shape)  # GGUF lists dimensions fastest first
    with warnings.catch_warnings():  # a read-only view of the mapped file: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(gguf.data(t)).view(outputs, -1)
    blocks = StoredBlocks(FORMATS[t.type], (outputs, inputs), data)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    role = name.rpartition(".")[0].rpartition(".")[2]
    if arch in _PERMUTED and role in heads:
        order = _unpermute_rotary(np.arange(outputs), heads[role])
        blocks = blocks.rows(torch.from_numpy(order))
    return blocks


# ---- tensors ----


def _read_tensors(gguf: GgufFile, gguf_tensors: list[GgufTensorInfo], names: dict[str, str], arch: str,
                  cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[str, np.ndarray]] = {}  # gate_up_proj -> its gate and up parts
    for t in gguf_tensors:
        name = names[t.name]
        w = float_values(gguf, t)  # torch order: [out_features, in_features]
        if arch in _PERMUTED and ".self_attn.q_proj." in name:
            w = _unpermute_rotary(w, heads)
        elif arch in _PERMUTED and ".self_attn.k_proj." in name:
            w = _unpermute_rotary(w, kv_heads)
        elif name.endswith(".shared_expert_gate.weight") and w.ndim == 1:
            w = w.reshape(1, -1)  # llama.cpp stores the shared expert's gate as a vector
        elif arch in _NORM_SHIFTED and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        if name.endswith(".experts.gate_up_proj"):
            stacked.setdefault(name, {})["up" if "ffn_up_exps" in t.name else "gate"] = w
            continue
        tensors[name] = torch.from_numpy(w)
    for name, parts in stacked.items():
        if set(parts) != {"gate", "up"}:
            raise ValueError(f"GGUF file has the experts' {' and '.join(parts)} weights of {name!r} without the other")
        tensors[name] = torch.from_numpy(np.concatenate([parts["gate"], parts["up"]], axis=1))
    return tensors


def _hf_name(gguf_name: str, arch: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    layer_tensors = _GEMMA_LAYER_TENSORS if arch in _NORM_SHIFTED else _LAYER_TENSORS
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERT_TENSORS:
        return f"model.layers.{parts[1]}.{_EXPERT_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart pdserve knows")


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert script maps each head's rows (half, i) -> (i, half), turning Hugging Face's
    # rotate-half layout into adjacent pairs. Swap back. Works for weights and biases alike.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


