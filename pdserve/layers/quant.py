"""4-bit weights: groups of 32 along the input, each with its own scale and minimum (asymmetric
round-to-nearest, the rule of GGUF's Q4_1), multiplied by torch's CPU int4 kernel.

A batch-1 decode reads a quarter of the bytes of bfloat16. For a Q4_1 GGUF the dequantized
weights re-quantize to exactly the file's own 4-bit values: each block's minimum and maximum are
its q=0 and q=15 levels. Only the scales are rounded to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # the kernel's tiled int4 layout
    scales_and_zeros: torch.Tensor  # [in / group, out, 2]: w = (q - 8) * scale + zero
    group_size: int
    out_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype, group_size: int = GROUP_SIZE) -> Int4Weight:
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs input sizes divisible by {group_size}, got {in_features}")
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low).clamp(min=1e-12) / 15
    q = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(q.view(out_features, in_features), 1)
    return Int4Weight(packed, scales_and_zeros, group_size, out_features)


def dequantize_int4_reference(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """What `quantize_int4` makes of a weight, in float32 (for tests and accuracy reports)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-12) / 15
    q = ((groups - low) / scale).round().clamp(0, 15)
    return (q * scale + low).view(out_features, in_features)
