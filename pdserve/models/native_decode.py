"""A decode step's decoder layers in one call to pdserve's kernels (`pd_decode_stack` in ops.c).

At batch 1 a step of the default model makes 270 kernel calls, and the framework around each (the
module calls, the new tensors, the argument conversions) cost more than the kernels' arithmetic:
the layers took 9.4 ms a token through the model's modules, 5.7 ms as the same calls made back to
back, on a 2-vCPU Xeon. Where every matmul of the layers runs on pdserve's quantized kernels, a
decode-only step hands the whole stack to one C call that makes those same calls in the same
order: the hidden states come out identical, bit for bit (tested). Weights in a GGUF file's block
formats (`BlockWeight`) run there too, part by part. Anything else runs the
modules: prefill chunks, layer callbacks, routed experts, weights not quantized, and batches
large enough for the dense products. Query/key norms, sliding windows and Gemma's layer (its
output norms, local rotary tables, GELU) run there.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.attention import AttentionMetadata
from pdserve.layers.block_weight import BlockWeight
from pdserve.layers.quant import QuantizedWeight


class _BlockPart(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int64), ("rows", ctypes.c_int64), ("data", ctypes.c_void_p)]


class _QWeight(ctypes.Structure):  # ops.c's pd_qweight; bits 0: `nparts` block parts
    _fields_ = [("bits", ctypes.c_int64), ("qs", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("mins", ctypes.c_void_p), ("panels", ctypes.c_void_p), ("panel_scales", ctypes.c_void_p),
                ("panel_mins", ctypes.c_void_p), ("parts", ctypes.POINTER(_BlockPart)), ("nparts", ctypes.c_int64)]

_BYTES, _TILES, _PANELS = 0, 1, 2  # where the stack's products run (ops.c's STACK_*)


class _Layer(ctypes.Structure):  # ops.c's pd_layer
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("attn_out_norm", ctypes.c_void_p),
                ("mlp_out_norm", ctypes.c_void_p), ("window", ctypes.c_int64), ("local_rope", ctypes.c_int64)]


def _pointer(norm) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _qweight(w: QuantizedWeight | BlockWeight, keep: list) -> _QWeight:
    """The struct for `w`; `keep` holds what its pointers point into (a block weight's parts array)."""
    if isinstance(w, BlockWeight):
        parts = (_BlockPart * len(w.parts))(*(_BlockPart(p.format.type_id, p.shape[0], p.data.data_ptr())
                                              for p in w.parts))
        keep.append(parts)
        return _QWeight(0, None, None, None, None, None, None, parts, len(w.parts))
    panels = (None, None, None) if w.panels is None else tuple(t.data_ptr() for t in w.panels)
    return _QWeight(w.bits, w.qs.data_ptr(), w.scales.data_ptr(), None if w.mins is None else w.mins.data_ptr(),
                    *panels, None, 0)


def _layer_weights(model):
    for layer in model.layers:
        yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


class NativeDecode:
    """The model's layers as `pd_decode_stack` takes them, built once; None from `of` where the
    model's layers cannot run there (see the module's docstring)."""

    def __init__(self, model, layers: ctypes.Array, keep: list) -> None:
        self.model = model
        self.layers = layers  # the structs hold pointers into the model's weights, which it keeps
        weights = list(_layer_weights(model))
        self.bits = {w.bits for w in weights if isinstance(w, QuantizedWeight)}  # (block weights: none)
        self.denses = list({id(w.dense): w.dense for w in weights}.values())  # every `DenseProducts` they follow
        quantized = [w.dense for w in weights if isinstance(w, QuantizedWeight)]
        blocks = [w.dense for w in weights if isinstance(w, BlockWeight)]
        self.dense = quantized[0] if quantized else self.denses[0]  # the quantized weights' (or the blocks')
        self.blocks_dense = blocks[0] if blocks else None
        self._keep = keep  # the block parts' arrays the structs point to

    @classmethod
    def of(cls, model) -> NativeDecode | None:
        cfg = model.cfg
        if cfg.experts is not None or cfg.activation not in ("silu", "gelu_tanh"):
            return None
        structs, keep = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(w, (QuantizedWeight, BlockWeight)) for w in weights):
                return None
            bias = attn.qkv_bias
            norms = (layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr())
            structs.append(_Layer(*norms, None if bias is None else bias.data_ptr(),
                                  *(_qweight(w, keep) for w in weights),
                                  _pointer(attn.q_norm), _pointer(attn.k_norm), _pointer(layer.attn_output_norm),
                                  _pointer(layer.mlp_output_norm), attn.window or 0, int(attn.local_rope)))
        return cls(model, (_Layer * len(structs))(*structs), keep)

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step's layers can run here: a decode-only step on pdserve's kernels whose
        products all run on the quantized kernels at its number of rows."""
        rows = x.shape[0]
        return (meta.kernels is not None and not meta.prefills and meta.num_decode_tokens == rows
                and meta.decode_tables is not None and x.dtype in (torch.float32, torch.bfloat16)
                and all(d.min_rows is None or rows < d.min_rows for d in self.denses))

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 local: tuple[torch.Tensor, torch.Tensor], kv_caches: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (x, delta) for the final norm, from the embeddings x ([rows, hidden],
        overwritten); `local`: the sliding layers' rotary tables where they have their own."""
        cfg, kernels, dense = self.model.cfg, meta.kernels, self.dense
        rows, dtype = x.shape[0], x.dtype
        new = lambda width: torch.empty(rows, width, dtype=dtype)  # noqa: E731
        delta, h = new(cfg.hidden_size), new(cfg.hidden_size)
        qkv, att = new(cfg.q_size + 2 * cfg.kv_size), new(cfg.q_size)
        gate_up, act = new(2 * cfg.intermediate_size), new(cfg.intermediate_size)
        cos, sin = (t.contiguous() for t in cos_sin)
        cos_local, sin_local = (t.contiguous() for t in local)
        scratch = new(max(cfg.hidden_size, cfg.q_size))
        slots, tables, lens = meta.slot_mapping, meta.decode_tables, meta.decode_lens
        if not all(t.is_contiguous() for t in (x, slots, tables, lens, kv_caches)):
            raise ValueError("pd_decode_stack takes contiguous tensors")
        on = _BYTES  # as QuantizedWeight.matmul chooses
        if dense.tile_rows is not None and rows >= dense.tile_rows and dtype == torch.bfloat16:
            on = _TILES
        elif (dense.panel_rows is not None and rows >= dense.panel_rows
              and all(kernels.panels_available(b) for b in self.bits)):
            on = _PANELS
        blocks = self.blocks_dense  # as BlockWeight.matmul chooses: the high bits
        if blocks is not None and blocks.tile_rows is not None and rows >= blocks.tile_rows and dtype == torch.bfloat16:
            on |= _TILES << 4
        first = self.model.layers[0]
        rc = kernels.lib.pd_decode_stack(
            kernels.isa, torch.get_num_threads(), ctypes.addressof(self.layers), len(self.layers), rows,
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            first.input_layernorm.eps, first.self_attn.scale, on,
            *(t.data_ptr() for t in (x, delta, h, qkv, att, gate_up, act, cos, sin, cos_local, sin_local)),
            int(cfg.activation == "gelu_tanh"), scratch.data_ptr(), kv_caches.data_ptr(),
            kv_caches[0].numel() * kv_caches.element_size(), slots.data_ptr(), meta.block_size, tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), int(dtype == torch.bfloat16))
        if rc:
            raise RuntimeError(f"pdserve's decode stack refused its arguments ({rc})")
        return x, delta
