"""Architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json.

Llama, Mistral, Qwen2, Qwen3 and Gemma 3 share one forward pass; they differ only by the flags
below. Their mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE) replace the MLP of some or all
layers by routed experts (`experts`).
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

from pdserve.models.rope_config import RopeScaling, read_local_and_global_rope, read_rope
from pdserve.models.sliding_config import read_sliding


@dataclass(slots=True, frozen=True)
class _Family:
    """What transformers' class for one architecture fixes, or assumes when config.json is silent."""

    qk_norm: bool = False
    qkv_bias: bool = False  # hard-coded by the class: Qwen2 biases q/k/v (not o_proj) whatever the config says
    # Flags the class honours that need weights we do not implement (Llama's attention_bias biases o_proj too).
    unsupported_flags: tuple[str, ...] = ()
    sliding: str = "never"  # which layers slide: see `sliding_config`
    experts: str | None = None  # how its MoE config reads: "mixtral" | "qwen_moe"; None: dense
    gemma: bool = False  # Gemma's layer: (1 + w) norms, norms after attention and MLP, scaled embeddings
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
    "MixtralForCausalLM": _Family(sliding="always", experts="mixtral", defaults=dict(
        num_key_value_heads=8, max_position_embeddings=131072, num_local_experts=8, num_experts_per_tok=2)),
    # Qwen2-MoE's sliding layers follow a pattern of their own (odd layers below max_window_layers): refused
    "Qwen2MoeForCausalLM": _Family(qkv_bias=True, unsupported_flags=("use_sliding_window",), experts="qwen_moe",
                                   defaults=dict(num_key_value_heads=16, max_position_embeddings=32768,
                                                 num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                                                 shared_expert_intermediate_size=5632)),
    "Qwen3MoeForCausalLM": _Family(qk_norm=True, unsupported_flags=("attention_bias",), sliding="opt_in_all",
                                   experts="qwen_moe", defaults=dict(
                                       num_key_value_heads=4, max_position_embeddings=32768, head_dim=128,
                                       sliding_window=4096, num_local_experts=128, num_experts_per_tok=8,
                                       moe_intermediate_size=768)),
    "Gemma3ForCausalLM": _Family(qk_norm=True, sliding="pattern", gemma=True, defaults=dict(
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, sliding_window=4096,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rms_norm_eps=1e-6)),
}
_GEMMA_ROPE = (1_000_000.0, 10_000.0)  # Gemma 3's default bases: global layers, sliding ones
# transformers' names of the MLP's gate activation -> ours
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

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
    sliding_layers: tuple[int, ...] = ()  # the layers that see only their last `sliding_window` tokens
    local_rope_theta: float | None = None  # the sliding layers' own rotary base, unscaled (Gemma 3)
    attention_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    activation: str = "silu"  # the MLP's gate: "silu" | "gelu_tanh" | "gelu"
    norm_offset: float = 0.0  # every RMSNorm scales by norm_offset + weight (Gemma: 1 + w)
    sandwich_norms: bool = False  # the attention's and the MLP's outputs normed before their residual add
    embedding_multiplier: float | None = None  # embeddings times this, in their dtype (Gemma: sqrt(hidden))
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    experts: Experts | None = None  # the routed experts of a mixture-of-experts model; None: dense

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

    def window(self, layer: int) -> int | None:
        """The tokens a query of `layer` sees, its own included; None: every earlier one."""
        return self.sliding_window if layer in self.sliding_layers else None

    def sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is routed experts (else the dense one of `intermediate_size`)."""
        return self.experts is not None and layer not in self.experts.dense_layers

    def num_parameters(self, active: bool = False) -> int:
        """Every parameter, or with `active` those one token computes with (its top-k experts)."""
        h, v = self.hidden_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        mlps = 0
        for layer in range(self.num_layers):
            if not self.sparse(layer):
                mlps += 3 * h * self.intermediate_size
                continue
            e = self.experts
            routed = e.per_token if active else e.count
            mlps += routed * 3 * h * e.intermediate_size + h * e.count
            if e.shared_intermediate_size:
                mlps += 3 * h * e.shared_intermediate_size + h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + mlps + embeddings + h

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
            local_theta = None
            if family.gemma:
                rope_theta, rope_scaling, local_theta = read_local_and_global_rope(cfg, *_GEMMA_ROPE)
            else:
                rope_theta, rope_scaling = read_rope(cfg)
            window, sliding_layers = read_sliding(cfg, family.sliding, num_layers)
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
                sliding_window=window,
                sliding_layers=sliding_layers,
                local_rope_theta=local_theta if sliding_layers else None,
                attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if family.gemma else None,
                activation=_ACTIVATIONS[_activation_name(cfg, family)],
                norm_offset=1.0 if family.gemma else 0.0,
                sandwich_norms=family.gemma,
                embedding_multiplier=hidden**0.5 if family.gemma else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
                experts=_experts(cfg, family, num_layers),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None


@dataclass(slots=True, frozen=True)
class Experts:
    """A mixture-of-experts MLP: a router picks each token's `per_token` experts of `count`, whose
    outputs add up weighted by the router's probabilities (renormalized over the picked ones where
    `normalize`); a shared expert, where the model has one, adds its output to every token's, scaled
    by a sigmoid gate of its own."""

    count: int
    per_token: int
    intermediate_size: int  # of each routed expert
    normalize: bool
    shared_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is the dense one instead


def _experts(cfg: dict[str, Any], family: _Family, num_layers: int) -> Experts | None:
    if family.experts is None:
        return None
    if family.experts == "mixtral":  # every layer routed; the top-k weights always renormalized
        return Experts(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                       int(cfg["intermediate_size"]), normalize=True)
    # Qwen-MoE: `num_experts` (transformers 5 writes Qwen3-MoE's as `num_local_experts`), sparse
    # layers every `decoder_sparse_step`th except `mlp_only_layers`
    count = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only_mlp or count == 0 or (i + 1) % step)
    experts = Experts(count, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                      normalize=bool(cfg.get("norm_topk_prob", False)),
                      shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                      dense_layers=dense)
    if count and not 0 < experts.per_token <= count:
        raise ValueError(f"num_experts_per_tok ({experts.per_token}) must be between 1 and num_experts ({count})")
    return experts


def _activation_name(cfg: dict[str, Any], family: _Family) -> str:
    # Gemma's classes read `hidden_activation` and ignore `hidden_act`; the others read `hidden_act`
    if family.gemma:
        return cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    return cfg.get("hidden_act", "silu")


def _refuse_unsupported(cfg: dict[str, Any], arch: str, family: _Family) -> None:
    act = _activation_name(cfg, family)
    if act not in _ACTIVATIONS or (not family.gemma and _ACTIVATIONS[act] != "silu"):
        field = "hidden_activation" if family.gemma else "hidden_act"
        supported = ", ".join(_ACTIVATIONS) if family.gemma else "silu"
        raise ValueError(f"{field} {act!r} is not supported for {arch}; supported: {supported}")
    if family.gemma:
        for flag in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(flag):
                raise ValueError(f"{flag}={cfg[flag]} is not supported for {arch}")
    for flag in family.unsupported_flags:
        if cfg.get(flag):
            raise ValueError(f"{flag}=true is not supported for {arch}: pdserve has no weights for those biases")


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def model_fingerprint(cfg: ArchConfig) -> str:
    """A hash of the architecture config: workers that disagree on it must not share KV, and a
    router admits only workers that serve its model."""
    blob = json.dumps(asdict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
