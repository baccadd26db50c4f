"""Read a GGUF file (llama.cpp's format) into a `Checkpoint`.

A GGUF carries what a Hugging Face directory does, under llama.cpp's names: the config as `{arch}.*`
metadata, the tokenizer as `tokenizer.ggml.*` arrays, the weights in quantized blocks. We dequantize
to float32 and undo what llama.cpp's convert script changed, so the result is what transformers
builds from the same file (`from_pretrained(dir, gguf_file=...)`):
1. tensor names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...;
2. Llama's q/k rows: the script reorders each head's rotary halves into llama.cpp's interleaved
   pairs (Qwen2 is left alone);
3. the tokenizer: rebuilt from the vocabulary, merges and token types, with the pre-tokenizer the
   file's `tokenizer.ggml.pre` names. Where transformers does not know that name (SmolLM2's
   "smollm") it falls back to GPT-2's split; we split as llama.cpp and the original model do.
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
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from pdserve.models.checkpoint import Checkpoint
from pdserve.tokenizer import Tokenizer

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

# tokenizer_config.json name -> `tokenizer.ggml.{key}_token_id`.
_SPECIAL_TOKEN_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
# llama.cpp token types (`tokenizer.ggml.token_type`).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# How each `tokenizer.ggml.pre` splits text before byte-level BPE, as llama.cpp does it. Names not
# listed (and "default", "gpt-2") use GPT-2's split, which `ByteLevel(use_regex=True)` applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}
# These isolate every digit first, then split the rest the GPT-2 way.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_SPLIT = {"default", "gpt-2", "gpt2"}


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
    tokenizer = _build_tokenizer(meta)
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


# ---- tokenizer ----


def _build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    ids = {name: meta.get(f"tokenizer.ggml.{key}_token_id") for name, key in _SPECIAL_TOKEN_KEYS.items()}
    special = {name: tokens[i] if i is not None and i < len(tokens) else None for name, i in ids.items()}
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre", "default"))
        add_bos_default = False
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        backend = _sentencepiece_bpe(tokens, scores, merges, special["unk_token"], add_prefix)
        add_bos_default = True  # llama.cpp adds BOS to sentencepiece vocabularies unless told not to
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    _add_special_tokens(backend, tokens, types, {t for t in special.values() if t is not None})

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None
    backend.post_processor = _post_processor(backend, bos, eos)
    config: dict[str, Any] = {
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return Tokenizer(backend, config)


def _add_special_tokens(backend: _HFTokenizer, tokens: list[str], types: list[int], named: set[str]) -> None:
    # Control tokens (and the named ones: bos, eos, ...) match whole and are skipped on decode.
    # Byte-level vocabularies respell a token with characters outside the byte alphabet, so its
    # plain form is not in the vocabulary: llama.cpp mislabelled it, and no text can reach it.
    vocab = backend.get_vocab()
    special = [t for t, ty in zip(tokens, types) if (ty in (_CONTROL, _UNKNOWN) or t in named) and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) 
                                for t in dict.fromkeys(special)])
    # User-defined tokens (like `<think>`) also match whole in llama.cpp, but are ordinary text.
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in dict.fromkeys(user)])


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, ...]], pre: str) -> _HFTokenizer:
    # Byte-level vocabularies spell every byte as a printable character; a token written in plain
    # text (llama.cpp does that for some added tokens) is respelled so the BPE model can find it.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()) for t in tokens]
    backend = _HFTokenizer(models.BPE({t: i for i, t in enumerate(spelled)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT:
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        if pre not in _GPT2_SPLIT:
            logger.warning("GGUF pre-tokenizer %r is unknown; splitting text the GPT-2 way", pre)
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], merges: list[tuple[str, ...]], unk: str | None, add_prefix: bool
) -> _HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = merges or _merges_from_scores(tokens, scores, vocab)
    backend = _HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # A space goes in front of the text, and every space becomes "▁", as sentencepiece does.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    # Sentencepiece ranks whole tokens by score, not merges. Every split of a token into two known
    # pieces becomes a merge ranked by the token's score, ties broken as transformers does.
    ranked: list[tuple[str, str, float]] = []
    for tok, score in dict(zip(tokens, scores)).items():
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked += [(left, right, score) for left, right in pairs]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _post_processor(backend: _HFTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    single = (f"{bos}:0 " if bos else "") + "$A:0" + (f" {eos}:0" if eos else "")
    pair = single + (f" {bos}:1" if bos else "") + " $B:1" + (f" {eos}:1" if eos else "")
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte alphabet: printable bytes stand for themselves, the rest move up past U+00FF.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    spelling = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + extra)
    return spelling
