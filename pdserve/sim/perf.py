"""Performance models: how long one engine step and one KV transfer take.

The simulator asks a model for the duration of each step the real scheduler produces. A model
here is linear in what a step holds, which is the shape `pdserve profile` fits to measurements
and the roofline projection produces for hardware we cannot run:

    step = base + prefill_token * prefill tokens + prefill_attention * prefill tokens * their mean
           context + decode_seq * decode sequences + decode_context * KV tokens the decodes read
           + expert_read * (1 - (1 - expert_share)^tokens)
    transfer = latency + KV bytes / link bandwidth

The one term that is not linear is a mixture of experts' weight reads: each token routes to a share
`expert_share` of a layer's experts (k of E), so a step of n tokens (prefill tokens plus decodes)
reads the weights of 1 - (1 - k/E)^n of them in expectation: a few experts for one decode, nearly
all for a batch of hundreds. Dense models leave it at zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.engine.step_shape import StepShape

__all__ = ["LinearPerfModel", "StepShape"]


@dataclass(frozen=True, slots=True)
class LinearPerfModel:
    base_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_attention_s: float = 0.0  # per prefill token per token of context
    decode_seq_s: float = 0.0
    decode_context_s: float = 0.0  # per KV token read by a decode
    kv_bytes_per_token: int = 0
    link_bytes_per_s: float = float("inf")
    link_latency_s: float = 0.0
    expert_read_s: float = 0.0  # reading every routed expert's weights once
    expert_share: float = 0.0  # experts a token routes to, over experts per layer (k / E)

    def step_time(self, s: StepShape) -> float:
        if not (s.prefill_tokens or s.decode_seqs):
            return 0.0
        t = (self.base_s + self.prefill_token_s * s.prefill_tokens
             + self.prefill_attention_s * s.prefill_tokens * s.prefill_context
             + self.decode_seq_s * s.decode_seqs + self.decode_context_s * s.decode_context)
        if self.expert_read_s:
            t += self.expert_read_s * (1.0 - (1.0 - self.expert_share) ** (s.prefill_tokens + s.decode_seqs))
        return t

    def transfer_time(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.link_latency_s + num_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def to_json(self) -> dict:
        return asdict(self)
