"""Matmul weights held in their GGUF file's own block formats (`block_formats.py`), multiplied by
pdserve's kernels (`kernels/blocks.c`) without converting them at load.

A fused weight (q/k/v, gate/up) is a stack of parts, each in its own format: llama.cpp's Q4_K_M
mixes Q5_0, Q8_0, Q4_K and Q6_K, and may store a layer's q and v differently. A product runs
every part in one kernel call, each into its own columns of one output. Its activations are quantized to int8 in groups of 32
and multiplied a block at a time, so a decode step reads the file's bytes and nothing else.

Where a product has rows enough that arithmetic, not the weight's bytes, is its cost, it runs on
AMX tiles where the CPU has them (bfloat16 rows from `DenseProducts.tile_rows` up: the weight
expanded a block at a time as it is read, `kernels/blocks_amx.h`), or dense (a prefill chunk):
the weight expanded into a buffer the model's weights share (or an expanded copy kept, where the
model's copies fit the memory set aside: `dense_memory_budget`), from `DenseProducts.min_rows`
rows up; both measured on this CPU when the model loads.

A weight all of whose parts are Q4_1, or all Q8_0, is held as a `QuantizedWeight` instead
(`hold_blocks`): the same values, whose kernels also run panels, AMX tiles and the one-call
decode stack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from pdserve.layers.block_formats import StoredBlocks
from pdserve.layers.kernels.block_kernels import BlockParts
from pdserve.layers.kernels.native import NativeKernels
from pdserve.layers.measured import machine_key
from pdserve.layers.packed import pack_weight, packed_linear
from pdserve.layers.quant import (
    _TILE_CALIBRATION_ROWS, GROUP_SIZE, THRESHOLDS, DenseProducts, QuantizedWeight, with_panels,
)
from pdserve.layers.timing import best_seconds

log = logging.getLogger("pdserve.kernels")

# Dense products are weighed from 32 rows, up to a default prefill chunk: below, a step is a decode
# batch, which the decode stack runs in one call while dense products leave it for the model's
# modules; timing products alone leaves that call's saving out (a 135M model's 8-row steps ran 13%
# slower dense, its products measured 10% faster).
_CALIBRATION_ROWS = (32, 64, 128, 256, 512)
_Q4_1, _Q8_0 = 3, 8  # GGML type ids of the formats `QuantizedWeight` holds as they are


@dataclass(slots=True)
class BlockWeight:
    """A weight [out, in] as stacked parts in their file's block formats."""

    parts: list[StoredBlocks]  # along the outputs: each part's rows follow the one before
    kernels: NativeKernels
    dense: DenseProducts = field(default_factory=DenseProducts)  # shared by a model's block weights
    expanded: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # kept copies (`dense.keep`)
    plan: BlockParts | None = field(default=None, repr=False)  # the parts as the kernels take them

    def __post_init__(self) -> None:
        widths = {p.shape[1] for p in self.parts}
        if len(widths) != 1:
            raise ValueError(f"the parts of a fused weight take inputs of one size, not {sorted(widths)}")

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        """The bytes a product of few rows reads: the file's."""
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        if x.dtype not in (torch.float32, torch.bfloat16):
            return self.matmul(x.float()).to(x.dtype)
        rows = x.shape[0]
        if self.dense.min_rows is not None and rows >= self.dense.min_rows:
            return self.matmul_dense(x)
        if self.dense.tile_rows is not None and rows >= self.dense.tile_rows and x.dtype == torch.bfloat16:
            return self.matmul_tiles(x)
        return self.matmul_blocks(x)

    def matmul_blocks(self, x: torch.Tensor) -> torch.Tensor:  # every part in one kernel call
        return self.kernels.blocks.matmul_parts(x.contiguous(), self.kernel_parts())

    def matmul_tiles(self, x: torch.Tensor) -> torch.Tensor:  # bfloat16 rows, on AMX tiles
        return self.kernels.blocks.matmul_amx(x.contiguous(), self.kernel_parts())

    def kernel_parts(self) -> BlockParts:
        if self.plan is None:
            self.plan = self.kernels.blocks.parts([(p.format.type_id, p.data) for p in self.parts], self.in_features)
        return self.plan

    def matmul_dense(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dense.keep:
            return F.linear(x, self.expand_into(self.dense.buffer(self.out_features, self.in_features, x.dtype)))
        w = self.expanded.get(x.dtype)
        if w is None:  # expanded once, kept in the layout the dense kernel reads fastest
            w = self.expanded[x.dtype] = pack_weight(
                self.expand_into(torch.empty(self.out_features, self.in_features, dtype=x.dtype)))
        return packed_linear(x, w) if w.is_mkldnn else F.linear(x, w)

    def expand_into(self, out: torch.Tensor) -> torch.Tensor:
        """The weight's values into `out` ([out, in] float32 or bfloat16, contiguous)."""
        row = 0
        for part in self.parts:
            rows = part.shape[0]
            self.kernels.blocks.dequantize(part.format.type_id, part.data, out[row : row + rows])
            row += rows
        return out

    def dequantize(self) -> torch.Tensor:
        """The weight these blocks stand for, [out, in] float32."""
        return self.expand_into(torch.empty(self.out_features, self.in_features))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` ([tokens] int64) of a one-part table (a token embedding), [tokens, in] in `dtype`."""
        if len(self.parts) != 1:
            raise ValueError("an embedding table is one matrix, not a fused weight")
        part = self.parts[0]
        out = torch.empty(ids.shape[0], self.in_features, dtype=dtype)
        return self.kernels.blocks.rows(part.format.type_id, part.data, ids.contiguous(), out)


def hold_blocks(parts: list[StoredBlocks], kernels: NativeKernels) -> BlockWeight | QuantizedWeight:
    """The holder that serves `parts` fastest: Q4_1 or Q8_0 throughout as a `QuantizedWeight` (its
    layout is theirs, scales split off), anything else as a `BlockWeight`."""
    types = {p.format.type_id for p in parts}
    if types not in ({_Q4_1}, {_Q8_0}) or parts[0].shape[1] % GROUP_SIZE:
        return BlockWeight(parts, kernels)
    data = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
    out, groups = data.shape[0], parts[0].shape[1] // GROUP_SIZE
    blocks = data.view(out, groups, -1)  # per block: d (float16), [m (float16),] the quants
    scales = blocks[..., 0:2].contiguous().view(torch.float16).view(out, groups)
    if types == {_Q8_0}:
        qs = blocks[..., 2:].contiguous().view(torch.int8).view(out, groups * GROUP_SIZE)
        return with_panels(QuantizedWeight(8, qs, scales, None, kernels))
    mins = blocks[..., 2:4].contiguous().view(torch.float16).view(out, groups)
    qs = blocks[..., 4:].contiguous().view(out, groups * GROUP_SIZE // 2)  # Q4_1's nibbles: QuantizedWeight's order
    return with_panels(QuantizedWeight(4, qs, scales, mins, kernels))


def calibrate_blocks(weights: list[BlockWeight], dtype: torch.dtype) -> tuple[int | None, int | None]:
    """(tile_rows, min_rows) for these weights (every block weight of a model's layers, in the
    order a step runs them): the fewest rows from which their products run faster on AMX tiles than
    on byte dot products (None: no tiles here, or never faster), and from which they run faster
    dense than on either (None: at no size measured), measured now over all of them in turn. All of
    them, not one shape's: timed alone, a shape's expanded copies stay in a large cache that a whole
    step's weights overflow, which flatters dense products (a 135M model's calibration on one shape
    sent 8-row decode steps dense at half the speed of its blocks). Kept per machine and model in
    `THRESHOLDS`."""
    first = weights[0]
    tiles = dtype == torch.bfloat16 and first.kernels.blocks.amx
    key = machine_key("calibrate-blocks", sorted({p.format.name for w in weights for p in w.parts}),
                      sum(w.nbytes for w in weights), len(weights), str(dtype), torch.get_num_threads(),
                      first.dense.keep, tiles, list(_CALIBRATION_ROWS), list(_TILE_CALIBRATION_ROWS))
    with THRESHOLDS.locked():
        entry = THRESHOLDS.read().get(key)
        found = entry.get("rows") if isinstance(entry, dict) else None
        if isinstance(found, list) and len(found) == 2 and all(r is None or (isinstance(r, int) and r > 0)
                                                               for r in found):
            log.info("block weights: (tiles, dense) from %s rows, as measured before on this CPU (%s)", found,
                     THRESHOLDS.path)
            return tuple(found)
        found = _measure(weights, dtype, tiles)
        THRESHOLDS.write(key, {"rows": list(found), "weights": len(weights), "dtype": str(dtype),
                               "threads": torch.get_num_threads()})
    return found


def _measure(weights: list[BlockWeight], dtype: torch.dtype, tiles: bool) -> tuple[int | None, int | None]:
    widths = sorted({w.in_features for w in weights})
    inputs = lambda rows: {width: torch.randn(rows, width).to(dtype) for width in widths}  # noqa: E731
    sweep = lambda product, x: best_seconds(lambda: [product(w, x[w.in_features]) for w in weights])  # noqa: E731
    tile_rows = None
    for rows in _TILE_CALIBRATION_ROWS if tiles else ():
        x = inputs(rows)
        on_tiles, on_bytes = sweep(BlockWeight.matmul_tiles, x), sweep(BlockWeight.matmul_blocks, x)
        if on_tiles < on_bytes:
            log.info("block weights: products of %d rows or more run on AMX tiles (%.2f ms against %.2f ms for %d "
                     "weights)", rows, on_tiles * 1e3, on_bytes * 1e3, len(weights))
            tile_rows = rows
            break
    probes = [replace(w, dense=DenseProducts(keep=w.dense.keep), expanded={}) for w in weights]
    quantized = lambda w, x: w.matmul_tiles(x) if tile_rows and x.shape[0] >= tile_rows else w.matmul_blocks(x)  # noqa: E731
    for rows in _CALIBRATION_ROWS:
        x = inputs(rows)
        blocks = sweep(quantized, x)
        dense = best_seconds(lambda: [w.matmul_dense(x[w.in_features]) for w in probes])
        if dense < blocks:
            log.info("block weights: products of %d rows or more run dense (%.2f ms against %.2f ms for %d weights)",
                     rows, dense * 1e3, blocks * 1e3, len(weights))
            return tile_rows, rows
    log.info("block weights: no product measured runs faster dense (up to %d rows)", _CALIBRATION_ROWS[-1])
    return tile_rows, None
