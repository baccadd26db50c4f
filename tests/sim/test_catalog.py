"""The roofline projection: published KV sizes, and how TP, 4-bit weights and links move it."""

import pytest

from pdserve.sim.catalog import GPUS, LINKS, MODELS, Efficiency, fits, roofline
from pdserve.sim.perf import StepShape


def test_kv_bytes_per_token_match_the_published_figures():
    assert MODELS["llama-3-70b"].kv_bytes_per_token() == 320 * 1024  # 80 layers x 8 KV heads x 128 x K,V x bf16
    assert MODELS["llama-3-8b"].kv_bytes_per_token() == 128 * 1024
    assert MODELS["deepseek-v3"].kv_bytes_per_token() == 61 * 576 * 2  # MLA: latent + rope key


def test_a_small_batch_decode_is_bound_by_reading_the_weights():
    eff = Efficiency(mfu=0.5, mbu=0.7, step_overhead_s=0.0)
    m = roofline(MODELS["llama-3-8b"], GPUS["H100-SXM"], eff=eff)
    step = m.step_time(StepShape(decode_seqs=1, decode_context=1000))
    weights = 8.03e9 * 2 / (3.35e12 * 0.7)
    assert step == pytest.approx(weights + 2 * 8.03e9 / (989e12 * 0.5) + 1000 * 128 * 1024 / (3.35e12 * 0.7))
    assert weights / step > 0.95


def test_tensor_parallelism_and_4bit_weights():
    eff = Efficiency(step_overhead_s=0.0, allreduce_latency_s=0.0)
    model, gpu = MODELS["llama-3-70b"], GPUS["A100-80G"]
    tp1, tp4 = roofline(model, gpu, 1, eff=eff), roofline(model, gpu, 4, eff=eff)
    assert tp4.base_s == pytest.approx(tp1.base_s / 4)
    assert tp4.prefill_attention_s == pytest.approx(tp1.prefill_attention_s / 4)
    assert tp1.prefill_token_s / 4 < tp4.prefill_token_s  # all-reduces cost something
    q4 = roofline(model, gpu, 4, weight_bits=4, eff=eff)
    assert q4.base_s == pytest.approx(tp4.base_s / 4) and q4.prefill_token_s == tp4.prefill_token_s
    assert fits(model, gpu, 1) == 0  # 141 GB of bf16 weights do not fit in 80 GB
    assert fits(model, gpu, 4, weight_bits=4) == pytest.approx((0.9 * 320e9 - 70.6e9 / 2) / (320 * 1024), abs=1)


def test_links_set_the_transfer_time():
    m = roofline(MODELS["llama-3-70b"], GPUS["H100-SXM"], 4, link=LINKS["IB-NDR"])
    assert m.transfer_time(8000) == pytest.approx(5e-6 + 8000 * 320 * 1024 / 50e9)
    with pytest.raises(ValueError):
        roofline(MODELS["llama-3-8b"], GPUS["H100-SXM"], 0)
