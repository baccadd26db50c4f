"""What a model's prefill computes and its decode step reads, counted from its config and its
weights as held: the denominators of the engine benchmark's MFU and MBU."""

from __future__ import annotations

import torch

from pdserve.models.arch_config import ArchConfig

FLOP_COUNT = (
    "MFU = 2 * non-embedding parameters (of a mixture of experts, those a token computes with) * prompt "
    "tokens / seconds / measured matmul peak (the Kaplan et al. count: one multiply-add per weight per "
    "token; embedding lookup and the one-token lm_head excluded). Causal attention adds "
    "2 * layers * q_size * L**2 FLOP (QK^T and AV); mfu_incl_attention_pct counts it too."
)
BYTE_COUNT = (
    "MBU = bytes read per decode step / step time / measured read bandwidth, where a step reads every "
    "weight once (all layers and lm_head; one embedding row is ignored) plus each request's K and V "
    "for its whole context (mean context over the timed steps)."
)


def non_embedding_parameters(cfg: ArchConfig, active: bool = False) -> int:
    """Every non-embedding parameter, or with `active` those one token computes with (a
    mixture-of-experts model's top-k experts)."""
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_parameters(active) - embeddings


def prefill_flops(cfg: ArchConfig, tokens: int) -> tuple[float, float]:
    """(matmul FLOP, causal attention FLOP) of one prompt."""
    return 2.0 * non_embedding_parameters(cfg, active=True) * tokens, 2.0 * cfg.num_layers * cfg.q_size * tokens**2


def decode_step_bytes(cfg: ArchConfig, element_size: int, batch: int, mean_context: float) -> float:
    weights = non_embedding_parameters(cfg) + cfg.vocab_size * cfg.hidden_size  # + lm_head
    kv = 2 * cfg.num_layers * cfg.kv_size * mean_context * batch
    return (weights + kv) * element_size


def matmul_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every matmul weight (the layers' and the head), as held: what a decode step reads."""
    from pdserve.layers.block_weight import BlockWeight
    from pdserve.layers.quant import Int4Weight, QuantizedWeight
    from pdserve.models.loader import matmul_weights

    total = 0
    for _, module, attr in matmul_weights(model):
        w = getattr(module, attr)
        if isinstance(w, QuantizedWeight):
            total += w.qs.nbytes + w.scales.nbytes + (0 if w.mins is None else w.mins.nbytes)
        elif isinstance(w, BlockWeight):
            total += w.nbytes
        elif isinstance(w, Int4Weight):
            total += w.packed.nbytes + w.scales_and_zeros.nbytes
        else:
            total += w.numel() * w.element_size()
    return total
