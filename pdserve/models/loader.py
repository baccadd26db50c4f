"""Build a model from a checkpoint: check every tensor, fuse projections, cast, place on device."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pdserve.models.arch_config import ArchConfig
from pdserve.models.checkpoint import Checkpoint, load_hf_dir
from pdserve.layers.linear import pack_weight
from pdserve.layers.kernels.native import load as load_kernels
from pdserve.layers.block_weight import BlockWeight, calibrate_blocks, hold_blocks
from pdserve.layers.quant import DenseProducts, QuantizedWeight, calibrated, dense_memory_budget, quantize
from pdserve.layers.rotary import RotaryEmbedding, local_rotary
from pdserve.models.expert_weights import fuse, gated_mlps, take_experts, take_mlp
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
        from pdserve.models.gguf_reader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        return load_hf_dir(path)
    raise ValueError(f"{str(model)!r} is neither a model directory nor a .gguf file")


def build_model(
    ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, quantization: str | None = "none",
    pack_weights: bool = True, shard: Shard = Shard(0, 1),
) -> LlamaForCausalLM:
    """`quantization`: "none", "int4" or "int8" (every matmul weight, the head included), or
    "auto": each weight as its checkpoint stored it (a GGUF's blocks as they are, `Checkpoint.blocks`,
    on CPU and one rank; else `Checkpoint.quantized_bits`, a fused weight only when all its parts
    agree), the rest unquantized; a token embedding in blocks is looked up from them.
    `pack_weights=False` keeps unquantized matmul weights as plain parameters (a compiled graph
    freezes and packs them itself). `shard`: the tensor-parallel rank's share (`parallel/shard.py`)."""
    cfg = ArchConfig.from_hf_config(ckpt.hf_config)
    check_divisible(cfg, shard)
    with torch.device("meta"):
        model = LlamaForCausalLM(local_config(cfg, shard))
    kernels = load_kernels() if device.type == "cpu" else None
    as_stored = quantization == "auto" and kernels is not None and shard.size == 1  # blocks served as stored
    # cast before fusing: half the bytes to copy in bf16; blocks served as stored are never expanded
    tensors = _TensorSource(ckpt, dtype, kernels, as_stored)
    params: dict[str, torch.Tensor] = {"embed_tokens": tensors.take("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = tensors.take("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    norm = lambda name, size: tensors.take(name, (size,), offset=cfg.norm_offset)  # noqa: E731 (Gemma: 1 + w)
    params["norm.weight"] = norm("model.norm.weight", cfg.hidden_size)
    # each matmul weight's checkpoint tensors, for the bits they were stored in
    sources = {"lm_head": ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]}
    h, q, kv, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        params[dst + "self_attn.qkv_proj"] = fuse([
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
            params[dst + "self_attn.q_norm.weight"] = norm(attn + "q_norm.weight", hd)
            params[dst + "self_attn.k_norm.weight"] = norm(attn + "k_norm.weight", hd)
        params[dst + "self_attn.o_proj"] = tensors.take(attn + "o_proj.weight", (h, q))
        sources[dst + "self_attn.qkv_proj"] = [attn + f"{x}_proj.weight" for x in "qkv"]
        sources[dst + "self_attn.o_proj"] = [attn + "o_proj.weight"]
        if cfg.sparse(i):
            take_experts(tensors, cfg, src, dst + "mlp.", params, sources)
        else:
            take_mlp(tensors, h, cfg.intermediate_size, src + "mlp.", dst + "mlp.", params, sources)
        params[dst + "input_layernorm.weight"] = norm(src + "input_layernorm.weight", h)
        if cfg.sandwich_norms:  # Gemma's names: its "post attention" norm is the attention output's
            params[dst + "attn_output_norm.weight"] = norm(src + "post_attention_layernorm.weight", h)
            params[dst + "post_attention_layernorm.weight"] = norm(src + "pre_feedforward_layernorm.weight", h)
            params[dst + "mlp_output_norm.weight"] = norm(src + "post_feedforward_layernorm.weight", h)
        else:
            params[dst + "post_attention_layernorm.weight"] = norm(src + "post_attention_layernorm.weight", h)
    if cfg.tie_word_embeddings:
        tensors.drop("lm_head.weight")  # some tied checkpoints still store a copy
    tensors.check_all_used()
    held = _held_as_stored(ckpt, sources, params, tensors, kernels) if as_stored else {}
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
    if "embed_tokens" in held:
        _replace(model, "embed_tokens", held["embed_tokens"])
    if head is not None:
        _replace(model, "lm_head", torch.nn.Parameter(head, requires_grad=False))
    elif cfg.tie_word_embeddings:
        _replace(model, "lm_head", model.embed_tokens)
    for name, module, attr in matmul_weights(model):
        if name in held:
            _replace(module, attr, held[name])
    # Built for real here: under the meta device above its cos/sin tables hold no values.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    model.rotary.to(device).cast_(dtype)
    if (local := local_rotary(cfg)) is not None:
        model.rotary_local = local
        local.to(device).cast_(dtype)
    left_on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    assert not left_on_meta, f"parameters never loaded: {left_on_meta}"
    bits = {name: _bits(quantization, [ckpt.quantized_bits.get(t) for t in parts])
            for name, parts in sources.items() if name not in held}
    if any(bits.values()) and device.type != "cpu":
        raise ValueError("quantized weights run on CPU kernels; serve this model with --quantization none on "
                         f"{device.type}")
    for name, module, attr in matmul_weights(model):
        if name in held:
            continue
        if bits[name]:
            _replace(module, attr, quantize(getattr(module, attr), bits[name], dtype, load_kernels()))
        elif pack_weights:
            _replace(module, attr, pack_weight(getattr(module, attr)))
    _share_dense_products(model, dtype)
    return model.eval()


def _share_dense_products(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """A `DenseProducts` for the model's quantized weights and one for its block weights, keeping
    their expanded copies where all of those fit the memory set aside for them, their row
    thresholds measured on the layers' largest weights of each kind. The head only ever multiplies
    the few rows a step samples: where it is the only quantized weight (a GGUF file's Q8_0 table,
    its layers in other formats), only its panels and tiles are measured, on itself."""
    held = [(name, getattr(module, attr)) for name, module, attr in matmul_weights(model)]
    held = list({id(w): (name, w) for name, w in held}.values())  # a tied head counted once
    compact = [(name, w) for name, w in held if isinstance(w, (QuantizedWeight, BlockWeight))]
    if not compact:
        return
    keep = sum(w.out_features * w.in_features for _, w in compact) * dtype.itemsize <= dense_memory_budget()
    for kind in (QuantizedWeight, BlockWeight):
        dense = DenseProducts(keep=keep)
        for _, w in compact:
            if isinstance(w, kind):
                w.dense = dense
        layers = [w for name, w in compact if isinstance(w, kind) and name != "lm_head"]
        head = [w for name, w in compact if isinstance(w, kind) and name == "lm_head"]
        if not layers and kind is QuantizedWeight and head:
            dense.tile_rows, dense.panel_rows, _ = calibrated(head, dtype, dense=False)
        if not layers:
            continue
        if kind is BlockWeight:
            dense.tile_rows, dense.min_rows = calibrate_blocks(layers, dtype)
            continue
        largest = max(w.out_features * w.in_features for w in layers)
        alike = [w for w in layers if w.out_features * w.in_features == largest]
        dense.tile_rows, dense.panel_rows, dense.min_rows = calibrated(
            [w for w in alike if w.qs.shape == alike[0].qs.shape], dtype)


def _held_as_stored(ckpt: Checkpoint, sources: dict[str, list[str]], params: dict[str, torch.Tensor],
                    tensors: _TensorSource, kernels) -> dict[str, BlockWeight | QuantizedWeight]:
    """The matmul weights (and the token embedding) whose checkpoint parts are all blocks, held in
    them; their placeholders leave `params`. A fused weight of blocks and floats is expanded whole."""
    held: dict[str, BlockWeight | QuantizedWeight] = {}
    for name, parts in sources.items():
        if parts and all(p in ckpt.blocks for p in parts):
            held[name] = hold_blocks([ckpt.blocks[p] for p in parts], kernels)
            params.pop(name, None)
        elif any(p in ckpt.blocks for p in parts):
            params[name] = torch.cat([tensors.value(p) for p in parts])
    embedding = "model.embed_tokens.weight"
    if embedding in ckpt.blocks:  # a tied head is the same table: one holder for both
        tied = sources["lm_head"] == [embedding]
        held["embed_tokens"] = held["lm_head"] if tied else hold_blocks([ckpt.blocks[embedding]], kernels)
        params.pop("embed_tokens")
    return held


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
    """Hands out checkpoint tensors by name and reports any missing, misshapen or left over. A
    tensor in blocks is expanded to the model's dtype, unless blocks are served as stored
    (`as_stored`): then it is a placeholder on the meta device, which `_held_as_stored` replaces."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, kernels, as_stored: bool) -> None:
        self._tensors, self._blocks = ckpt.tensors, ckpt.blocks
        self._dtype, self._kernels, self._as_stored = dtype, kernels, as_stored
        self._unused = {name for name in ckpt.names() if not _IGNORED.match(name)}

    def take(self, name: str, shape: tuple[int, ...], offset: float = 0.0) -> torch.Tensor:
        """The tensor in the model's dtype; plus `offset` first, in float32 (a Gemma norm's 1 + w)."""
        blocks = self._blocks.get(name)
        t = self._tensors.get(name)
        if t is None and blocks is None:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        found = tuple(t.shape) if blocks is None else blocks.shape
        if found != shape:
            raise ValueError(f"tensor {name!r} has shape {found}, the config implies {shape}")
        self._unused.discard(name)
        if blocks is not None:
            return torch.empty(shape, dtype=self._dtype, device="meta") if self._as_stored else self.expanded(name)
        if offset:
            return (t.float() + offset).to(self._dtype)
        return t.to(self._dtype, copy=True)

    def value(self, name: str) -> torch.Tensor:
        """A tensor's values in the model's dtype, blocks expanded."""
        return self.expanded(name) if name in self._blocks else self._tensors[name].to(self._dtype, copy=True)

    def expanded(self, name: str) -> torch.Tensor:
        """A tensor stored in blocks, expanded to the model's dtype (by pdserve's kernels where
        they run, else by the reference rules)."""
        blocks = self._blocks[name]
        kernels = self._kernels or load_kernels()
        if kernels is None or not kernels.blocks.format_supported(blocks.format.type_id):
            return blocks.dequantize().to(self._dtype)
        out = torch.empty(blocks.shape, dtype=self._dtype if self._dtype == torch.bfloat16 else torch.float32)
        kernels.blocks.dequantize(blocks.format.type_id, blocks.data, out)
        return out.to(self._dtype)

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._blocks

    def drop(self, name: str) -> None:
        self._unused.discard(name)

    def check_all_used(self) -> None:
        if self._unused:
            names = sorted(self._unused)
            more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
            raise ValueError(f"checkpoint has tensors this architecture does not use: {names[:5]}{more}")
