"""4-bit weights: the kernel computes what the quantization rule says."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.layers.linear import linear
from pdserve.layers.quant import dequantize_int4_reference, quantize_int4
from tests.factories import assert_engine_idle, make_llm


def test_int4_matmul_equals_the_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    got = linear(x, quantize_int4(w, torch.bfloat16)).float()
    ref = x.float() @ dequantize_int4_reference(w).t()
    # bfloat16 scales and activations: about 1% of the output's magnitude
    torch.testing.assert_close(got, ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    # and it is a real 4-bit approximation, not the original weight
    assert (dequantize_int4_reference(w) - w).abs().max() > 1e-3


def test_requantizing_4bit_values_is_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (8, 64), generator=g).float()
    q[:, ::32] = 0  # every group uses its lowest and highest level, as Q4_1 blocks do
    q[:, 1::32] = 15
    scale = torch.rand(8, 2, 1, generator=g) + 0.1
    low = torch.randn(8, 2, 1, generator=g)
    w = (q.view(8, 2, 32) * scale + low).view(8, 64)
    # exact in the 4-bit levels; 1e-5 is float32 rounding of scale * q + low for |w| of a few units
    torch.testing.assert_close(dequantize_int4_reference(w), w, atol=1e-5, rtol=0)


def test_engine_with_int4_weights(tiny_llama):
    llm = make_llm(tiny_llama, dtype="bfloat16", quantization="int4")
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert_engine_idle(llm)


def test_int4_settings_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(str(tiny_llama), dtype="float32", quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama), quantization="int3")
