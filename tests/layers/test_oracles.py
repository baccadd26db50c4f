"""Oracles computed here, from definitions, not from the module under test: seeded sampling
(the path a request with a seed takes: its own generator, through `sampling_batch`) against the
softmax it should draw from, by a chi-square test over many draws of a fixed seed sequence; and the
quantized matmul kernels (torch's int4 one, the fallback, and pdserve's own on every instruction set
this CPU runs) against a float matmul with weights, and activations, quantized in this file from
the formats' rules."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import sampling_batch
from pdserve.engine.request import Request
from pdserve.layers.kernels import native
from pdserve.layers.quant import GROUP_SIZE, quantize
from pdserve.layers.sampler import Sampler
from pdserve.sampling_params import SamplingParams
from tests.factories import kernel_isa_params

LOGITS = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.4, -1.0])  # a vocabulary of 6

# Upper 0.001 quantiles of the chi-square distribution (any table, e.g. NIST/SEMATECH e-Handbook
# 1.3.6.7.4): a correct sampler fails one of these tests once in a thousand seed sequences; the
# sequences here are fixed, so a run either passes every time or never.
CHI2_999 = {2: 13.816, 3: 16.266, 5: 20.515}


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens of nonzero probability, and its degrees of freedom; a
    drawn token of probability zero is an immediate failure."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens the distribution excludes: {counts.tolist()}"
    expected = probs[support].double() * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def renormalized(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    kept = torch.zeros_like(probs)
    kept[keep] = probs[keep]
    return kept / kept.sum()


def seeded_request(seed: int, **params) -> Request:
    sp = SamplingParams(seed=seed, max_tokens=1, **params)
    return Request(f"r{seed}", [1], sp, 2)


def draw_first_tokens(num: int, **params) -> list[int]:
    """The first token of `num` requests seeded 1000, 1001, ...: each draws from its own generator."""
    requests = [seeded_request(1000 + i, **params) for i in range(num)]
    return Sampler(seed=0)(LOGITS.repeat(num, 1), sampling_batch(requests, torch.device("cpu")))


def test_seeded_requests_draw_from_the_tempered_softmax():
    tokens = draw_first_tokens(6000, temperature=1.3)
    stat, df = chi_square(tokens, (LOGITS / 1.3).softmax(-1))
    assert df == 5 and stat < CHI2_999[5]
    # the test has the power to tell: the same draws are far from the untempered softmax
    assert chi_square(tokens, LOGITS.softmax(-1))[0] > 10 * CHI2_999[5]


def test_seeded_requests_draw_from_the_top_k_renormalized_softmax():
    tokens = draw_first_tokens(6000, temperature=0.9, top_k=4)
    stat, df = chi_square(tokens, renormalized((LOGITS / 0.9).softmax(-1), [0, 1, 2, 3]))
    assert df == 3 and stat < CHI2_999[3]


def test_one_seeded_request_decoding_many_tokens_draws_from_the_top_p_softmax():
    """One request's consecutive tokens (a long decode), its generator advancing row after row."""
    probs = LOGITS.softmax(-1)  # .484 .294 .088 .066 .044 .024 (rounded)
    # top_p 0.85: the mass before token 2 is .778 < .85, before token 3 .866 >= .85: 0, 1, 2 stay
    assert probs[:2].sum() < 0.85 <= probs[:3].sum()
    req = seeded_request(7, temperature=1.0, top_p=0.85)
    batch = sampling_batch([req], torch.device("cpu"))
    sampler = Sampler(seed=0)
    tokens = [sampler(LOGITS.unsqueeze(0), batch)[0] for _ in range(4000)]
    stat, df = chi_square(tokens, renormalized(probs, [0, 1, 2]))
    assert df == 2 and stat < CHI2_999[2]


def dequantize_q4_1(weight: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """The format's rule, written out: each group of 32 inputs of a row has a minimum m and a step
    d = (max - m) / 15, both stored in float16; a weight is stored as q = round((w - m) / d) in
    0..15 and stands for q * d + m. torch's kernel keeps d and (m + 8 d) in the activation dtype
    (it computes (q - 8) * d + (m + 8 d)), so they are rounded to it here too."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // 32, 32)
    m, top = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((top - m) / 15).half().float()
    m = m.half().float()
    q = torch.clamp(torch.round((w - m) / d), 0, 15).double()
    d_stored = d.to(scale_dtype).double()
    zero_stored = (m + 8 * d).to(scale_dtype).double()
    return ((q - 8) * d_stored + zero_stored).view(rows, cols)


def test_torchs_int4_kernel_multiplies_by_the_weights_the_format_defines():
    assert GROUP_SIZE == 32  # the rule above is for groups of 32
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    w_hat = dequantize_q4_1(w, torch.bfloat16)
    got = quantize(w, 4, torch.bfloat16, kernels=None).matmul(x).double()
    ref = x.double() @ w_hat.t()
    # The output is bfloat16: rounding it costs up to half a unit in its last place, 2^-9 of its
    # magnitude; allow 2^-8 for the kernel's own float32 sums of 128 products, whose error is
    # about 128 * 2^-24 of the sum of their magnitudes (the second term).
    bound = 2 ** -8 * ref.abs() + 128 * 2 ** -24 * (x.double().abs() @ w_hat.abs().t())
    assert ((got - ref).abs() <= bound).all(), float(((got - ref).abs() / bound).max())
    # and the rule is not the identity: 4 bits lose a visible part of the weight
    assert (w_hat - w.double()).abs().max() > 0.05


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """Q4_1: q = round((w - m) / d) in 0..15 for d = (max - m) / 15, with m and d stored in float16."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // 32, 32)
    m, top = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((top - m) / 15).half().double()
    m = m.half().double()
    return (torch.clamp(torch.round((w.double() - m) / d), 0, 15) * d + m).view(rows, cols)


def q8_0_weights(weight: torch.Tensor) -> torch.Tensor:
    """Q8_0 as a file stores weights: q = round(w / d) for d = max|w| / 127 in float16."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // 32, 32)
    d = (w.abs().amax(-1, keepdim=True) / 127).half().double()
    return (torch.clamp(torch.round(w.double() / d), -127, 127) * d).view(rows, cols)


def q8_0(values: torch.Tensor) -> torch.Tensor:
    """Q8_0 with float32 scales: q = round(v / d) in -127..127 for d = max|v| / 127 (ties to even).
    pdserve's kernels quantize their activations by this rule too, row by row."""
    rows, cols = values.shape
    v = values.float().view(rows, cols // 32, 32)
    top = v.abs().amax(-1, keepdim=True)
    # the kernels multiply by 127 / max, a float32 division correctly rounded (torch's scalar / tensor
    # is a reciprocal times 127, which can differ in the last bit: a tie the other way)
    inv = torch.where(top > 0, (127 / top.double()).float(), torch.zeros_like(top))
    return (torch.round(v * inv).double() * (top / 127).double()).view(rows, cols)


@pytest.mark.parametrize("isa", kernel_isa_params())
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, out", [(1, 128, 96), (5, 64, 30), (33, 256, 7), (2, 96, 12)])
def test_pdserves_kernels_multiply_by_the_weights_and_activations_the_formats_define(isa, bits, rows, cols, out):
    kernels = native.load().with_isa(isa)
    g = torch.Generator().manual_seed(bits * 1000 + rows)
    w = torch.randn(out, cols, generator=g)
    x = torch.randn(rows, cols, generator=g) * 3
    x[0, :32] = 0  # a group of zeros has no scale
    w_hat = q4_1(w) if bits == 4 else q8_0_weights(w)
    ref = q8_0(x) @ w_hat.t()
    weight = quantize(w, bits, torch.float32, kernels)
    got = weight.matmul(x).double()
    # a row's product is the same alone as in a batch (rows run two at a time where they can)
    assert all(torch.equal(weight.matmul(x[i : i + 1]).double(), got[i : i + 1]) for i in range(rows))
    # float32 sums of `cols` products, each group's exact integer sum scaled once: the error is
    # a few units of float32 rounding (2^-24) of the sum of the products' magnitudes
    bound = 8 * 2 ** -24 * (q8_0(x).abs() @ w_hat.abs().t()) + 1e-30
    assert ((got - ref).abs() <= bound).all(), float(((got - ref).abs() / bound).max())
    # bfloat16 activations in and out: the input is bfloat16 already; the output rounds to it
    got16 = quantize(w, bits, torch.float32, kernels).matmul(x.bfloat16()).double()
    ref16 = q8_0(x.bfloat16().float()) @ w_hat.t()
    assert ((got16 - ref16).abs() <= 2 ** -8 * ref16.abs() + bound).all()
