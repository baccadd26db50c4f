"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3, and with routed experts Mixtral,
Qwen2-MoE, Qwen3-MoE) as one model; variants are config flags (`ArchConfig`).

Gemma 3's layer, by its flags: norms of the attention's and the MLP's outputs before each residual
add (`sandwich_norms`), a GELU-gated MLP, query/key norms, embeddings scaled by sqrt(hidden), its
own attention scale, and five local layers (a sliding window, rotated by a base of their own) to
each global one. Its (1 + w) norms are folded into the weights when the model loads.

Weights are stored fused: q/k/v projections as one `qkv_proj`, gate/up as one `gate_up_proj`, so
a decode step issues two matmuls fewer per layer.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.attention import AttentionMetadata, attend_cached, paged_attention, paged_attention_op
from pdserve.layers.linear import embedding_rows, linear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding, apply_rotary, local_rotary
from pdserve.models.arch_config import ArchConfig
from pdserve.models.mlp import GatedMLP, feed_forward, weight
from pdserve.models.native_decode import NativeDecode


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.window = cfg.window(layer)  # None: the whole context
        self.local_rope = self.window is not None and cfg.local_rope_theta is not None
        self.qkv_proj = weight(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        self.qkv_bias = weight(cfg.q_size + 2 * cfg.kv_size) if cfg.qkv_bias else None
        self.o_proj = weight(cfg.hidden_size, cfg.q_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # rotary tables at the tokens' positions
        kv_cache: torch.Tensor | None,  # [slots, 2, kv_heads, head_dim]; None in a compiled step
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        if meta is not None and meta.kernels is not None:
            return linear(self._attend_in_place(qkv, cos_sin, kv_cache, meta), self.o_proj)
        v = qkv[:, self.q_size + self.kv_size :].view(t, 1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k heads side by side: one rotary pass for both
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos_sin)
        else:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            qk = apply_rotary(torch.cat([q, k], dim=1), cos_sin)
        q = qk[:, : self.num_heads]  # [tokens, heads, head_dim]
        kv = torch.cat([qk[:, self.num_heads :].unsqueeze(1), v], dim=1)  # [tokens, 2, kv_heads, head_dim]
        if meta is None:  # a compiled step: metadata and cache are the step's (`step_metadata`)
            o = paged_attention_op(q, kv, self.layer, self.scale, self.window or 0)
        else:
            o = paged_attention(q, kv, kv_cache, meta, self.scale, self.window)
        return linear(o, self.o_proj)

    def _attend_in_place(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                         kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's kernels: rotary on qkv's q and k heads and the new K/V into the cache in one
        call, then attention reading the cache ([tokens, heads * head_dim])."""
        t, q_end = qkv.shape[0], self.q_size + self.kv_size
        if self.q_norm is not None:  # per head, before rotary
            qkv[:, : self.q_size] = self.q_norm(qkv[:, : self.q_size].view(t, -1, self.head_dim), meta.kernels).view(t, -1)
            qkv[:, self.q_size : q_end] = self.k_norm(
                qkv[:, self.q_size : q_end].view(t, -1, self.head_dim), meta.kernels).view(t, -1)
        cos, sin = cos_sin
        meta.kernels.rotary_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, kv_cache,
                                  meta.slot_mapping)
        return attend_cached(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim), kv_cache, meta, self.scale,
                             self.window)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the MLP's input norm
        self.mlp = feed_forward(cfg, layer)
        # Gemma: the attention's and the MLP's outputs are normed before their residual adds
        self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # sums the ranks' partial outputs

    def forward(self, x, delta, cos_sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + delta (delta: the previous layer's MLP output, None before the
        first); it returns the same pair for the next. The residual adds thus fuse with the norms
        after them (pdserve's kernels add in place, in the same pass)."""
        kernels = None if meta is None else meta.kernels  # pdserve's, when the step runs them
        x, h = self.input_layernorm.add_and_norm(x, delta, kernels)
        attended = self.self_attn(h, cos_sin, kv_cache, meta)
        if self.all_reduce is not None:  # tensor parallel: each rank's heads gave a partial sum
            attended = self.all_reduce(attended)
        if self.attn_output_norm is not None:
            attended = self.attn_output_norm(attended, kernels)
        x, h = self.post_attention_layernorm.add_and_norm(x, attended, kernels)
        out = self.mlp(h, kernels)
        if self.all_reduce is not None:
            out = self.all_reduce(out)
        return x, out if self.mlp_output_norm is None else self.mlp_output_norm(out, kernels)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = weight(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else weight(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = local_rotary(cfg)  # the sliding layers' own (Gemma 3); None: they share `rotary`
        self.use_decode_stack = True  # decode steps in one kernel call where they can (`native_decode`)
        self._decode_stack: NativeDecode | None = None
        self._decode_stack_built = False
        self.keep_residual = False  # keep the last step's hidden states before the final norm (an MTP head reads them)
        self.residual: torch.Tensor | None = None
        self.ranks = None  # tensor parallel: the ranks' group (`parallel.group.RankGroup`); None: one process

    def join(self, ranks) -> None:
        """Run as one rank of `ranks`: each layer adds the ranks' partial outputs, logits are
        gathered across the ranks' vocabulary rows, and the one-call decode stack (which knows
        no ranks) is off."""
        self.ranks = ranks
        for layer in self.layers:
            layer.all_reduce = ranks.all_reduce
        self.use_decode_stack = False

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_caches: torch.Tensor | None,  # [layers, slots, 2, kv_heads, head_dim]
        meta: AttentionMetadata | None,  # None (with kv_caches): the step's, from `step_metadata` (compiled)
        on_layer: Callable[[int], None] | None = None,  # told each layer's index once its KV is written
    ) -> torch.Tensor:  # [tokens, hidden]
        x, delta = self.embed(input_ids), None
        cos_sin = self.rotary(positions)
        local = cos_sin if self.rotary_local is None else self.rotary_local(positions)
        stack = self.decode_stack() if meta is not None and on_layer is None else None
        if stack is not None and stack.takes(x, meta):
            x, delta = stack(x, cos_sin, local, kv_caches, meta)
        else:
            for i, layer in enumerate(self.layers):
                rope = local if layer.self_attn.local_rope else cos_sin
                x, delta = layer(x, delta, rope, None if kv_caches is None else kv_caches[i], meta)
                if on_layer is not None:
                    on_layer(i)
        x, hidden = self.norm.add_and_norm(x, delta, None if meta is None else meta.kernels)
        self.residual = x if self.keep_residual else None
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        x = embedding_rows(self.embed_tokens, input_ids, self.norm.weight.dtype)
        if self.cfg.embedding_multiplier is not None:  # rounded to the dtype first, as transformers does
            x = x * torch.tensor(self.cfg.embedding_multiplier, dtype=x.dtype)
        return x

    def decode_stack(self) -> NativeDecode | None:
        """The layers as one kernel call takes them (built at the first step, once the weights are
        in place), or None where they cannot run so (or `use_decode_stack` is off)."""
        if not self.use_decode_stack:
            return None
        if not self._decode_stack_built:
            self._decode_stack, self._decode_stack_built = NativeDecode.of(self), True
        return self._decode_stack

    def products(self, max_tokens: int, max_sequences: int) -> list[tuple[object, torch.Tensor | None, int]]:
        """The matmuls a step runs, one per weight shape (the layers share them), as (weight, bias,
        the most rows it takes): a step's tokens for the layers', its sequences for the head's."""
        attn = self.layers[0].self_attn
        products = [(attn.qkv_proj, attn.qkv_bias, max_tokens), (attn.o_proj, None, max_tokens)]
        kinds: dict[tuple[int, int], object] = {}  # one MLP of each size: dense, an expert, a shared expert
        for layer in self.layers:
            mlp = layer.mlp
            for part in (mlp,) if isinstance(mlp, GatedMLP) else (mlp.first_held(), mlp.shared_expert):
                if part is not None:
                    kinds.setdefault((part.intermediate, id(type(mlp))), part)
        for part in kinds.values():
            products += [(part.gate_up_proj, None, max_tokens), (part.down_proj, None, max_tokens)]
        return products + [(self.lm_head, None, max_sequences)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        if self.ranks is not None:
            return self.ranks.logits(hidden, self.local_logits, self.cfg.vocab_size)
        return self.local_logits(hidden)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the head's rows this process holds (all of them, but under tensor parallelism)."""
        return linear(hidden, self.lm_head).float()
