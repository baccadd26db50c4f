"""KV bytes on the wire: raw, or quantized to 8 bits with one float32 scale per token, K/V and head.

A quantized payload of n tokens is `[scales: n*2*kv_heads float32][values: n*2*kv_heads*head_dim]`,
values int8 (symmetric, scale = absmax / 127) or float8 e4m3 (scale = absmax / 448). The scales
travel with the data, so the receiver needs nothing else to restore the cache's dtype.
"""

from __future__ import annotations

import torch

from pdserve.kv_transfer.base import KVLayout

ENCODINGS = ("raw", "int8", "fp8", "direct")
_QUANT = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def encoded_size(layout: KVLayout, num_tokens: int, encoding: str) -> int:
    if encoding == "raw":
        return num_tokens * layout.slot_bytes
    if encoding == "direct":
        return 0
    if encoding in _QUANT:
        return num_tokens * 2 * layout.num_kv_heads * (layout.head_dim + 4)
    raise ValueError(f"unknown KV encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")


def gather_slots(kv_cache: torch.Tensor, layer: int | slice, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The KV of one layer (or a slice of layers) at the given slot runs, slots in order:
    [tokens, 2, kv_heads, head_dim] (or [layers, tokens, ...])."""
    parts = [kv_cache[layer, s : s + n] for s, n in runs]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0 if isinstance(layer, int) else 1)


def gather_split(kv_cache: torch.Tensor, own_ranks: int, wire_ranks: int, layer: int,
                 runs: list[tuple[int, int]]) -> torch.Tensor:
    """Pool layer `layer` of a worker of `wire_ranks` ranks, at the slot runs, read from this pool of
    `own_ranks` (`KVLayout`): the heads that rank holds of that model layer, taken from the pool
    layers of this side's ranks that hold them. [tokens, 2, heads, head_dim]."""
    if own_ranks == wire_ranks:
        return gather_slots(kv_cache, layer, runs)
    own_heads = kv_cache.shape[3]
    wire_heads = own_heads * own_ranks // wire_ranks
    model_layer, rank = divmod(layer, wire_ranks)
    lo, hi = rank * wire_heads, (rank + 1) * wire_heads  # of the model's heads
    parts = []
    for own in range(lo // own_heads, -(-hi // own_heads)):
        first = own * own_heads
        kv = gather_slots(kv_cache, model_layer * own_ranks + own, runs)
        parts.append(kv[:, :, max(lo, first) - first : min(hi, first + own_heads) - first])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def quantize(kv: torch.Tensor, encoding: str) -> bytes:
    """[tokens, 2, kv_heads, head_dim] in any float dtype -> the encoded payload."""
    qdtype, qmax = _QUANT[encoding]
    x = kv.float()
    scales = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
    q = x / scales
    q = q.round().clamp_(-qmax, qmax).to(qdtype) if qdtype == torch.int8 else q.to(qdtype)
    return scales.contiguous().numpy().tobytes() + q.contiguous().view(torch.uint8).numpy().tobytes()


def dequantize_into(
    kv_cache: torch.Tensor, layer: int, runs: list[tuple[int, int]], data: torch.Tensor, layout: KVLayout, encoding: str
) -> None:
    """Write a received payload (`data`, uint8 on the CPU) into the cache's slot runs."""
    num_tokens = sum(n for _, n in runs)
    shape = (num_tokens, 2, layout.num_kv_heads, layout.head_dim)
    if encoding == "raw":
        values = data.view(layout.torch_dtype).view(shape)
    else:
        qdtype, _ = _QUANT[encoding]
        num_scales = num_tokens * 2 * layout.num_kv_heads
        scales = data[: 4 * num_scales].view(torch.float32).view(*shape[:-1], 1)
        values = (data[4 * num_scales :].view(qdtype).float().view(shape) * scales).to(kv_cache.dtype)
    values = values.to(kv_cache.device)
    offset = 0
    for slot, n in runs:
        kv_cache[layer, slot : slot + n].copy_(values[offset : offset + n])
        offset += n
