"""The kernels of weights in GGUF's block formats (blocks.c): each variant expands a weight to gguf's
own values bit for bit, and multiplies by it as int8 activations against those values would."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from pdserve.layers.kernels import native
from tests.factories import kernel_isa_params

FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
# where each block keeps its float16 scales (d, dmin), for the formats gguf cannot quantize in Python
SCALE_BYTES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,),
               T.IQ4_XS: (0,)}

needs_kernels = pytest.mark.skipif(native.load() is None, reason="pdserve's CPU kernels do not build here")


def block_weight(fmt: T, rows: int, in_features: int, seed: int) -> np.ndarray:
    """[rows, row bytes] uint8: gguf's quantization of a random weight where gguf has one, else random
    blocks (any bytes are a valid block once its float16 scales are finite), scales of either sign."""
    rng = np.random.default_rng(seed)
    if fmt not in SCALE_BYTES:
        return quants.quantize(rng.standard_normal((rows, in_features)).astype(np.float32), fmt)
    elements, size = GGML_QUANT_SIZES[fmt]
    blocks = rng.integers(0, 256, (rows, in_features // elements, size), dtype=np.uint8)
    for at in SCALE_BYTES[fmt]:
        scale = rng.uniform(0.002, 0.05, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
        blocks[..., at:at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def int8_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' rule: per group of 32, scale = max|x| / 127 and q = x * (127 / max|x|) rounded to
    nearest even, in float32. Returns q [rows, in] and the scales [rows, in / 32]."""
    groups = x.float().numpy().reshape(x.shape[0], -1, 32)
    top = np.abs(groups).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, np.float32(127) / top, np.float32(0)).astype(np.float32)
    q = np.rint(groups * inv).astype(np.int64)
    return q.reshape(x.shape), (top / np.float32(127)).astype(np.float32)[..., 0]


def emulated(x: torch.Tensor, values: np.ndarray) -> np.ndarray:
    """The product the kernels compute, in float64: each group's int8 activations against the weight's
    values (gguf's: d * q + m per block or half), times the group's activation scale."""
    q, scales = int8_activations(x)
    rows, groups = scales.shape
    per_group = np.einsum("mgk,ngk->mng", q.reshape(rows, groups, 32).astype(np.float64),
                          values.reshape(values.shape[0], groups, 32).astype(np.float64))
    return (per_group * scales[:, None, :]).sum(-1)


def in_features_of(fmt: T) -> int:
    # several blocks: 25 of 32 (an odd count), 3 super-blocks of 256
    return 800 if GGML_QUANT_SIZES[fmt][0] == 32 else 768


@needs_kernels
def test_the_family_serves_exactly_its_twelve_formats():
    kernels = native.load()
    assert {f for f in T if kernels.blocks.format_supported(int(f))} == set(FORMATS)


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_variant_expands_a_weight_to_ggufs_values_bit_for_bit(isa, fmt):
    kernels = native.load().with_isa(isa)
    K = in_features_of(fmt)
    w = block_weight(fmt, 13, K, seed=int(fmt))
    expected = torch.from_numpy(quants.dequantize(w, fmt))
    held = torch.from_numpy(w)
    f32 = kernels.blocks.dequantize(int(fmt), held, torch.empty(13, K))
    assert torch.equal(f32.view(torch.int32), expected.view(torch.int32))  # -0 stays -0
    bf16 = kernels.blocks.dequantize(int(fmt), held, torch.empty(13, K, dtype=torch.bfloat16))
    assert torch.equal(bf16.view(torch.int16), expected.bfloat16().view(torch.int16))
    ids = torch.tensor([12, 0, 5, 5])
    rows = kernels.blocks.rows(int(fmt), held, ids, torch.empty(4, K))
    assert torch.equal(rows.view(torch.int32), expected[ids].view(torch.int32))
    rows = kernels.blocks.rows(int(fmt), held, ids, torch.empty(4, K, dtype=torch.bfloat16))
    assert torch.equal(rows.view(torch.int16), expected[ids].bfloat16().view(torch.int16))


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_products_are_int8_activations_against_the_weights_values(isa, dtype, fmt):
    """Against the exact product of the int8 activations (tight), and the float product of gguf's
    weight (loose: the activations' rounding), written into a column slice of a wider output."""
    kernels = native.load().with_isa(isa)
    K, N = in_features_of(fmt), 13  # 13 outputs: not a multiple of 4
    w = block_weight(fmt, N, K, seed=100 + int(fmt))
    values = quants.dequantize(w, fmt)
    g = torch.Generator().manual_seed(int(fmt))
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, K, generator=g).to(dtype)
        wide = torch.full((rows, N + 7), 7.0, dtype=dtype)
        y = kernels.blocks.matmul(x, int(fmt), torch.from_numpy(w), N, out=wide[:, 3:3 + N])
        assert y.data_ptr() == wide[:, 3:].data_ptr()
        assert (wide[:, :3] == 7).all() and (wide[:, 3 + N:] == 7).all()  # the other columns untouched
        exact = torch.from_numpy(emulated(x, values)).float()
        if dtype == torch.float32:
            assert ((y - exact).norm() / exact.norm()).item() < 1e-4
        else:  # each output the exact one rounded to bfloat16, give or take the last bit
            torch.testing.assert_close(y.float(), exact.bfloat16().float(), rtol=2**-7, atol=1e-3)
        dense = x.float() @ torch.from_numpy(values).t()
        assert ((y.float() - dense).norm() / dense.norm()).item() < 1e-2


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("fmt", [f for f in FORMATS if GGML_QUANT_SIZES[f][0] == 32], ids=lambda f: f.name)
def test_rows_shorter_than_a_batch_of_eight_blocks_go_a_block_at_a_time(isa, fmt):
    kernels = native.load().with_isa(isa)
    w = block_weight(fmt, 6, 96, seed=9)  # 3 blocks
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(10))
    y = kernels.blocks.matmul(x, int(fmt), torch.from_numpy(w), 6)
    exact = torch.from_numpy(emulated(x, quants.dequantize(w, fmt))).float()
    assert ((y - exact).norm() / exact.norm()).item() < 1e-4


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("fmt", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_XS], ids=lambda f: f.name)
def test_a_rows_product_does_not_depend_on_its_batch_mates(isa, fmt):
    """Rows go through the weight eight (AVX-512), four, two or one at a time; each gives, bit for
    bit, what it gives alone: a request's tokens do not depend on its batch."""
    kernels = native.load().with_isa(isa)
    K = in_features_of(fmt)
    w = torch.from_numpy(block_weight(fmt, 9, K, seed=7))
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(8))  # 8 + 2 + 1, or 4 + 4 + 2 + 1
    together = kernels.blocks.matmul(x, int(fmt), w, 9)
    alone = torch.cat([kernels.blocks.matmul(x[i:i + 1].contiguous(), int(fmt), w, 9) for i in range(11)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("isa", kernel_isa_params())
def test_a_row_of_nan_or_inf_spoils_only_its_own_outputs(isa):
    kernels = native.load().with_isa(isa)
    w = torch.from_numpy(block_weight(T.Q4_K, 8, 512, seed=3))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    clean = kernels.blocks.matmul(x, int(T.Q4_K), w, 8)
    x[1, 5], x[1, 300] = float("nan"), float("inf")
    spoiled = kernels.blocks.matmul(x, int(T.Q4_K), w, 8)
    assert torch.equal(spoiled[0::2], clean[0::2])


@needs_kernels
def test_weights_that_are_not_whole_blocks_of_the_format_are_refused():
    kernels = native.load()
    w = torch.from_numpy(block_weight(T.Q4_K, 4, 512, seed=5))
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match="uint8"):  # the row bytes of another format
        kernels.blocks.matmul(x, int(T.Q6_K), w, 4)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        kernels.blocks.matmul(torch.randn(2, 480), int(T.Q4_K), w, 4)
    with pytest.raises(ValueError, match="do not serve"):
        kernels.blocks.matmul(x, int(T.IQ2_XXS), w, 4)
    with pytest.raises(ValueError, match="cannot take"):  # rows of the output overlap
        kernels.blocks.matmul(x, int(T.Q4_K), w, 4, out=torch.empty(4, 2).t())
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        kernels.blocks.rows(int(T.Q4_K), w, torch.tensor([4]), torch.empty(1, 512))


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_weights_parts_in_one_call_give_each_parts_own_product(isa, dtype):
    """q in Q8_0, k and v in Q5_0 (as llama.cpp's Q4_K_M stores a layer), and a K-quant part: one
    call gives, column for column, what each part gives alone."""
    kernels = native.load().with_isa(isa)
    k = 512
    spec = [(T.Q8_0, 24), (T.Q5_0, 8), (T.Q5_0, 8), (T.Q4_K, 5)]
    weights = [torch.from_numpy(block_weight(fmt, n, k, seed=i)) for i, (fmt, n) in enumerate(spec)]
    plan = kernels.blocks.parts([(int(fmt), w) for (fmt, _), w in zip(spec, weights)], k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    fused = kernels.blocks.matmul_parts(x, plan)
    alone = torch.cat([kernels.blocks.matmul(x, int(fmt), w, n) for (fmt, n), w in zip(spec, weights)], dim=1)
    assert fused.shape == (3, sum(n for _, n in spec)) and torch.equal(fused, alone)


@pytest.mark.parametrize("rows", [1, 5, 16, 37, 70])
def test_amx_tiles_give_the_weights_bfloat16_values_product(rows):
    """On AMX tiles, a fused weight of three formats (K a whole number of 256-element blocks and a
    32-element tail) gives the float product of its expanded bfloat16 values with the rows, each
    sum rounded once to bfloat16."""
    kernels = native.load()
    if kernels is None or not kernels.qmatmul_amx_available:
        pytest.skip("this CPU (or build) has no AMX with AVX-512 BF16")
    k = 544  # two super-blocks and a group: the 32-element formats' tail
    spec = [(T.Q5_0, 24), (T.Q8_0, 8), (T.Q4_1, 21)]
    weights = [torch.from_numpy(block_weight(fmt, n, k, seed=i)) for i, (fmt, n) in enumerate(spec)]
    plan = kernels.blocks.parts([(int(fmt), w) for (fmt, _), w in zip(spec, weights)], k)
    expanded = torch.cat([kernels.blocks.dequantize(int(fmt), w, torch.empty(n, k, dtype=torch.bfloat16))
                          for (fmt, n), w in zip(spec, weights)])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = kernels.blocks.matmul_amx(x, plan)
    expected = (x.float() @ expanded.float().T).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    K4 = T.Q4_K  # a K-quant alone, K of whole super-blocks
    w = torch.from_numpy(block_weight(K4, 40, 512, seed=9))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expanded = kernels.blocks.dequantize(int(K4), w, torch.empty(40, 512, dtype=torch.bfloat16))
    got = kernels.blocks.matmul_amx(x, kernels.blocks.parts([(int(K4), w)], 512))
    torch.testing.assert_close(got.float(), (x.float() @ expanded.float().T).to(torch.bfloat16).float(),
                               atol=1e-2, rtol=1e-2)
