"""Build a model from a checkpoint: check every tensor, fuse projections, cast, place on device."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import Checkpoint, load_hf_dir
from pdserve.layers.linear import pack_weight
from pdserve.layers.kernels.native import load as load_kernels
from pdserve.layers.quant import DenseProducts, QuantizedWeight, calibrated, dense_memory_budget, quantize
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.expert_weights import gated_mlps, take_experts, take_mlp
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.shard import Shard, check_divisible, local_config, shard_params

# Tensors some checkpoints carry that the model recomputes itself.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def load_checkpoint(model: str | Path) -> Checkpoint:
    """A Hugging Face directory or a .gguf file."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(model)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        from pdserve.models.default_model import load_checkpoint_cached

        return load_checkpoint_cached(path)
    if path.is_dir():
        return load_hf_dir(path)
    raise ValueError(f"{str(model)!r} is neither a model directory nor a .gguf file")


def build_model(
    ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, quantization: str | None = "none",
    pack_weights: bool = True, shard: Shard = Shard(0, 1),
) -> LlamaForCausalLM:
    """`quantization`: "none", "int4" or "int8" (every matmul weight, the head included), or
    "auto": each weight as its checkpoint stored it (`Checkpoint.quantized_bits`; a fused weight
    only when all its parts agree), the rest unquantized.
    `pack_weights=False` keeps unquantized matmul weights as plain parameters (a compiled graph
    freezes and packs them itself). `shard`: the tensor-parallel rank's share (`parallel/shard.py`)."""
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)
    check_divisible(cfg, shard)
    with torch.device("meta"):
        model = LlamaForCausalLM(local_config(cfg, shard))
    tensors = _TensorSource(ckpt.tensors, dtype)  # cast before fusing: half the bytes to copy in bf16
    params: dict[str, torch.Tensor] = {"embed_tokens": tensors.take("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = tensors.take("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    params["norm.weight"] = tensors.take("model.norm.weight", (cfg.hidden_size,))
    # each matmul weight's checkpoint tensors, for the bits they were stored in
    sources = {"lm_head": ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]}
    h, q, kv, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        params[dst + "self_attn.qkv_proj"] = torch.cat([
            tensors.take(attn + "q_proj.weight", (q, h)),
            tensors.take(attn + "k_proj.weight", (kv, h)),
            tensors.take(attn + "v_proj.weight", (kv, h)),
        ])
        if cfg.qkv_bias:
            params[dst + "self_attn.qkv_bias"] = torch.cat([
                tensors.take(attn + "q_proj.bias", (q,)),
                tensors.take(attn + "k_proj.bias", (kv,)),
                tensors.take(attn + "v_proj.bias", (kv,)),
            ])
        if cfg.qk_norm:
            params[dst + "self_attn.q_norm.weight"] = tensors.take(attn + "q_norm.weight", (hd,))
            params[dst + "self_attn.k_norm.weight"] = tensors.take(attn + "k_norm.weight", (hd,))
        params[dst + "self_attn.o_proj"] = tensors.take(attn + "o_proj.weight", (h, q))
        sources[dst + "self_attn.qkv_proj"] = [attn + f"{x}_proj.weight" for x in "qkv"]
        sources[dst + "self_attn.o_proj"] = [attn + "o_proj.weight"]
        if cfg.sparse(i):
            take_experts(tensors, cfg, src, dst + "mlp.", params, sources)
        else:
            take_mlp(tensors, h, cfg.intermediate_size, src + "mlp.", dst + "mlp.", params, sources)
        params[dst + "input_layernorm.weight"] = tensors.take(src + "input_layernorm.weight", (h,))
        params[dst + "post_attention_layernorm.weight"] = tensors.take(src + "post_attention_layernorm.weight", (h,))
    if cfg.tie_word_embeddings:
        tensors.drop("lm_head.weight")  # some tied checkpoints still store a copy
    tensors.check_all_used()
    if cfg.tie_word_embeddings and shard.size > 1:  # the head's rows: a slice of the (whole) table
        params["lm_head"] = params["embed_tokens"]
    params = shard_params(params, cfg, shard)
    placed = {name: t.to(device=device) for name, t in params.items()}
    head = placed.pop("lm_head", None)
    if shard.expert_parallel:
        for i, layer in enumerate(model.layers):
            if cfg.sparse(i):
                layer.mlp.hold_only(shard.held_experts(cfg.experts.count))
    model.load_state_dict(placed, strict=False, assign=True)
    if head is not None:
        _replace(model, "lm_head", torch.nn.Parameter(head, requires_grad=False))
    elif cfg.tie_word_embeddings:
        model.lm_head = model.embed_tokens
    # Built for real here: under the meta device above its cos/sin tables hold no values.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    model.rotary.to(device).cast_(dtype)
    left_on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    assert not left_on_meta, f"parameters never loaded: {left_on_meta}"
    bits = {name: _bits(quantization, [ckpt.quantized_bits.get(t) for t in parts])
            for name, parts in sources.items()}
    if any(bits.values()) and device.type != "cpu":
        raise ValueError("quantized weights run on CPU kernels; serve this model with --quantization none on "
                         f"{device.type}")
    for name, module, attr in matmul_weights(model):
        if bits[name]:
            _replace(module, attr, quantize(getattr(module, attr), bits[name], dtype, load_kernels()))
        elif pack_weights:
            _replace(module, attr, pack_weight(getattr(module, attr)))
    _share_dense_products(model, dtype)
    return model.eval()


def _share_dense_products(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """One `DenseProducts` for the model's quantized weights, keeping their expanded copies where
    those fit the memory set aside for them, its row thresholds measured on the layers' largest weights
    (the head only ever multiplies the few rows a step samples)."""
    held = [(name, getattr(module, attr)) for name, module, attr in matmul_weights(model)]
    quantized = [(name, w) for name, w in held if isinstance(w, QuantizedWeight)]
    if not quantized:
        return
    expanded_bytes = sum(w.out_features * w.in_features for _, w in quantized) * dtype.itemsize
    dense = DenseProducts(keep=expanded_bytes <= dense_memory_budget())
    for _, w in quantized:
        w.dense = dense
    layers = [w for name, w in quantized if name != "lm_head"] or [w for _, w in quantized]
    largest = max(layers, key=lambda w: w.qs.numel())
    dense.tile_rows, dense.panel_rows, dense.min_rows = calibrated(
        [w for w in layers if w.qs.shape == largest.qs.shape], dtype)


def _bits(quantization: str | None, stored: list[int | None]) -> int | None:
    if quantization in (None, "none"):
        return None
    if quantization == "auto":
        return stored[0] if len(set(stored)) == 1 else None
    return {"int4": 4, "int8": 8}[quantization]


def matmul_weights(model: LlamaForCausalLM):
    """(name, module, attribute) of every matmul weight; a tied head is its own entry (its packed or
    quantized copy is the head's; the embedding lookup keeps the plain table). A router's weight is
    not one: its logits pick experts, and stay in the model's precision."""
    for i, layer in enumerate(model.layers):
        for attr in ("qkv_proj", "o_proj"):
            yield f"layers.{i}.self_attn.{attr}", layer.self_attn, attr
        for name, mlp in gated_mlps(layer.mlp, f"layers.{i}.mlp"):
            for attr in ("gate_up_proj", "down_proj"):
                yield f"{name}.{attr}", mlp, attr
    yield "lm_head", model, "lm_head"


def _replace(module: torch.nn.Module, name: str, weight: object) -> None:
    module._parameters.pop(name, None)  # a packed tensor cannot be a Parameter
    setattr(module, name, weight)


class _TensorSource:
    """Hands out checkpoint tensors by name and reports any missing, misshapen or left over."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self._tensors = tensors
        self._dtype = dtype
        self._unused = {name for name in tensors if not _IGNORED.match(name)}

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
        self._unused.discard(name)
        return t.to(self._dtype, copy=True)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def drop(self, name: str) -> None:
        self._unused.discard(name)

    def check_all_used(self) -> None:
        if self._unused:
            names = sorted(self._unused)
            more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
            raise ValueError(f"checkpoint has tensors this architecture does not use: {names[:5]}{more}")
