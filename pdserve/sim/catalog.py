"""Hardware and models we cannot run here, and the roofline model that projects their step times.

Figures are vendors' dense (non-sparse) bf16 and FP8 peaks and published model configurations.
The projection fills the simulator's linear step model:

- every step reads the weights once (memory-bound floor): weight bytes / (TP × bandwidth × MBU);
  of a mixture of experts' routed experts, only those its tokens route to (see `perf.py`);
- each computed token costs 2 × active parameters FLOP, and each (token, context token) pair
  4 × layers × heads × head_dim FLOP of attention: / (TP × peak × MFU), at the FP8 peak with
  `fp8_compute` (8- or 4-bit weights on GPUs with FP8 tensor cores), else at the bf16 peak;
- each decode reads its context's KV: KV bytes per token / (TP × bandwidth × MBU);
- tensor parallelism adds two all-reduces of the hidden state per layer and token:
  2 × layers × hidden × 2 bytes × 2(TP-1)/TP / intra-node link bandwidth, plus a latency per
  all-reduce in every step.

The sum is an upper envelope of the roofline's max(compute, memory): close where one term
dominates (long prefills, small-batch decodes), pessimistic by at most 2x where they balance.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sim.perf import LinearPerfModel


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    mem_bytes_per_s: float
    mem_bytes: float
    nvlink_bytes_per_s: float  # per direction, to the other GPUs of the node
    fp8_flops: float = 0.0  # dense FP8 peak; 0: no FP8 tensor cores


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float  # all parameters
    active_params: float  # per token (MoE: the routed experts only)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token_override: int = 0  # e.g. MLA's compressed cache
    expert_params: float = 0.0  # MoE: all routed experts of all layers (shared experts are dense)
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # routed experts each token goes to

    def kv_bytes_per_token(self, kv_bytes_per_value: float = 2.0) -> int:
        if self.kv_bytes_per_token_override:
            return self.kv_bytes_per_token_override
        return int(2 * self.layers * self.kv_heads * self.head_dim * kv_bytes_per_value)


GPUS = {g.name: g for g in (
    GPU("A100-80G", 312e12, 2.039e12, 80e9, 300e9),
    GPU("H100-SXM", 989e12, 3.35e12, 80e9, 450e9, fp8_flops=1979e12),
    GPU("H200", 989e12, 4.8e12, 141e9, 450e9, fp8_flops=1979e12),
    GPU("B200", 2250e12, 8.0e12, 192e9, 900e9, fp8_flops=4500e12),
)}

LINKS = {l.name: l for l in (
    Link("100GbE", 12.5e9, 20e-6),
    Link("RoCE-200G", 25e9, 10e-6),
    Link("IB-HDR", 25e9, 5e-6),
    Link("IB-NDR", 50e9, 5e-6),
    Link("NVLink", 450e9, 3e-6),
)}

MODELS = {m.name: m for m in (
    ModelSpec("llama-3-8b", 8.03e9, 8.03e9, 32, 4096, 32, 8, 128),
    ModelSpec("llama-3-70b", 70.6e9, 70.6e9, 80, 8192, 64, 8, 128),
    ModelSpec("qwen2.5-7b", 7.62e9, 7.62e9, 28, 3584, 28, 4, 128),
    ModelSpec("qwen2.5-14b", 14.7e9, 14.7e9, 48, 5120, 40, 8, 128),
    ModelSpec("qwen2.5-32b", 32.8e9, 32.8e9, 64, 5120, 40, 8, 128),
    ModelSpec("qwen2.5-72b", 72.7e9, 72.7e9, 80, 8192, 64, 8, 128),
    # DeepSeek-V3-style MoE with multi-head latent attention: 512 + 64 cached values per layer;
    # 58 MoE layers of 256 routed experts (3 matrices of 7168 x 2048), 8 per token
    ModelSpec("deepseek-v3", 671e9, 37e9, 61, 7168, 128, 128, 128, kv_bytes_per_token_override=61 * 576 * 2,
              expert_params=58 * 256 * 3 * 7168 * 2048, experts=256, experts_per_token=8),
)}


@dataclass(frozen=True, slots=True)
class Efficiency:
    mfu: float = 0.5  # share of peak FLOP/s that matmuls reach
    mbu: float = 0.7  # share of peak memory bandwidth that weight and KV reads reach
    step_overhead_s: float = 0.003  # scheduling, launches, sampling per step
    allreduce_latency_s: float = 10e-6  # per all-reduce


def roofline(model: ModelSpec, gpu: GPU, tp: int = 1, weight_bits: int = 16, link: Link | None = None,
             eff: Efficiency = Efficiency(), fp8_compute: bool = False) -> LinearPerfModel:
    """The linear step model of `model` on `tp` GPUs of one node, and `link` for KV transfer."""
    if tp < 1:
        raise ValueError("tensor parallelism must be at least 1")
    if fp8_compute and not gpu.fp8_flops:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores: FP8 compute is not available")
    if fp8_compute and weight_bits > 8:
        raise ValueError("FP8 compute needs weights of 8 bits or fewer (--weight-bits 8 or 4)")
    flops = tp * (gpu.fp8_flops if fp8_compute else gpu.bf16_flops) * eff.mfu
    mem = tp * gpu.mem_bytes_per_s * eff.mbu
    weight_bytes = (model.params - model.expert_params) * weight_bits / 8  # read by every step
    expert_bytes = model.expert_params * weight_bits / 8  # read as far as the step's tokens route
    allreduce_bytes = 2 * model.layers * model.hidden * 2 * 2 * (tp - 1) / tp  # per token
    per_token = 2 * model.active_params / flops + (allreduce_bytes / gpu.nvlink_bytes_per_s if tp > 1 else 0.0)
    attention = 4 * model.layers * model.heads * model.head_dim / flops
    base = eff.step_overhead_s + weight_bytes / mem + (2 * model.layers * eff.allreduce_latency_s if tp > 1 else 0.0)
    kv = model.kv_bytes_per_token()
    return LinearPerfModel(
        base_s=base, prefill_token_s=per_token, prefill_attention_s=attention, decode_seq_s=per_token,
        decode_context_s=kv / mem, kv_bytes_per_token=kv,
        link_bytes_per_s=link.bytes_per_s if link else float("inf"), link_latency_s=link.latency_s if link else 0.0,
        expert_read_s=expert_bytes / mem,
        expert_share=model.experts_per_token / model.experts if model.experts else 0.0)


def fits(model: ModelSpec, gpu: GPU, tp: int, weight_bits: int = 16) -> int:
    """KV tokens that fit beside the weights on `tp` GPUs (90% of memory usable); 0 if none."""
    free = 0.9 * tp * gpu.mem_bytes - model.params * weight_bits / 8
    return int(free // model.kv_bytes_per_token()) if free > 0 else 0
