"""Deterministic random-weight models in Hugging Face format, with a tokenizer trained locally.

`tiny` is for unit tests (well under 5 MB); `demo` (~100M parameters) makes a long prefill real
compute on a CPU. Same seed, same files: tests and benchmarks need no download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pdserve.models.checkpoint import Checkpoint
from pdserve.models.presets import ARCHITECTURES, EXPERT_SIZES, PRESETS
from pdserve.tokenizer import Tokenizer


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her she there been one all we their has would when if so no will more can out up "
    "model token prefill decode cache block batch request latency throughput server router worker "
    "attention layer memory transfer queue schedule sample stream text prompt answer question "
    "def return class import self print for while if else elif try except with lambda yield "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = == != < > ( ) [ ] { } : ; , . ' \" # @ "
    "über café naïve façade 東京 北京 上海 日本語 中文 한국어 русский ελληνικά 🙂 🚀 ✨ "
)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on a built-in corpus, padded with reserved tokens."""
    words = _CORPUS_WORDS.split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 64, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_special_tokens(reserved)
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    return Tokenizer(tok, config)


def make_model(preset: str = "tiny", architecture: str = "llama", seed: int = 0, **overrides: Any) -> Checkpoint:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(ARCHITECTURES)}")
    # transformers 4's layout (top-level rope_theta / rope_scaling, torch_dtype): transformers 5 reads
    # it as well, while releases before 5 know nothing of its `rope_parameters` and would drop a scaling.
    cfg: dict[str, Any] = {
        **PRESETS[preset], **ARCHITECTURES[architecture],
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    cfg.update({key: int(share * cfg["intermediate_size"]) for key, share in EXPERT_SIZES.get(architecture, {}).items()})
    cfg.update(overrides)
    # Stated even when it is hidden / heads: left out, Qwen3 means 128.
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    tokenizer = build_tokenizer(cfg["vocab_size"])
    eos = tokenizer.token_to_id("<|im_end|>")
    cfg.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.token_to_id("<|endoftext|>"))
    tensors = _random_tensors(cfg, seed)
    return Checkpoint(cfg, tensors, tokenizer, {"eos_token_id": eos})


def write_model(out_dir: str | Path, preset: str = "tiny", architecture: str = "llama", seed: int = 0,
                **overrides: Any) -> Path:
    out = Path(out_dir)
    make_model(preset, architecture, seed, **overrides).save(out)
    return out


def _random_tensors(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    gemma = cfg["architectures"][0] == "Gemma3ForCausalLM"

    def norm_weight(size: int) -> torch.Tensor:  # near 1, but not exactly: a wrong norm shows
        return (0.0 if gemma else 1.0) + 0.1 * torch.randn(size, generator=g)  # Gemma scales by 1 + w

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = normal(heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = normal(kv_heads * hd, h)
        t[p + "self_attn.v_proj.weight"] = normal(kv_heads * hd, h)
        t[p + "self_attn.o_proj.weight"] = normal(h, heads * hd)
        if cfg["architectures"][0] in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or cfg.get("attention_bias"):
            t[p + "self_attn.q_proj.bias"] = normal(heads * hd)
            t[p + "self_attn.k_proj.bias"] = normal(kv_heads * hd)
            t[p + "self_attn.v_proj.bias"] = normal(kv_heads * hd)
        if cfg["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
            t[p + "self_attn.q_norm.weight"] = norm_weight(hd)
            t[p + "self_attn.k_norm.weight"] = norm_weight(hd)
        t.update(_mlp_tensors(cfg, i, normal))
        t[p + "input_layernorm.weight"] = norm_weight(h)
        t[p + "post_attention_layernorm.weight"] = norm_weight(h)
        if gemma:
            t[p + "pre_feedforward_layernorm.weight"] = norm_weight(h)
            t[p + "post_feedforward_layernorm.weight"] = norm_weight(h)
    t["model.norm.weight"] = norm_weight(h)
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = normal(v, h)
    return t


def _mlp_tensors(cfg: dict[str, Any], layer: int, normal) -> dict[str, torch.Tensor]:
    """Layer `layer`'s MLP: dense, or routed experts named as the released checkpoints name them."""
    h = cfg["hidden_size"]
    arch = cfg["architectures"][0]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    sparse = (experts and layer not in cfg.get("mlp_only_layers", [])
              and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
    p = f"model.layers.{layer}."
    if not sparse:
        return _gated(f"{p}mlp.", h, cfg["intermediate_size"], normal)
    if arch == "MixtralForCausalLM":
        t = {f"{p}block_sparse_moe.gate.weight": normal(experts, h)}
        for j in range(experts):
            t.update(_gated(f"{p}block_sparse_moe.experts.{j}.", h, cfg["intermediate_size"], normal,
                            ("w1", "w3", "w2")))
        return t
    t = {f"{p}mlp.gate.weight": normal(experts, h)}
    for j in range(experts):
        t.update(_gated(f"{p}mlp.experts.{j}.", h, cfg["moe_intermediate_size"], normal))
    if cfg.get("shared_expert_intermediate_size"):
        t.update(_gated(f"{p}mlp.shared_expert.", h, cfg["shared_expert_intermediate_size"], normal))
        t[f"{p}mlp.shared_expert_gate.weight"] = normal(1, h)
    return t


def _gated(prefix: str, h: int, inter: int, normal, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
           ) -> dict[str, torch.Tensor]:
    gate, up, down = names
    return {f"{prefix}{gate}.weight": normal(inter, h), f"{prefix}{up}.weight": normal(inter, h),
            f"{prefix}{down}.weight": normal(h, inter)}
