"""GGUF's block formats (llama.cpp's quantization types), as pdserve holds a tensor stored in one.

A row of a weight [out, in] is `in / elements` blocks back to back, each `bytes` long, exactly as the
file stores it: a weight keeps its file's bytes from disk to the product (`block_weight.py`), so
a decode step reads what the file holds. The layouts themselves live in the kernels
(`kernels/blocks.c`), checked against the `gguf` package's reference dequantization.

`FORMATS` lists the types served as stored; a file's other quantized types are expanded at load
where the `gguf` package can do it (served in the activation dtype), and refused where it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str  # GGUF's (GGMLQuantizationType's) name
    type_id: int  # GGML's type number: what the kernels take
    elements: int  # weights a block holds
    bytes: int  # a block's size


FORMATS: dict[int, BlockFormat] = {f.type_id: f for f in (
    BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q4_1", 3, 32, 20),
    BlockFormat("Q5_0", 6, 32, 22),
    BlockFormat("Q5_1", 7, 32, 24),
    BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q2_K", 10, 256, 84),
    BlockFormat("Q3_K", 11, 256, 110),
    BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176),
    BlockFormat("Q6_K", 14, 256, 210),
    BlockFormat("IQ4_NL", 20, 32, 18),
    BlockFormat("IQ4_XS", 23, 256, 136),
)}
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGUF's F32, F16, BF16


@dataclass(slots=True)
class StoredBlocks:
    """A matrix in its file's block format: `data` [out, in / elements * bytes] uint8, the file's
    own bytes (a read-only view of the mapped file, or a copy where rows were reordered)."""

    format: BlockFormat
    shape: tuple[int, int]  # [out, in] as the weights it stands for
    data: torch.Tensor

    def __post_init__(self) -> None:
        out, inp = self.shape
        if inp % self.format.elements:
            raise ValueError(f"a {self.format.name} matrix needs rows of whole blocks of {self.format.elements}, "
                             f"not {inp}")
        expected = (out, inp // self.format.elements * self.format.bytes)
        if tuple(self.data.shape) != expected or self.data.dtype != torch.uint8:
            raise ValueError(f"{self.format.name} blocks of a {out} x {inp} matrix are {expected} bytes, "
                             f"got {tuple(self.data.shape)} {self.data.dtype}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor | slice) -> StoredBlocks:
        """The rows `index` picks, in their own bytes (a permutation of q/k rows, a rank's share)."""
        data = self.data[index]
        return StoredBlocks(self.format, (data.shape[0], self.shape[1]), data.contiguous())

    def dequantize(self) -> torch.Tensor:
        """The values the blocks stand for, [out, in] float32, by the `gguf` package's reference rules."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data.numpy(), GGMLQuantizationType(self.format.type_id))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)
