"""Read a GGUF file (llama.cpp's format) into a `Checkpoint`.

A GGUF carries what a Hugging Face directory does, under llama.cpp's names: the config as `{arch}.*`
metadata, the tokenizer as `tokenizer.ggml.*` arrays, the weights in quantized blocks. We dequantize
to float32 and undo what llama.cpp's convert script changed, so the result is what transformers
builds from the same file (`from_pretrained(dir, gguf_file=...)`):
1. tensor names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...;
2. Llama's q/k rows: the script reorders each head's rotary halves into llama.cpp's interleaved
   pairs (Qwen2 is left alone);
3. the tokenizer: rebuilt by `gguf_tokenizer`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from pdserve.models.checkpoint import Checkpoint
from pdserve.models.gguf_tokenizer import build_gguf_tokenizer

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> Hugging Face class; flags as in `arch_config`.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

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
}
# llama.cpp's precomputed Llama 3 rope factors; folded back into `rope_scaling` instead.
_ROPE_FREQS = "rope_freqs.weight"

def load_gguf(path: str | Path) -> Checkpoint:
    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts GGUF models are not supported")
    tokenizer = build_gguf_tokenizer(meta)
    hf_config = _hf_config(meta, arch, {t.name: t for t in reader.tensors})
    tensors = _read_tensors(reader.tensors, arch, hf_config)
    generation_config = {
        key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config
    }
    return Checkpoint(hf_config, tensors, tokenizer, generation_config)


# ---- config ----


def _hf_config(meta: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    def key(name: str) -> Any:
        try:
            return meta[f"{arch}.{name}"]
        except KeyError:
            raise ValueError(f"GGUF metadata is missing {arch}.{name}") from None

    hidden, heads = key("embedding_length"), key("attention.head_count")
    # Stated only when it is not hidden / heads (Mistral Nemo, for one).
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    # A padded embedding has more rows (its last GGUF dimension) than the tokenizer has tokens.
    vocab_size = max(len(meta["tokenizer.ggml.tokens"]), int(tensors["token_embd.weight"].shape[-1]))
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        # llama.cpp writes an output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    # transformers 4's layout, as `synthetic` writes it: every transformers release reads it alike.
    if (scaling := _rope_scaling(meta, arch, tensors.get(_ROPE_FREQS), head_dim)) is not None:
        cfg["rope_scaling"] = scaling
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        if (token_id := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            cfg[hf_key] = token_id
    # llama.cpp also stops on end-of-turn / end-of-message tokens; Hugging Face lists them as eos ids.
    stops = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    if len(stops) > 1:
        cfg["eos_token_id"] = stops
    return cfg


def _rope_scaling(
    meta: dict[str, Any], arch: str, rope_freqs: ReaderTensor | None, head_dim: int
) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind not in ("none", ""):  # yarn and friends: passed on for the model config to accept or refuse
        scaling = {"rope_type": kind, "factor": factor}
        return scaling | ({"original_max_position_embeddings": original} if original else {})
    if rope_freqs is None:
        return None
    theta = meta.get(f"{arch}.rope.freq_base", 10000.0)
    return _llama3_scaling(dequantize(rope_freqs.data, rope_freqs.tensor_type), theta, head_dim, original)


def _llama3_scaling(
    divisors: np.ndarray, theta: float, head_dim: int, original: int | None
) -> dict[str, Any]:
    """The `rope_scaling` llama.cpp turned into per-frequency divisors (`rope_freqs`).

    Only the factor survives in the tensor unambiguously, so we assume Meta's published Llama 3
    parameters for the rest and check that they reproduce every divisor.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": _f32(float(divisors.max())),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(original or 8192),
    }
    expected = _llama3_divisors(scaling, theta, head_dim)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4, atol=0):
        raise ValueError(f"GGUF {_ROPE_FREQS} does not match Llama 3 rope scaling; not supported")
    return scaling


def _llama3_divisors(s: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    # As llama.cpp's convert script computes them from a Llama 3 `rope_scaling`.
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    old, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    smooth = (old / wavelen - low) / (high - low)
    divisors = 1 / ((1 - smooth) / s["factor"] + smooth)
    divisors = np.where(wavelen < old / high, 1.0, divisors)
    return np.where(wavelen > old / low, s["factor"], divisors)


def _f32(value: float) -> float:
    # GGUF stores these as float32: 1e-5 comes back as 9.999999747378752e-06. The shortest decimal
    # that rounds to the same float32 is what the original config said, and computes identically.
    return float(str(np.float32(value)))


# ---- tensors ----


def _read_tensors(
    gguf_tensors: list[ReaderTensor], arch: str, cfg: dict[str, Any]
) -> dict[str, torch.Tensor]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for t in gguf_tensors:
        if t.name == _ROPE_FREQS:
            continue
        name = _hf_name(t.name)
        w = _dequantize(t)  # torch order: [out_features, in_features]
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = _unpermute_rotary(w, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = _unpermute_rotary(w, kv_heads)
        tensors[name] = torch.from_numpy(w)
    return tensors


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama/Qwen2 counterpart")


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


