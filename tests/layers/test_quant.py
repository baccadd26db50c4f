"""Quantized weights: the rules reproduce stored values, each weight is held for the kernel at hand,
and the engine serves 4- and 8-bit weights with pdserve's kernels or, without them, torch's."""

import logging

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.layers.kernels import native
from pdserve.layers.quant import (
    DenseProducts, Int4Weight, QuantizedWeight, calibrate, dequantize_reference, quantize,
)
from pdserve.models import loader
from tests.factories import assert_engine_idle, kernel_isa_params, make_llm, paged_logits

PROMPT = [5, 6, 7, 8, 9, 10, 11]

needs_kernels = pytest.mark.skipif(native.load() is None, reason="pdserve's CPU kernels do not build here")


def test_requantizing_4bit_values_is_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (8, 64), generator=g).float()
    q[:, ::32] = 0  # every group uses its lowest and highest level, as Q4_1 blocks do
    q[:, 1::32] = 15
    scale = (torch.rand(8, 2, 1, generator=g) + 0.1).half().float()  # float16, as a file stores them
    low = torch.randn(8, 2, 1, generator=g).half().float()
    w = (q.view(8, 2, 32) * scale + low).view(8, 64)
    # exact in the 4-bit levels; 1e-5 is float32 rounding of scale * q + low for |w| of a few units
    torch.testing.assert_close(dequantize_reference(w, 4), w, atol=1e-5, rtol=0)


def test_requantizing_8bit_values_is_exact():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (8, 64), generator=g).float()
    q[:, ::32] = 127  # every group's largest magnitude is its 127th step, as in Q8_0 blocks
    w = (q.view(8, 2, 32) * (torch.rand(8, 2, 1, generator=g) + 0.01).half().float()).view(8, 64)
    torch.testing.assert_close(dequantize_reference(w, 8), w, atol=1e-5, rtol=0)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_is_held_for_pdserves_kernels_and_stands_for_its_rule(bits):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(bits))
    held = quantize(w, bits, torch.float32, native.load())
    assert isinstance(held, QuantizedWeight) and held.out_features == 40
    assert held.qs.numel() == w.numel() * bits // 8  # the bytes a decode step reads
    torch.testing.assert_close(held.dequantize(), dequantize_reference(w, bits), atol=1e-6, rtol=0)


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("bits", [4, 8])
def test_every_kernel_variant_expands_a_weight_to_exactly_its_values(isa, bits):
    w = torch.randn(24, 160, generator=torch.Generator().manual_seed(bits)) * 3
    w[0, :32] = float("nan")  # a group that quantizes to NaN stays NaN in either dtype
    kernels = native.load().with_isa(isa)
    held = quantize(w, bits, torch.float32, kernels)
    expand = lambda dtype: kernels.dequantize(bits, held.qs, held.scales, held.mins,  # noqa: E731
                                              torch.empty(24, 160, dtype=dtype))
    f32 = expand(torch.float32)
    torch.testing.assert_close(f32, held.dequantize(), atol=1e-6, rtol=1e-6, equal_nan=True)
    assert torch.equal(expand(torch.bfloat16).view(torch.int16)[1:], f32.bfloat16().view(torch.int16)[1:])
    assert expand(torch.bfloat16)[0, :32].isnan().all()


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [576, 608])  # an even and an odd number of groups of 32
def test_a_batchs_rows_are_each_rows_product_alone(isa, dtype, in_features):
    """Rows taken two at a time (the 4-bit weights unpacked once for both) give, bit for bit, what
    each row gives alone: a request's tokens do not depend on its batch mates."""
    kernels = native.load().with_isa(isa)
    held = quantize(torch.randn(44, in_features, generator=torch.Generator().manual_seed(7)), 4, torch.float32,
                    kernels)
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(8)).to(dtype)
    together = kernels.qmatmul(x, 4, held.qs, held.scales, held.mins, 44)
    alone = torch.cat([kernels.qmatmul(x[i:i + 1].contiguous(), 4, held.qs, held.scales, held.mins, 44)
                       for i in range(7)])
    assert torch.equal(together, alone)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_of_many_rows_run_dense_on_the_values_the_weight_stands_for(dtype):
    held = quantize(torch.randn(48, 96, generator=torch.Generator().manual_seed(4)), 4, torch.float32, native.load())
    held.dense = DenseProducts(min_rows=8)
    x = torch.randn(8, 96).to(dtype)
    dense = held.matmul(x)
    # the weight expanded to the activations' dtype, then a dense product (bfloat16 rounds the weight)
    expected = (x.float() @ held.dequantize().to(dtype).float().t()).to(dtype)
    torch.testing.assert_close(dense, expected, atol=1e-3 if dtype == torch.float32 else 0.1, rtol=1e-2)
    # fewer rows: the quantized kernel (int8 activations), a different rounding of the same product
    few = held.matmul(x[:7])
    assert not torch.equal(few, dense[:7])
    torch.testing.assert_close(few.float(), dense[:7].float(), atol=0.3, rtol=0.05)
    # measured now: any answer is a valid one, and it is used
    tile_rows, panel_rows, min_rows = calibrate([held, held], dtype)
    assert min_rows is None or min_rows >= 1
    assert tile_rows is None or (dtype == torch.bfloat16 and held.kernels.qmatmul_amx_available)
    assert panel_rows is None or held.panels is not None


@pytest.mark.parametrize("isa", [p for p in kernel_isa_params() if p.values[0] != "portable"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [576, 608])  # an even and an odd number of groups of 32
@pytest.mark.parametrize("rows", [1, 7, 8, 19])  # blocks of 4 or 8 rows: partial, whole, and both
def test_products_on_panels_are_the_byte_products_summed_in_another_order(isa, bits, dtype, in_features, rows):
    kernels = native.load().with_isa(isa)
    if not kernels.panels_available(bits):
        pytest.skip(f"{bits}-bit products on panels: the {isa} kernels have none")
    g = torch.Generator().manual_seed(rows + in_features)
    held = quantize(torch.randn(48, in_features, generator=g), bits, torch.float32, kernels)  # three panels
    assert held.panels is not None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    panels, dots = held.matmul_panels(x), held.matmul_bytes(x)
    # the same int8 activations and integer group sums, scaled and added in another order
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(panels.float(), dots.float(), atol=tol, rtol=tol)
    # a row's product does not depend on its batch mates
    alone = torch.cat([held.matmul_panels(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(panels, alone)
    held.dense = DenseProducts(panel_rows=rows)
    assert torch.equal(held.matmul(x), panels)


@needs_kernels
def test_only_weights_of_whole_panels_get_a_panel_copy_and_only_where_their_kernels_run_them():
    kernels = native.load()
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(9))
    assert quantize(w, 4, torch.float32, kernels).panels is None  # 40 outputs: not whole panels of 16
    for name in kernels.supported:
        for bits in (4, 8):
            held = quantize(w[:32], bits, torch.float32, kernels.with_isa(name))
            assert (held.panels is not None) == (name != "portable" and (bits == 4 or "vnni" in name))
    if kernels.panels_available(4):
        held = quantize(w[:32], 4, torch.float32, kernels)
        with pytest.raises(RuntimeError, match="refused"):  # outputs in panels of 16
            kernels.panel_pack(4, held.qs[:24].contiguous(), held.scales[:24].contiguous(),
                               held.mins[:24].contiguous(), 24)


def test_a_kept_expansion_gives_the_products_of_the_shared_buffer():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(5))
    shared, kept = (quantize(w, 4, torch.float32, native.load()) for _ in range(2))
    shared.dense, kept.dense = DenseProducts(min_rows=4), DenseProducts(min_rows=4, keep=True)
    x = torch.randn(6, 96).bfloat16()
    assert torch.equal(kept.matmul(x), shared.matmul(x))
    assert list(kept.expanded) == [torch.bfloat16] and not shared.expanded
    assert torch.equal(kept.matmul(x), shared.matmul(x))  # the kept copy, used again


def test_without_pdserves_kernels_4_bits_run_torchs_kernel_and_8_bits_are_expanded():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(3))
    x = torch.randn(3, 96)
    four = quantize(w, 4, torch.float32, None)
    assert isinstance(four, Int4Weight)
    torch.testing.assert_close(four.matmul(x), x @ dequantize_reference(w, 4).t(), atol=1e-4, rtol=1e-4)
    # torch's kernel takes outputs in multiples of 16 only; others are expanded too
    odd = quantize(w[:40], 4, torch.float32, None)
    assert isinstance(odd, torch.Tensor) and torch.equal(odd, dequantize_reference(w[:40], 4))
    eight = quantize(w, 8, torch.bfloat16, None)
    assert isinstance(eight, torch.Tensor) and eight.dtype == torch.bfloat16
    torch.testing.assert_close(eight.float(), dequantize_reference(w, 8).bfloat16().float())


def test_a_bad_shape_or_width_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 48), 4, torch.float32, None)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        quantize(torch.randn(4, 64), 3, torch.float32, None)


@pytest.mark.parametrize("quantization, bits", [("int4", 4), ("int8", 8)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", ["pdserve", "torch"])
def test_the_engine_serves_quantized_weights_close_to_float(monkeypatch, tiny_llama, quantization, bits, dtype,
                                                            kernels):
    if kernels == "pdserve" and native.load() is None:
        pytest.skip("pdserve's CPU kernels do not build here")
    if kernels == "torch":
        monkeypatch.setattr(loader, "load_kernels", lambda: None)
    reference, _ = paged_logits(make_llm(tiny_llama, dtype="float32"), PROMPT, 3)
    llm = make_llm(tiny_llama, dtype=dtype, quantization=quantization)
    model = llm.engine.runner.model
    down = model.layers[0].mlp.down_proj
    if kernels == "pdserve":
        assert isinstance(down, QuantizedWeight) and down.bits == bits
        assert isinstance(model.lm_head, QuantizedWeight) and model.lm_head.bits == bits
    else:
        assert isinstance(down, Int4Weight if bits == 4 else torch.Tensor)
    logits, _ = paged_logits(llm, PROMPT, 3)
    # the tiny model's logits span a few units; 4-bit weights move them by up to ~10% of that
    # range, 8-bit (and int8 activations, in pdserve's kernels) by ~1%
    scale = reference[0].abs().max().item()
    for ours, ref in zip(logits, reference):
        assert (ours - ref).abs().max().item() < (0.15 if bits == 4 else 0.03) * scale
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert_engine_idle(llm)


def test_auto_serves_a_float_checkpoint_in_its_dtype(tiny_llama):
    llm = make_llm(tiny_llama)  # quantization "auto": nothing in it was stored quantized
    assert isinstance(llm.engine.runner.model.layers[0].mlp.down_proj, torch.Tensor)


def test_quantization_settings_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama), quantization="int3")
    with pytest.raises(ValueError, match="int8 weights run on CPU kernels"):
        LLM(str(tiny_llama), quantization="int8", device="cuda")


@needs_kernels
def test_calibrated_thresholds_are_measured_once_per_machine_and_kernel_set(monkeypatch, tmp_path):
    """A model's thresholds are kept in the cache: measured at the first load only, again for other
    kernels (`PDSERVE_CPU_ISA` forcing a fallback), other weights, or a cache entry that is not one."""
    from pdserve.layers import quant

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(quant, "calibrate", lambda weights, dtype, dense=True: measured.append(len(weights)) or (None, 2, 64))
    held = quantize(torch.randn(48, 96, generator=torch.Generator().manual_seed(4)), 4, torch.float32, native.load())
    assert quant.calibrated([held, held], torch.float32) == (None, 2, 64)
    assert quant.calibrated([held, held], torch.float32) == (None, 2, 64) and measured == [2]
    quant.calibrated([held], torch.float32)  # another count of weights
    monkeypatch.setenv(native.ISA_ENV, "portable")
    quant.calibrated([held, held], torch.float32)  # another kernel set
    assert measured == [2, 1, 2]
    monkeypatch.delenv(native.ISA_ENV)
    quant.THRESHOLDS.path.write_text('{"x": {"rows": "not rows"}}')  # unreadable entries are measured again
    quant.calibrated([held, held], torch.float32)
    assert measured == [2, 1, 2, 2]


def test_kernels_that_cannot_be_built_are_reported_and_left_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails every build
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels"):
        assert native.load.__wrapped__() is None
    assert "torch's kernels are used instead" in caplog.text and "'false'" in caplog.text


@needs_kernels
def test_an_instruction_set_this_cpu_lacks_is_refused(monkeypatch):
    kernels = native.load()
    missing = [name for name in native.ISA_NAMES if name not in kernels.supported]
    if not missing:
        pytest.skip("this CPU runs every variant")
    with pytest.raises(ValueError, match="cannot run"):
        kernels.with_isa(missing[0])
    monkeypatch.setenv(native.ISA_ENV, missing[0])
    with pytest.raises(ValueError, match="this CPU runs only"):
        native.load.__wrapped__()
