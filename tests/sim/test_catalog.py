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


def test_a_mixture_of_experts_reads_the_experts_its_tokens_route_to():
    eff = Efficiency(step_overhead_s=0.0, allreduce_latency_s=0.0)
    spec, gpu = MODELS["deepseek-v3"], GPUS["H200"]
    m = roofline(spec, gpu, 8, weight_bits=8, eff=eff)
    mem = 8 * gpu.mem_bytes_per_s * eff.mbu
    dense = (spec.params - spec.expert_params) / mem  # 8-bit: a byte a parameter
    one = m.step_time(StepShape(decode_seqs=1)) - m.decode_seq_s
    assert one == pytest.approx(dense + spec.expert_params * 8 / 256 / mem)
    assert one * mem == pytest.approx(spec.active_params, rel=0.02)  # one token reads its active parameters
    many = m.step_time(StepShape(decode_seqs=512)) - 512 * m.decode_seq_s
    assert many == pytest.approx(dense + spec.expert_params * (1 - (1 - 8 / 256) ** 512) / mem)
    assert many * mem > 0.99 * spec.params  # a large batch reads nearly every expert
    assert roofline(MODELS["llama-3-70b"], gpu).expert_read_s == 0.0  # dense: no such term


def test_fp8_compute_runs_matmuls_at_the_fp8_peak_where_there_is_one():
    eff = Efficiency(step_overhead_s=0.0, allreduce_latency_s=0.0)
    model, h100 = MODELS["llama-3-70b"], GPUS["H100-SXM"]
    bf16 = roofline(model, h100, 1, weight_bits=8, eff=eff)
    fp8 = roofline(model, h100, 1, weight_bits=8, eff=eff, fp8_compute=True)
    assert fp8.prefill_token_s == pytest.approx(bf16.prefill_token_s * 989 / 1979)
    assert fp8.base_s == bf16.base_s  # the same bytes to read
    with pytest.raises(ValueError, match="no FP8"):
        roofline(model, GPUS["A100-80G"], 4, weight_bits=8, fp8_compute=True)
    with pytest.raises(ValueError, match="8 bits or fewer"):
        roofline(model, h100, 4, weight_bits=16, fp8_compute=True)
