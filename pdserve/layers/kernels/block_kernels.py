"""pdserve's kernels for weights in GGUF's block formats (`blocks.c`, `blocks_amx.h`), by GGML type
id: products of a weight or a fused weight's parts (several formats stacked along the outputs),
on byte dot products or AMX tiles, and expansions (whole, or the rows an embedding looks up).
Composed into `NativeKernels` as its `blocks`; every argument checked here before C sees it."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES

from pdserve.layers.kernels.checks import check, contiguous
from pdserve.layers.packed import activation_buffer

MAX_BLOCK_PARTS = 8  # blocks.c's MAX_PARTS


@dataclass(frozen=True, slots=True)
class BlockParts:
    """A fused weight's parts in GGUF block formats, as `pd_block_matmul_parts` takes them."""

    formats: ctypes.Array  # int64 [count]: GGML type ids
    rows: ctypes.Array  # int64 [count]
    data: ctypes.Array  # pointers [count] to each part's bytes
    count: int
    in_features: int
    out_features: int
    tensors: list  # the parts' bytes, kept alive while `data` points into them


@dataclass(frozen=True, slots=True)
class BlockKernels:
    lib: ctypes.CDLL
    isa: int  # the variant calls run (native.ISA_NAMES)
    amx: bool  # whether `matmul_amx` runs here (AMX tiles and AVX-512 BF16, with the AVX-512 variant)

    def format_supported(self, format: int) -> bool:
        """Whether the block kernels serve ggml type `format` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K,
        IQ4_NL, IQ4_XS)."""
        return _format_supported(self.lib, format)

    def matmul(self, x: torch.Tensor, format: int, w: torch.Tensor, out_features: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] float32 or bfloat16 (contiguous) @ w^T, w the file's bytes ([out_features,
        row bytes] uint8) -> [rows, out_features] in x's dtype; or into `out` ([rows, >= out_features],
        x's dtype, rows may be strided: a column slice of a wider output), which is returned."""
        rows, in_features = x.shape
        contiguous(x)
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"block_matmul takes float32 or bfloat16 activations, not {x.dtype}")
        self._check_blocks(format, w, out_features, in_features)
        if out is None:
            out = torch.empty(rows, out_features, dtype=x.dtype)
        elif (out.dtype != x.dtype or out.dim() != 2 or out.shape[0] != rows or out.shape[1] < out_features
              or out.stride(1) != 1 or (rows > 1 and out.stride(0) < out_features)):
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} strides {out.stride()} cannot take "
                             f"[{rows}, {out_features}] {x.dtype} outputs in rows of its own")
        rc = self.lib.pd_block_matmul(self.isa, torch.get_num_threads(), format, x.data_ptr(),
                                      x.dtype == torch.bfloat16, rows, in_features, w.data_ptr(), out_features,
                                      out.data_ptr(), out.stride(0) if rows > 1 else max(out_features, 1))
        if rc:
            raise RuntimeError(f"pd_block_matmul failed ({'bad arguments' if rc == -1 else 'out of memory'}): "
                               f"format {format}, x {tuple(x.shape)}, {out_features} outputs")
        return out

    def parts(self, parts: list[tuple[int, torch.Tensor]], in_features: int) -> BlockParts:
        """A fused weight's parts, (format, bytes [rows, row bytes] uint8) each, checked once and
        held as `matmul_parts` takes them (at most 8)."""
        if not 1 <= len(parts) <= MAX_BLOCK_PARTS:
            raise ValueError(f"a weight has 1 to {MAX_BLOCK_PARTS} parts, not {len(parts)}")
        for format, w in parts:
            self._check_blocks(format, w, w.shape[0], in_features)
        n = len(parts)
        return BlockParts((ctypes.c_int64 * n)(*(f for f, _ in parts)), (ctypes.c_int64 * n)(*(w.shape[0] for _, w in parts)),
                          (ctypes.c_void_p * n)(*(w.data_ptr() for _, w in parts)), n, in_features,
                          sum(w.shape[0] for _, w in parts), [w for _, w in parts])

    def matmul_parts(self, x: torch.Tensor, parts: BlockParts) -> torch.Tensor:
        """x [rows, in] float32 or bfloat16 (contiguous) @ the fused weight's transpose -> [rows, out]
        in x's dtype: the activations quantized once for every part, one parallel region."""
        rows, in_features = x.shape
        contiguous(x)
        if x.dtype not in (torch.float32, torch.bfloat16) or in_features != parts.in_features:
            raise ValueError(f"block_matmul_parts takes float32 or bfloat16 [rows, {parts.in_features}], not "
                             f"{tuple(x.shape)} {x.dtype}")
        y = torch.empty(rows, parts.out_features, dtype=x.dtype)
        rc = self.lib.pd_block_matmul_parts(self.isa, torch.get_num_threads(), parts.count, parts.formats, parts.rows,
                                            parts.data, x.data_ptr(), x.dtype == torch.bfloat16, rows, in_features,
                                            y.data_ptr(), parts.out_features)
        if rc:
            raise RuntimeError(f"pd_block_matmul_parts failed ({'bad arguments' if rc == -1 else 'out of memory'}): "
                               f"x {tuple(x.shape)}, {parts.out_features} outputs in {parts.count} parts")
        return y

    def matmul_amx(self, x: torch.Tensor, parts: BlockParts) -> torch.Tensor:
        """`matmul_parts` of bfloat16 rows on AMX tiles (where `amx`): the
        weight expanded to bfloat16 a block at a time as it is read, every row multiplied at once."""
        rows, in_features = x.shape
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or in_features != parts.in_features:
            raise ValueError(f"block_matmul_amx takes contiguous bfloat16 [rows, {parts.in_features}], not "
                             f"{tuple(x.shape)} {x.dtype}")
        y = activation_buffer(rows, parts.out_features, x.dtype)
        check(self.lib.pd_block_matmul_amx(self.isa, torch.get_num_threads(), parts.count, parts.formats, parts.rows,
                                            parts.data, x.data_ptr(), rows, in_features, y.data_ptr(),
                                            parts.out_features), "block_matmul_amx")
        return y

    def dequantize(self, format: int, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The whole weight (w: [out, row bytes] uint8) into `out` ([out, in] float32 or bfloat16,
        contiguous): gguf's values, bit for bit in float32."""
        contiguous(out)
        self._check_blocks(format, w, out.shape[0], out.shape[1])
        _check_expansion(out)
        check(self.lib.pd_block_dequantize(self.isa, torch.get_num_threads(), format, w.data_ptr(), out.shape[0],
                                            out.shape[1], out.data_ptr(), out.dtype == torch.bfloat16),
               "block_dequantize")
        return out

    def rows(self, format: int, w: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [count]) of the weight expanded into `out` ([count, in] float32 or bfloat16,
        contiguous): an embedding lookup from a quantized table."""
        contiguous(out, ids)
        if ids.dtype != torch.int64 or ids.dim() != 1 or out.shape[0] != ids.shape[0]:
            raise ValueError(f"ids must be int64 [count] with out [count, in]; got ids {tuple(ids.shape)} "
                             f"{ids.dtype}, out {tuple(out.shape)}")
        self._check_blocks(format, w, w.shape[0], out.shape[1])
        _check_expansion(out)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
            raise ValueError(f"ids must lie in [0, {w.shape[0]}): got {int(ids.min())}..{int(ids.max())}")
        check(self.lib.pd_block_rows(self.isa, torch.get_num_threads(), format, w.data_ptr(), out.shape[1],
                                      ids.data_ptr(), ids.shape[0], out.data_ptr(), out.dtype == torch.bfloat16),
               "block_rows")
        return out

    def _check_blocks(self, format: int, w: torch.Tensor, out_features: int, in_features: int) -> None:
        """w must be out_features rows of in_features elements of `format`, as the file stores them."""
        if not self.format_supported(format):
            raise ValueError(f"the block kernels do not serve ggml type {format}")
        elements, size = GGML_QUANT_SIZES[format]
        if in_features < 1 or in_features % elements:
            raise ValueError(f"ggml type {format} takes rows of whole blocks of {elements}, not {in_features} elements")
        row_bytes = in_features // elements * size
        if w.dtype != torch.uint8 or tuple(w.shape) != (out_features, row_bytes) or not w.is_contiguous():
            raise ValueError(f"w must be contiguous uint8 [{out_features}, {row_bytes}] (ggml type {format}, "
                             f"{in_features} inputs); got {w.dtype} {tuple(w.shape)}")


@functools.lru_cache(maxsize=None)
def _format_supported(lib: ctypes.CDLL, format: int) -> bool:
    return bool(lib.pd_block_format_supported(format))


def _check_expansion(out: torch.Tensor) -> None:
    if out.dim() != 2 or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"expands into [rows, in] float32 or bfloat16, not {tuple(out.shape)} {out.dtype}")


def declare_block_kernels(lib: ctypes.CDLL) -> None:
    """The block entry points' ctypes signatures, on the loaded library."""
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pd_block_format_supported.argtypes = [i32]
    lib.pd_block_matmul.argtypes = [i32, i32, i32, ptr, i32, i64, i64, ptr, i64, ptr, i64]
    lib.pd_block_matmul_parts.argtypes = [i32, i32, i64, ptr, ptr, ptr, ptr, i32, i64, i64, ptr, i64]
    lib.pd_block_matmul_amx.argtypes = [i32, i32, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i64]
    lib.pd_block_dequantize.argtypes = [i32, i32, i32, ptr, i64, i64, ptr, i32]
    lib.pd_block_rows.argtypes = [i32, i32, i32, ptr, i64, ptr, i64, ptr, i32]
    for name in ("pd_block_format_supported", "pd_block_matmul", "pd_block_matmul_parts", "pd_block_matmul_amx",
                 "pd_block_dequantize", "pd_block_rows"):
        getattr(lib, name).restype = i32
