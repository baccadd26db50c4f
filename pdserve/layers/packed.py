"""bfloat16 weights in oneDNN's blocked layout, where oneDNN supports it (AVX-512 or
AVX-NE-CONVERT; not on an AVX2-only CPU, which keeps them plain): the same products as `F.linear`
(up to the order of a sum: bit for bit at batch 1), and 1.2-1.8x faster than it on plain weights
from batch 1 to 64 rows (no slower at 512).

oneDNN picks the blocking from a batch-size hint. Without one it may pick a blocking its AMX
kernels read slowly (on a Xeon with AMX: 32-row blocks, 1.3 ms for a 1024 x 1536 x 576 product
against 0.8 ms with the 64-row blocks it picks for batch 1; for another shape it is the other way
round), so each weight shape's layout is chosen by timing both on this CPU, once per process
(`_fastest_hint`).

oneDNN also builds (JIT-compiles) a kernel for each number of rows it meets: 3-5 ms a weight shape
on 2 cores, and a server under load meets a new count at almost every step (each mix of prefill
chunks and decodes is one). A product therefore runs on its rows padded up to one of a few counts
(`padded_rows`: at most an eighth more), whose kernels `warm_up` builds before requests come.
The kernels that write a product's input allocate it with room for those rows
(`activation_buffer`), so padding costs no copy."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pdserve.layers.cpu import onednn_packs_bfloat16
from pdserve.layers.timing import best_seconds

_HINTS = (None, 1)  # oneDNN's layout without a batch size, and the one it picks for batch 1
_PREFILL_ROWS = (256, 512, 1024, 2048)  # the products that decide: prefill steps' (decode rarely differs)
_DECODE_SLACK = 1.1  # a layout may not be slower than this at batch 1 to win
_MEASURED_OUTPUTS = 4096  # a weight's output rows the layouts are timed on, at most


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the layout the fastest kernel for its device and dtype reads."""
    if weight.is_cpu and weight.dtype == torch.bfloat16 and onednn_packs_bfloat16():
        return torch.ops.mkldnn._reorder_linear_weight(weight, _fastest_hint(*weight.shape))
    return weight


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) for a weight `pack_weight` packed; x [rows, in]."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:  # the padding rows' products are computed and dropped: rows are independent
        return torch.ops.mkldnn._linear_pointwise(_padded(x, padded), weight, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def activation_buffer(rows: int, width: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialized [rows, width] tensor on storage with room for `padded_rows(rows)` rows: a
    packed product reads it at its padded count in place (the rows past `rows` hold whatever the
    memory held; their products are dropped)."""
    return torch.empty(padded_rows(rows), width, dtype=dtype, device=device)[:rows]


def _padded(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x's rows and the rows after them up to `padded`: a view where x's storage holds them (an
    `activation_buffer`), else a copy with zero rows appended."""
    width = x.shape[1]
    if (x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() >= padded * width * x.element_size()):
        return x.as_strided((padded, width), (width, 1))
    return F.pad(x, (0, 0, 0, padded - x.shape[0]))


def padded_rows(rows: int) -> int:
    """The row count a product of `rows` rows runs at: exact below 16, else rounded up to a
    multiple of an eighth of the power of two below it (1000 -> 1024, 1025 -> 1152)."""
    if rows < 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def row_counts(max_rows: int) -> list[int]:
    """Every count `padded_rows` gives for 1 to `max_rows` rows."""
    counts, rows = [], 1
    while rows <= max_rows:
        counts.append(padded_rows(rows))
        rows = counts[-1] + 1
    return counts


@functools.lru_cache(maxsize=None)
def _fastest_hint(out_features: int, in_features: int) -> int | None:
    """The batch-size hint whose layout runs products of this shape fastest here: the faster over
    `_PREFILL_ROWS` (oneDNN's kernels have cliffs at some row counts, so one size would mislead),
    unless it is slower at batch 1 by more than `_DECODE_SLACK`; within 5% oneDNN's default stays.
    A random weight of the shape (of its first `_MEASURED_OUTPUTS` rows: a vocabulary's head would
    take seconds), best of a few runs: 40-130 ms a shape on 2 cores."""
    weight = torch.randn(min(out_features, _MEASURED_OUTPUTS), in_features).to(torch.bfloat16)
    inputs = [torch.randn(rows, in_features).to(torch.bfloat16) for rows in (*_PREFILL_ROWS, 1)]
    prefill, decode = {}, {}
    for hint in _HINTS:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        times = [best_seconds(lambda: packed_linear(x, packed)) for x in inputs]
        prefill[hint], decode[hint] = sum(times[:-1]), times[-1]
    default, other = _HINTS
    if prefill[other] < 0.95 * prefill[default] and decode[other] <= _DECODE_SLACK * decode[default]:
        return other
    return default
