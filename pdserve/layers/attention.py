"""Attention over a paged KV cache.

The cache of one layer is a flat slot array `[num_blocks * block_size, 2, kv_heads, head_dim]`, a
token's K and V side by side (one write and one read per layer; a block's KV for a layer is one
contiguous range, which is what a transfer ships); a token at position p of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`. New K/V are scattered into their
slots, then each query reads its context back a whole block at a time (`index_select` of blocks:
~10x faster on CPU than advanced indexing of single slots). Requests computing one
token (decodes) share one batched call; multi-token chunks (prefills) are computed one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's flat token batch
    query_len: int  # tokens computed in this chunk
    context_len: int  # tokens the chunk attends to (cached prefix + itself)
    context_blocks: torch.Tensor  # [ceil(context_len / block_size)] block ids holding them
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when plainly causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    block_size: int
    num_decode_tokens: int  # the batch's first tokens are decodes, one per request
    decode_blocks: torch.Tensor | None = None  # [decodes, max_blocks] block tables, padded
    decode_context_len: int = 0  # longest decode context
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_context] bool; None if all equal
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    kv: torch.Tensor,  # [tokens, 2, kv_heads, head_dim] the new tokens' K and V
    kv_cache: torch.Tensor,  # [slots, 2, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [tokens, heads * head_dim]
    kv_cache.index_copy_(0, meta.slot_mapping, kv)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    gqa = num_heads != num_kv_heads
    nd = meta.num_decode_tokens
    out = None if nd == num_tokens else torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    blocks = kv_cache.view(-1, meta.block_size * kv_cache[0].numel())  # [num_blocks, block bytes]
    if nd:
        ctx = _read_blocks(blocks, meta.decode_blocks, kv_cache.shape[1:])
        ctx = ctx[:, : meta.decode_context_len]  # [decodes, max_ctx, 2, kv_heads, head_dim]
        ctx_k = ctx[:, :, 0].transpose(1, 2)  # [decodes, kv_heads, max_ctx, head_dim]
        ctx_v = ctx[:, :, 1].transpose(1, 2)
        # The query heads sharing a KV head act as that head's queries: plain attention, no copies.
        qd = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qd, ctx_k, ctx_v, attn_mask=meta.decode_mask, scale=scale)
        if not meta.prefills:  # a decode-only step: no buffer to assemble
            return o.reshape(num_tokens, num_heads * head_dim)
        out[:nd] = o.view(nd, num_heads, head_dim)
    for chunk in meta.prefills:
        s, n = chunk.query_start, chunk.query_len
        # 4-D inputs: with 3-D ones the CPU backend falls back to the slow math kernel.
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        ctx = _read_blocks(blocks, chunk.context_blocks, kv_cache.shape[1:])[0, : chunk.context_len]
        ctx_k = ctx[:, 0].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
        ctx_v = ctx[:, 1].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qp, ctx_k, ctx_v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
            scale=scale, enable_gqa=gqa,
        )
        out[s : s + n] = o[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def _read_blocks(blocks: torch.Tensor, tables: torch.Tensor, slot_shape: torch.Size) -> torch.Tensor:
    # tables: [rows, n] or [n] block ids -> [rows, n * block_size, 2, kv_heads, head_dim]
    rows = tables.shape[0] if tables.dim() == 2 else 1
    return blocks.index_select(0, tables.reshape(-1)).view(rows, -1, *slot_shape)
