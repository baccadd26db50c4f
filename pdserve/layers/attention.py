"""Attention over a paged KV cache.

The cache of one layer is a flat slot array `[num_blocks * block_size, 2, kv_heads, head_dim]`, a
token's K and V side by side (one write and one read per layer; a block's KV for a layer is one
contiguous range, which is what a transfer ships); a token at position p of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`. New K/V are scattered into their
slots, then each query reads its context back a whole block at a time (`index_select` of blocks:
~10x faster on CPU than advanced indexing of single slots). Requests computing one
token (decodes) share batched calls, one per group of similar context lengths (a batch padded to
its longest context would make 60 short requests read a 2,000-token one's length each step);
multi-token chunks (prefills) are computed one by one.

Where the step runs pdserve's kernels (`AttentionMetadata.kernels`), the layer writes the new K/V
itself (with rotary, in one call) and `attend_cached` reads the cache: decodes in one kernel call
for all rows, each over its own context (no padding, no gather); prefill chunks in one call each
where the CPU has AMX tiles or AVX512-BF16 dot products (bfloat16, blocks of 16 tokens or more:
`prefill_attention`), as above elsewhere.

A layer with a sliding window (`window`: Mistral's, Gemma 3's local layers) lets the query at
position p see keys p - window + 1 .. p only: the decode kernel starts each row's context there,
torch's paths mask the rest, and a prefill chunk whose context outgrows the window runs torch's
path on just the keys its queries can see. The blocks before a window stay in the cache: every
layer of a request shares one block table.

Under `torch.compile` the attention is one opaque operator (`pdserve::paged_attention`) that reads
the step's metadata from `step_metadata(...)`: a compiled graph then depends on the number of
tokens only, not on context lengths or block tables, and one graph serves every decode step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.layers.kernels.native import NativeKernels
from pdserve.layers.packed import activation_buffer


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the step's flat token batch
    query_len: int  # tokens computed in this chunk
    context_len: int  # tokens the chunk attends to (cached prefix + itself)
    context_blocks: torch.Tensor  # [ceil(context_len / block_size)] block ids holding them
    # [query_len, context_len] added to the scores: 0 where a query sees the key, -inf where not (a
    # bool mask would be converted to this by every layer's attention call); None when plainly causal
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended in one call (padded to the group's longest)."""

    rows: torch.Tensor | None  # [g] their rows among the step's decodes; None: all, in order
    blocks: torch.Tensor  # [g, max_blocks] block tables, padded
    context_len: int  # the group's longest context
    mask: torch.Tensor | None  # [g, 1, 1, context_len] bool; None if all equal
    lens: torch.Tensor  # [g] each row's context length (a sliding layer masks by it)
    shortest: int  # the group's shortest context


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    block_size: int
    num_decode_tokens: int  # the batch's first tokens are decodes, one per request
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # torch's decode attention
    prefills: list[PrefillChunk] = field(default_factory=list)
    # pdserve's kernels run this step's norms, rotary, cache writes and decode attention; None: torch
    kernels: NativeKernels | None = None
    decode_tables: torch.Tensor | None = None  # [decodes, max_blocks] int64, padded: for the kernel
    decode_lens: torch.Tensor | None = None  # [decodes] int64 context lengths, the new token included


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    kv: torch.Tensor,  # [tokens, 2, kv_heads, head_dim] the new tokens' K and V
    kv_cache: torch.Tensor,  # [slots, 2, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # a sliding layer's: each query sees its last `window` tokens
) -> torch.Tensor:  # [tokens, heads * head_dim]
    kv_cache.index_copy_(0, meta.slot_mapping, kv)
    return attend_cached(q, kv_cache, meta, scale, window)


def attend_cached(
    q: torch.Tensor,  # [tokens, heads, head_dim] (rows may be strided)
    kv_cache: torch.Tensor,  # [slots, 2, kv_heads, head_dim], the step's new K/V already in it
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [tokens, heads * head_dim]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    gqa = num_heads != num_kv_heads
    nd = meta.num_decode_tokens
    out = None if nd == num_tokens else activation_buffer(num_tokens, num_heads * head_dim, q.dtype, q.device).view(
        num_tokens, num_heads, head_dim)  # the output projection's input
    blocks = kv_cache.view(-1, meta.block_size * kv_cache[0].numel())  # [num_blocks, block bytes]
    if nd and meta.kernels is not None:
        o = meta.kernels.decode_attention(q[:nd], kv_cache, meta.block_size, meta.decode_tables, meta.decode_lens,
                                          scale, window)
        if not meta.prefills:
            return o
        out[:nd] = o.view(nd, num_heads, head_dim)
    elif nd:
        # The query heads sharing a KV head act as that head's queries: plain attention, no copies.
        qd = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:
            o = _decode_attention(blocks, qd, groups[0], kv_cache.shape[1:], scale, window)
        else:
            o = torch.empty_like(qd)
            for g in groups:
                o.index_copy_(0, g.rows, _decode_attention(blocks, qd.index_select(0, g.rows), g,
                                                           kv_cache.shape[1:], scale, window))
        if not meta.prefills:  # a decode-only step: no buffer to assemble
            return o.reshape(num_tokens, num_heads * head_dim)
        out[:nd] = o.view(nd, num_heads, head_dim)
    kernels = meta.kernels
    own_prefill = (kernels is not None and q.dtype == torch.bfloat16 and meta.block_size % 16 == 0
                   and head_dim % 32 == 0 and kernels.prefill_attention_available)
    for chunk in meta.prefills:
        s, n = chunk.query_start, chunk.query_len
        if window is not None and chunk.context_len > window:
            out[s : s + n] = _windowed_prefill(q[s : s + n], blocks, chunk, kv_cache.shape[1:], scale, window, gqa)
            continue
        if own_prefill:
            kernels.prefill_attention(q[s : s + n], kv_cache, meta.block_size, chunk.context_blocks,
                                      chunk.context_len, scale, out[s : s + n])
            continue
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


def _decode_attention(blocks: torch.Tensor, qd: torch.Tensor, group: DecodeGroup, slot_shape: torch.Size,
                      scale: float, window: int | None) -> torch.Tensor:
    mask = group.mask
    first = 0  # the first key any row of the group sees
    if window is not None and group.context_len > window:
        first = max(0, group.shortest - window)
        keys = torch.arange(first, group.context_len, device=qd.device)
        lens = group.lens.unsqueeze(1)
        mask = ((keys < lens) & (keys >= lens - window)).view(len(group.lens), 1, 1, -1)
    ctx = _read_blocks(blocks, group.blocks, slot_shape)[:, first : group.context_len]  # [g, ctx, 2, kv_heads, head_dim]
    ctx_k = ctx[:, :, 0].transpose(1, 2)  # [g, kv_heads, ctx, head_dim]
    ctx_v = ctx[:, :, 1].transpose(1, 2)
    return F.scaled_dot_product_attention(qd, ctx_k, ctx_v, attn_mask=mask, scale=scale)


def _windowed_prefill(q: torch.Tensor, blocks: torch.Tensor, chunk: PrefillChunk, slot_shape: torch.Size,
                      scale: float, window: int, gqa: bool) -> torch.Tensor:
    """A chunk's attention ([n, heads, head_dim]) where its context is longer than the window: over
    the keys its first query can see on, each query masked to its own window."""
    n, ctx_len = chunk.query_len, chunk.context_len
    first = max(0, ctx_len - n - window + 1)
    block_size = blocks.shape[1] // (slot_shape.numel())
    first_block = first // block_size
    ctx = _read_blocks(blocks, chunk.context_blocks[first_block:], slot_shape)[0]
    ctx = ctx[first - first_block * block_size : ctx_len - first_block * block_size]  # [keys, 2, kv_heads, head_dim]
    q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(first, ctx_len, device=q.device).unsqueeze(0)
    unseen = (k_pos > q_pos) | (k_pos <= q_pos - window)
    mask = torch.zeros(unseen.shape, dtype=q.dtype, device=q.device).masked_fill_(unseen, -torch.inf)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), ctx[:, 0].transpose(0, 1).unsqueeze(0), ctx[:, 1].transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _read_blocks(blocks: torch.Tensor, tables: torch.Tensor, slot_shape: torch.Size) -> torch.Tensor:
    # tables: [rows, n] or [n] block ids -> [rows, n * block_size, 2, kv_heads, head_dim]
    rows = tables.shape[0] if tables.dim() == 2 else 1
    return blocks.index_select(0, tables.reshape(-1)).view(rows, -1, *slot_shape)


_step = threading.local()  # one engine per thread: several engines may share a process


@contextmanager
def step_metadata(meta: AttentionMetadata, kv_caches: torch.Tensor) -> Iterator[None]:
    """The metadata and KV cache (all layers) `paged_attention_op` uses while a compiled step runs
    on this thread. The cache never enters the graph: the compiler sees no mutation to order."""
    previous = getattr(_step, "state", None)
    _step.state = (meta, kv_caches)
    try:
        yield
    finally:
        _step.state = previous


# A plain operator library, not `torch.library.custom_op`: that wrapper's checks cost ~35 us a
# call, about half of a batch-1 decode's attention, thirty times a step.
_library = torch.library.Library("pdserve", "DEF")
_library.define("paged_attention(Tensor q, Tensor kv, int layer, float scale, int window) -> Tensor")


def _paged_attention_of_step(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int) -> torch.Tensor:
    """`paged_attention` of one layer with the metadata and cache of the step running on this thread.
    A step of no real token (the run that compiles a graph) gets zeros and writes no KV."""
    meta, kv_caches = _step.state
    if not meta.slot_mapping.numel():
        return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    return paged_attention(q, kv, kv_caches[layer], meta, scale, window or None)


_library.impl("paged_attention", _paged_attention_of_step, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


paged_attention_op = torch.ops.pdserve.paged_attention
