"""Quantized matmul weights, in groups of 32 along the input, each group's scale (and minimum)
stored in float16 as GGUF does:
- 4-bit: w = scale * q + min, q in 0..15 (asymmetric round-to-nearest between each group's minimum
  and maximum: the rule of GGUF's Q4_1);
- 8-bit: w = scale * q, q in -127..127 (scale = the group's largest magnitude / 127: GGUF's Q8_0).

A GGUF file stored with those rules re-quantizes to exactly its own values from its dequantized
weights (a group's extremes are its q=0 and q=15 levels, or +-127), so serving it this way loses
nothing. The product runs in pdserve's own kernels (`kernels/qmatmul.c`: activations quantized to
int8 per group of 32, byte dot products with VNNI or AVX2; batches of rows on a
copy of the weight repacked in panels of 16 output columns (8-bit ones with VNNI only),
`kernels/qmatmul_panel.h`; on a CPU
with AMX, batches of bfloat16 rows on its tiles, `kernels/qmatmul_amx.h`) where they build;
otherwise 4-bit weights run torch's CPU int4 kernel and 8-bit ones are expanded to the activation
dtype at load.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

from pdserve.layers.kernels.native import NativeKernels
from pdserve.layers.measured import MeasuredChoices, machine_key
from pdserve.layers.packed import pack_weight, packed_linear
from pdserve.layers.timing import best_seconds

log = logging.getLogger("pdserve.kernels")

GROUP_SIZE = 32
BITS = (4, 8)
_CALIBRATION_ROWS = (4, 8, 16, 32, 64, 128, 256, 512)  # up to a default prefill chunk
_TILE_CALIBRATION_ROWS = (2, 4, 8, 16)  # where AMX tiles may overtake byte dot products
_PANEL_CALIBRATION_ROWS = (1, 2, 4, 8, 16)  # and panels (at one row too: no expansion to pay for)
THRESHOLDS = MeasuredChoices("quantized-thresholds.json", "quantized weights")


@dataclass(slots=True)
class DenseProducts:
    """Which kernel a model's quantized weights run a product of a given number of rows on.

    Byte dot products win while a step has few rows (decode: the weight's bytes are the cost),
    but their arithmetic grows with the rows. On a CPU with AMX, bfloat16 rows from `tile_rows` up
    run on its tiles, the weight expanded a group at a time as it is read (a decode batch: the
    weight's own bytes, at tile speed). With AVX2 or VNNI, rows from `panel_rows` up run on the
    weight's panels (16 output columns in a vector's lanes: a group's scaling and unpacking serve
    16 columns and 4-8 rows; 8-bit weights with VNNI only). A prefill chunk's hundreds of rows are arithmetic, which the math
    library's float GEMM may do faster: from `min_rows` rows up a product runs dense, on the
    weight expanded either once and kept (`keep`: where the model's expanded weights fit the memory
    set aside for them, `dense_memory_budget`) or at each product into one buffer the model's
    layers share (a step runs them one after another). Both thresholds are measured on this CPU
    when the model loads (`calibrate`)."""

    min_rows: int | None = None  # None: no product runs dense
    tile_rows: int | None = None  # None: no product runs on AMX tiles
    panel_rows: int | None = None  # None: no product runs on panels
    keep: bool = False
    _buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def buffer(self, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        flat = self._buffers.get(dtype)
        if flat is None or flat.numel() < out_features * in_features:
            flat = self._buffers[dtype] = torch.empty(out_features * in_features, dtype=dtype)
        return flat[: out_features * in_features].view(out_features, in_features)


def dense_memory_budget() -> int:
    """Bytes of expanded copies a model's quantized weights may keep: an eighth of this machine's
    memory. A small model (the default one: 270 MB in bfloat16) keeps them and serves batches at
    dense speed; a large one keeps only its quantized bytes, which is what quantizing it is for."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8
    except (ValueError, OSError):
        return 0


@dataclass(slots=True)
class QuantizedWeight:
    """A weight held quantized and multiplied by pdserve's kernels."""

    bits: int
    qs: torch.Tensor  # [out, in / 2] uint8 (two 4-bit values a byte) or [out, in] int8
    scales: torch.Tensor  # [out, in / 32] float16
    mins: torch.Tensor | None  # [out, in / 32] float16; 4-bit only
    kernels: NativeKernels
    dense: DenseProducts = field(default_factory=DenseProducts)  # shared by a model's weights
    expanded: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # kept copies (`dense.keep`)
    panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `kernels.panel_pack`'s copy

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * GROUP_SIZE

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        if x.dtype not in (torch.float32, torch.bfloat16):
            return self.matmul(x.float()).to(x.dtype)
        rows = x.shape[0]
        if self.dense.min_rows is not None and rows >= self.dense.min_rows:
            return self.matmul_dense(x)
        if self.dense.tile_rows is not None and rows >= self.dense.tile_rows and x.dtype == torch.bfloat16:
            return self.matmul_tiles(x)
        if self.panels is not None and self.dense.panel_rows is not None and rows >= self.dense.panel_rows:
            return self.matmul_panels(x)
        return self.matmul_bytes(x)

    def matmul_bytes(self, x: torch.Tensor) -> torch.Tensor:  # byte dot products, a row's K in the lanes
        return self.kernels.qmatmul(x.contiguous(), self.bits, self.qs, self.scales, self.mins, self.out_features)

    def matmul_panels(self, x: torch.Tensor) -> torch.Tensor:  # byte dot products, 16 columns in the lanes
        return self.kernels.panel_matmul(x.contiguous(), self.bits, self.panels, self.out_features)

    def matmul_tiles(self, x: torch.Tensor) -> torch.Tensor:  # bfloat16 rows, on AMX tiles
        return self.kernels.qmatmul_amx(x.contiguous(), self.bits, self.qs, self.scales, self.mins, self.out_features)

    def matmul_dense(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dense.keep:
            buffer = self.dense.buffer(self.out_features, self.in_features, x.dtype)
            return F.linear(x, self.kernels.dequantize(self.bits, self.qs, self.scales, self.mins, buffer))
        w = self.expanded.get(x.dtype)
        if w is None:  # expanded once, kept in the layout the dense kernel reads fastest
            into = torch.empty(self.out_features, self.in_features, dtype=x.dtype)
            w = self.expanded[x.dtype] = pack_weight(self.kernels.dequantize(self.bits, self.qs, self.scales,
                                                                             self.mins, into))
        return packed_linear(x, w) if w.is_mkldnn else F.linear(x, w)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` ([tokens] int64) of a table held this way (a token embedding), [tokens, in]
        in `dtype`: only those rows are expanded."""
        picked = replace(self, qs=self.qs[ids], scales=self.scales[ids],
                         mins=None if self.mins is None else self.mins[ids], panels=None, expanded={})
        return picked.dequantize().to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight these values stand for, [out, in] float32."""
        out = self.out_features
        scales = self.scales.float().unsqueeze(-1)
        if self.bits == 8:
            return (self.qs.view(out, -1, GROUP_SIZE).float() * scales).view(out, -1)
        packed = self.qs.view(out, -1, GROUP_SIZE // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # low nibbles hold elements 0-15
        return (q * scales + self.mins.float().unsqueeze(-1)).view(out, -1)


@dataclass(slots=True)
class Int4Weight:
    """4-bit weights in torch's own CPU int4 kernel's layout: the fallback where pdserve's kernels
    are not built."""

    packed: torch.Tensor  # the kernel's tiled int4 layout
    scales_and_zeros: torch.Tensor  # [in / group, out, 2]: w = (q - 8) * scale + zero
    group_size: int
    out_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


def _groups(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out, in / 32, 32] float32
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"quantized weights need input sizes divisible by {GROUP_SIZE}, got {in_features}")
    return weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)


def _divisor(scale: torch.Tensor) -> torch.Tensor:  # a group of equal values has scale 0: its q are 0
    return torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)


def quantize_4bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q in 0..15 ([out, in] int32), scales and mins ([out, in / 32], float32 values of float16:
    q is computed against the rounded ones) of `weight`."""
    groups = _groups(weight)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).half().float()
    low = low.half().float()
    q = ((groups - low.unsqueeze(-1)) / _divisor(scale)).round().clamp(0, 15).to(torch.int32)
    return q.view(weight.shape), scale, low


def quantize_8bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q in -127..127 ([out, in] int8) and scales ([out, in / 32], float32 values of float16)."""
    groups = _groups(weight)
    scale = (groups.abs().amax(-1) / 127).half().float()
    q = (groups / _divisor(scale)).round().clamp(-127, 127).to(torch.int8)
    return q.view(weight.shape), scale


def quantize(weight: torch.Tensor, bits: int, dtype: torch.dtype,
             kernels: NativeKernels | None) -> QuantizedWeight | Int4Weight | torch.Tensor:
    """`weight` ([out, in]) quantized to `bits`, held for the fastest kernel available: pdserve's
    (`kernels`: `kernels.native.load()` gives this CPU's), else (None) torch's int4 kernel (for
    outputs in multiples of 16, which it needs), else the quantized values expanded to `dtype`."""
    if bits not in BITS:
        raise ValueError(f"weights quantize to 4 or 8 bits, not {bits}")
    if bits == 4:
        q, scale, low = quantize_4bit(weight)
        if kernels is None and q.shape[0] % 16 == 0:
            return _torch_int4(q, scale, low, dtype)
        if kernels is None:
            return dequantize_reference(weight, 4).to(dtype)
        groups = q.view(q.shape[0], -1, GROUP_SIZE).to(torch.uint8)
        packed = (groups[..., : GROUP_SIZE // 2] | (groups[..., GROUP_SIZE // 2 :] << 4)).view(q.shape[0], -1)
        return with_panels(QuantizedWeight(4, packed.contiguous(), scale.half(), low.half(), kernels))
    q, scale = quantize_8bit(weight)
    if kernels is None:
        return (q.view(q.shape[0], -1, GROUP_SIZE).float() * scale.unsqueeze(-1)).view(q.shape).to(dtype)
    return with_panels(QuantizedWeight(8, q.contiguous(), scale.half(), None, kernels))


def with_panels(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` with its panel copy, where its kernels run panels of its bits and shape."""
    if weight.kernels.panels_available(weight.bits) and weight.out_features % 16 == 0:
        weight.panels = weight.kernels.panel_pack(weight.bits, weight.qs, weight.scales, weight.mins,
                                                  weight.out_features)
    return weight


def _torch_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    zero = low + 8 * scale  # torch's kernel computes (q - 8) * scale + zero
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return Int4Weight(packed, scales_and_zeros, GROUP_SIZE, q.shape[0])


def dequantize_reference(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """What quantizing `weight` to `bits` makes of it, in float32 (for tests and accuracy reports)."""
    if bits == 4:
        q, scale, low = quantize_4bit(weight)
        groups = q.view(q.shape[0], -1, GROUP_SIZE).float()
        return (groups * scale.unsqueeze(-1) + low.unsqueeze(-1)).view(weight.shape)
    q, scale = quantize_8bit(weight)
    return (q.view(q.shape[0], -1, GROUP_SIZE).float() * scale.unsqueeze(-1)).view(weight.shape)


def calibrate(weights: list[QuantizedWeight], dtype: torch.dtype,
              dense: bool = True) -> tuple[int | None, int | None, int | None]:
    """`DenseProducts`' thresholds on this CPU now, for weights of one shape (a model's layers): the
    fewest rows from which products run faster on panels than on byte dot products, and on AMX
    tiles than on whichever of those would run there (None: no tiles or panels here, or never
    faster), and from which they run faster dense than on any of those (None: at no size
    measured). Each candidate is timed over all
    `weights` in turn, as a step reads them (one weight timed again and again sits in the cache,
    which flatters the larger dense copy), best of a few runs: about a second for a small model."""
    first = weights[0]
    x_of = lambda rows: torch.randn(rows, first.in_features).to(dtype)  # noqa: E731
    sweep = lambda product, x, held=weights: best_seconds(lambda: [product(w, x) for w in held])  # noqa: E731

    def overtakes(product: Callable[[QuantizedWeight, torch.Tensor], torch.Tensor], name: str,
                  candidates: tuple[int, ...], otherwise: Callable[[int], Callable]) -> int | None:
        for rows in candidates:
            x = x_of(rows)
            faster, other = sweep(product, x), sweep(otherwise(rows), x)
            if faster < other:
                log.info("quantized weights: products of %d rows or more run on %s (%.2f ms against %.2f ms for %d "
                         "weights)", rows, name, faster * 1e3, other * 1e3, len(weights))
                return rows
        return None

    tile_rows = panel_rows = None
    if all(w.panels is not None for w in weights):
        panel_rows = overtakes(QuantizedWeight.matmul_panels, "panels", _PANEL_CALIBRATION_ROWS,
                               lambda rows: QuantizedWeight.matmul_bytes)
    if dtype == torch.bfloat16 and first.kernels.qmatmul_amx_available:  # tiles go first where they qualify
        tile_rows = overtakes(QuantizedWeight.matmul_tiles, "AMX tiles", _TILE_CALIBRATION_ROWS, lambda rows: (
            QuantizedWeight.matmul_panels if panel_rows is not None and rows >= panel_rows
            else QuantizedWeight.matmul_bytes))
    if not dense:  # a vocabulary's head alone: it multiplies the few rows a step samples
        return tile_rows, panel_rows, None
    probe = DenseProducts(tile_rows=tile_rows, panel_rows=panel_rows)  # the products without dense ones
    probes = [replace(w, dense=probe) for w in weights]
    for rows in _CALIBRATION_ROWS:
        x = x_of(rows)
        quantized = sweep(QuantizedWeight.matmul, x, probes)
        dense = sweep(QuantizedWeight.matmul_dense, x)
        if dense < quantized:
            log.info("quantized weights: products of %d rows or more run dense (%.2f ms against %.2f ms for %d "
                     "weights)", rows, dense * 1e3, quantized * 1e3, len(weights))
            return tile_rows, panel_rows, rows
    log.info("quantized weights: no product measured runs faster dense (up to %d rows)", _CALIBRATION_ROWS[-1])
    return tile_rows, panel_rows, None


def calibrated(weights: list[QuantizedWeight], dtype: torch.dtype,
               dense: bool = True) -> tuple[int | None, int | None, int | None]:
    """`calibrate`'s answer for these weights, measured once per machine and kept (`THRESHOLDS`)
    under what it depends on: the machine, the weights' bits, shape and count, the dtype, the
    threads, whether panels and expanded copies are held. A restarted worker loads without the
    second or so of timing."""
    first = weights[0]
    key = machine_key("calibrate-tiles-after-panels", first.bits, list(first.qs.shape), len(weights), str(dtype),
                      torch.get_num_threads(), all(w.panels is not None for w in weights), first.dense.keep,
                      [_CALIBRATION_ROWS if dense else [], _TILE_CALIBRATION_ROWS, _PANEL_CALIBRATION_ROWS])
    with THRESHOLDS.locked():
        entry = THRESHOLDS.read().get(key)
        thresholds = entry.get("rows") if isinstance(entry, dict) else None
        if not (isinstance(thresholds, list) and len(thresholds) == 3
                and all(t is None or (isinstance(t, int) and t > 0) for t in thresholds)):
            thresholds = list(calibrate(weights, dtype, dense))
            THRESHOLDS.write(key, {"rows": thresholds, "weights": len(weights), "shape": list(first.qs.shape),
                                   "dtype": str(dtype), "threads": torch.get_num_threads()})
        else:
            log.info("quantized weights: thresholds (tiles, panels, dense) %s rows, as measured before on "
                     "this CPU (%s)", thresholds, THRESHOLDS.path)
    return tuple(thresholds)
