"""Architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json.

Llama, Mistral, Qwen2 and Qwen3 share one forward pass; they differ only by the flags below.
A config.json means what transformers' class for its architecture makes of it: a field left out
takes that class's default, and the layouts of transformers 4 and 5 are both read (the rotary
fields in `rope_config`, the sliding window here). What transformers would honour and we cannot
is refused, never dropped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.models.rope_config import RopeScaling, read_rope


@dataclass(slots=True, frozen=True)
class _Family:
    """What transformers' class for one architecture fixes, or assumes when config.json is silent."""

    qk_norm: bool = False
    qkv_bias: bool = False  # hard-coded by the class: Qwen2 biases q/k/v (not o_proj) whatever the config says
    # Flags the class honours that need weights we do not implement (Llama's attention_bias biases o_proj too).
    unsupported_flags: tuple[str, ...] = ()
    sliding: str = "never"  # "never" | "always" (every layer, when a window is set) | "opt_in" (Qwen's flags)
    defaults: dict[str, Any] = field(default_factory=dict)  # the class's values for fields left out


_QWEN_DEFAULTS = dict(num_key_value_heads=32, max_position_embeddings=32768, use_sliding_window=False,
                      sliding_window=4096, max_window_layers=28)

# Hugging Face architecture name -> how it differs from plain Llama.
_ARCHITECTURES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family(unsupported_flags=("attention_bias", "mlp_bias"),
                                defaults=dict(max_position_embeddings=2048)),
    "MistralForCausalLM": _Family(sliding="always", defaults=dict(
        num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096)),
    "Qwen2ForCausalLM": _Family(qkv_bias=True, sliding="opt_in", defaults=_QWEN_DEFAULTS),
    "Qwen3ForCausalLM": _Family(qk_norm=True, unsupported_flags=("attention_bias",), sliding="opt_in",
                                defaults=_QWEN_DEFAULTS | dict(head_dim=128)),
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


@dataclass(slots=True, frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # window of the layers that slide; None when none does
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in _ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = _ARCHITECTURES[arch]
        cfg = family.defaults | cfg
        _refuse_unsupported(cfg, arch, family)
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            num_layers = int(cfg["num_hidden_layers"])
            rope_theta, rope_scaling = read_rope(cfg)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                # null means "as many as query heads" in every transformers version
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias,
                qk_norm=family.qk_norm,
                sliding_window=_sliding_window(cfg, family, num_layers),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None


def _refuse_unsupported(cfg: dict[str, Any], arch: str, family: _Family) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # the same function under two names
        raise ValueError(f"hidden_act {act!r} is not supported; pdserve's MLP is SiLU-gated")
    for flag in family.unsupported_flags:
        if cfg.get(flag):
            raise ValueError(f"{flag}=true is not supported for {arch}: pdserve has no weights for those biases")


def _sliding_window(cfg: dict[str, Any], family: _Family, num_layers: int) -> int | None:
    if family.sliding == "never":  # transformers' Llama ignores any window a config names
        return None
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    if family.sliding == "always":  # Mistral: every layer slides (it ignores layer_types too)
        return window
    # Qwen2/Qwen3: only with use_sliding_window, and only the layers marked in layer_types
    # (transformers 5 writes it; the window is then saved as null when the flag is off), or in
    # older configs every layer from max_window_layers on.
    if not cfg.get("use_sliding_window"):
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        return window if num_layers > int(cfg["max_window_layers"]) else None
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"layer_types {layer_types} is not supported: pdserve needs one entry per layer "
            f"({num_layers}), each full_attention or sliding_attention"
        )
    if "sliding_attention" not in layer_types:
        return None
    if window is None:
        raise ValueError(
            "layer_types marks sliding_attention layers but no window is in force "
            f"(use_sliding_window={cfg.get('use_sliding_window')}, sliding_window={cfg.get('sliding_window')})"
        )
    return window


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def model_fingerprint(cfg: ArchConfig) -> str:
    """A hash of the architecture config: workers that disagree on it must not share KV, and a
    router admits only workers that serve its model."""
    blob = json.dumps(asdict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
