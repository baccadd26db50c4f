"""What a GGUF file says about its model besides the weights: the Hugging Face config, the
tokenizer and the generation config. No torch: the router reads this much and nothing more.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pdserve.models.gguf_file import GgufFile, GgufTensorInfo, float_values

from pdserve.models.gguf_tokenizer import build_gguf_tokenizer
from pdserve.models.model_info import ModelInfo

# GGUF `general.architecture` -> Hugging Face class (and model type); flags as in `arch_config`.
# A "llama" file with experts is a Mixtral.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# Tokens llama.cpp ends a generation on by their text, whatever the file names (`llama-vocab.cpp`).
_END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
    "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>"})
# llama.cpp's precomputed Llama 3 rope factors; folded back into `rope_scaling` instead.
ROPE_FREQS = "rope_freqs.weight"


def read_gguf_info(gguf: GgufFile) -> ModelInfo:
    meta, path = gguf.metadata, gguf.path
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )
    if arch.endswith("moe") and not meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{path}: a {arch} GGUF file without {arch}.expert_count")
    tokenizer = build_gguf_tokenizer(meta)
    hf_config = _hf_config(meta, arch, gguf)
    generation_config = {
        key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config
    }
    return ModelInfo(hf_config, tokenizer, generation_config)


def _hf_config(meta: dict[str, Any], arch: str, gguf: GgufFile) -> dict[str, Any]:
    tensors = {t.name: t for t in gguf.tensors}
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
    moe = arch.endswith("moe")
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        # a MoE file's dense size may be left out when no layer is dense
        "intermediate_size": meta.get(f"{arch}.feed_forward_length") or key(
            "expert_feed_forward_length" if moe else "feed_forward_length"),
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
    if arch == "gemma3":
        cfg |= _gemma3(meta, key, hidden, heads, head_dim)
    elif arch != "llama":
        cfg["use_sliding_window"] = False
    cfg |= _experts(meta, arch, key)
    # transformers 4's layout, as `synthetic` writes it: every transformers release reads it alike.
    if (scaling := _rope_scaling(meta, arch, gguf, tensors.get(ROPE_FREQS), head_dim)) is not None:
        cfg["rope_scaling"] = scaling
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        if (token_id := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            cfg[hf_key] = token_id
    # llama.cpp also stops on end-of-turn / end-of-message tokens, named or found by their text
    # (Gemma's <end_of_turn>, whose file names none); Hugging Face lists them as eos ids.
    stops = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    tokens = meta["tokenizer.ggml.tokens"]
    stops += [i for i, text in enumerate(tokens) if text in _END_OF_GENERATION]
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    if len(stops) > 1:
        cfg["eos_token_id"] = stops
    return cfg


def _gemma3(meta: dict[str, Any], key, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's config fields, as llama.cpp runs the file: five sliding layers to each global one
    unless the file says otherwise, the sliding layers rotated by a base of 10000, queries scaled
    by head_dim ** -0.5 (the 27B model, 62 layers: hidden / heads)."""
    layers = key("block_count")
    scalar = hidden // heads if layers == 62 else head_dim
    cfg: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                           "query_pre_attn_scalar": scalar,
                           "rope_local_base_freq": _f32(meta.get("gemma3.rope.freq_base_swa", 10000.0))}
    if window := meta.get("gemma3.attention.sliding_window"):
        cfg["sliding_window"] = int(window)
        pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # a flag a layer: true where it slides
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            cfg["sliding_window_pattern"] = int(pattern)
            cfg["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                  for i in range(layers)]
    else:
        cfg["sliding_window"] = None
        cfg["layer_types"] = ["full_attention"] * layers
    if softcap := meta.get("gemma3.final_logit_softcapping"):
        cfg["final_logit_softcapping"] = _f32(softcap)  # refused by the architecture config
    return cfg


def _experts(meta: dict[str, Any], arch: str, key) -> dict[str, Any]:
    """A mixture of experts' config fields (none for a dense model), as llama.cpp runs the file."""
    count = meta.get(f"{arch}.expert_count", 0)
    if not count:
        return {}
    used = key("expert_used_count")
    if arch == "llama":  # Mixtral: every layer routed, the top-k weights renormalized
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": count,
                "num_experts_per_tok": used}
    # llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's, unless the file says
    cfg = {"num_experts": count, "num_experts_per_tok": used,
           "moe_intermediate_size": key("expert_feed_forward_length"),
           "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    if shared := meta.get(f"{arch}.expert_shared_feed_forward_length"):
        cfg["shared_expert_intermediate_size"] = shared
    return cfg


def _rope_scaling(
    meta: dict[str, Any], arch: str, gguf: GgufFile, rope_freqs: GgufTensorInfo | None, head_dim: int
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
    return _llama3_scaling(float_values(gguf, rope_freqs), theta, head_dim, original)


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
        raise ValueError(f"GGUF {ROPE_FREQS} does not match Llama 3 rope scaling; not supported")
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
