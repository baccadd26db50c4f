"""Matrix multiplication by a weight, with a faster path for decode-sized float32 batches on CPU.

torch runs a float32 product with few rows (a decode step) on one thread: batch 1 streams ~14 GB/s
of weights on a machine that reads 30-50 GB/s. Splitting the weight's output rows into one slice
per thread and running the slices as a batched matmul uses every core: 1.8x faster at batch 1 and
still ahead at 64 rows on the demo model's shapes (past that, in the engine's mixed prefill steps,
plain `F.linear` measured as fast or faster).

bfloat16 weights on CPU are kept in oneDNN's blocked layout (`packed.pack_weight`) where oneDNN
supports it; `warm_up` builds its kernels for every row count a product will run at.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.layers.cpu import onednn_packs_bfloat16
from pdserve.layers.packed import pack_weight, packed_linear, row_counts
from pdserve.layers.block_weight import BlockWeight
from pdserve.layers.quant import Int4Weight, QuantizedWeight

__all__ = ["embedding_rows", "linear", "pack_weight", "warm_up"]

_SPLIT_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | Int4Weight | BlockWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [rows, in], weight: [out, in] (or packed by `pack_weight`, or quantized, or in blocks) -> [rows, out]
    if isinstance(weight, (QuantizedWeight, Int4Weight, BlockWeight)):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    if weight.is_mkldnn:
        return packed_linear(x, weight, bias)
    if torch.compiler.is_compiling():  # the compiler picks its own kernels
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    parts = torch.get_num_threads()
    if (
        rows > _SPLIT_MAX_ROWS
        or parts < 2
        or x.dtype != torch.float32
        or not x.is_cpu
        or weight.shape[0] % parts
    ):
        return F.linear(x, weight, bias)
    out_features = weight.shape[0]
    slices = weight.view(parts, out_features // parts, weight.shape[1]).transpose(1, 2)  # [parts, in, out/parts]
    y = torch.bmm(x.unsqueeze(0).expand(parts, rows, x.shape[1]), slices)  # [parts, rows, out/parts]
    y = y.transpose(0, 1).reshape(rows, out_features)
    return y if bias is None else y + bias


def embedding_rows(table: torch.Tensor | QuantizedWeight | BlockWeight, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` ([tokens]) of a token embedding, [tokens, hidden] in `dtype`: a table held
    quantized or in its file's blocks (the head's, when tied) expands only those rows."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.embedding(ids, dtype)


def warm_up(products: list[tuple[torch.Tensor | QuantizedWeight | Int4Weight, torch.Tensor | None, int]],
            dtype: torch.dtype) -> None:
    """Run each product (weight, bias, the most rows it will take) once at every row count the
    packed kernels pad to, on zeros of `dtype`: oneDNN builds a kernel per count, which a server
    would otherwise build in the middle of its steps. Only products that run on packed weights are
    run: the others (plain float32 or bfloat16 weights, GPU ones, the quantized kernels' own rows)
    need no kernel per count."""
    for weight, bias, max_rows in products:
        if isinstance(weight, (QuantizedWeight, BlockWeight)):  # dense (on a packed expansion) from min_rows up
            dense = weight.dense
            if dense.min_rows is None or not dense.keep or dtype != torch.bfloat16 or not onednn_packs_bfloat16():
                continue
            counts = [rows for rows in row_counts(max_rows) if rows >= dense.min_rows]
            in_features = weight.in_features
        elif isinstance(weight, torch.Tensor) and weight.is_mkldnn:
            counts, in_features = row_counts(max_rows), weight.shape[1]
        else:
            continue
        for rows in counts:
            linear(torch.zeros(rows, in_features, dtype=dtype), weight, bias)
