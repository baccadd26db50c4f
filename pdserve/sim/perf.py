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

Speculative decoding (`draft_tokens` > 0, `draft_acceptance` > 0): a decode-only step of b
sequences verifying k draft tokens each is a step of b (1 + k) decode rows, each reading its
context, and gives each sequence E(k) = 1 + a + a^2 + ... + a^k tokens, a being the chance that a
draft token is kept after the ones before it were. As the engine's draft budget does, k is the
count (0 to `draft_tokens`) that gives the most tokens a second at that batch, and the step is
reported as the time of one token of each sequence, t(b (1 + k)) / E(k): the simulated scheduler
keeps advancing one token a step. Steps with prefill tokens verify nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

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
    draft_tokens: int = 0  # speculative decoding: draft tokens a sequence verifies at a step, at most
    draft_acceptance: float = 0.0  # the chance a draft token is kept after the ones before it were

    def step_time(self, s: StepShape) -> float:
        if not (s.prefill_tokens or s.decode_seqs):
            return 0.0
        if self.draft_tokens and self.draft_acceptance and s.decode_seqs and not s.prefill_tokens:
            return min(self._rows_time(s, 1 + k) / self.tokens_per_step(k) for k in range(self.draft_tokens + 1))
        return self._rows_time(s, 1)

    def tokens_per_step(self, k: int) -> float:
        """A sequence's tokens from a step that verifies k draft tokens of it."""
        return sum(self.draft_acceptance ** j for j in range(k + 1))

    def _rows_time(self, s: StepShape, rows_per_seq: int) -> float:
        rows = s.decode_seqs * rows_per_seq
        t = (self.base_s + self.prefill_token_s * s.prefill_tokens
             + self.prefill_attention_s * s.prefill_tokens * s.prefill_context
             + self.decode_seq_s * rows + self.decode_context_s * s.decode_context * rows_per_seq)
        if self.expert_read_s:
            t += self.expert_read_s * (1.0 - (1.0 - self.expert_share) ** (s.prefill_tokens + rows))
        return t

    def speculating(self, acceptance: float, tokens: int) -> LinearPerfModel:
        """This model with speculative decoding: draft tokens kept with `acceptance` each (after
        the ones before them), `tokens` at most a step."""
        if not 0.0 <= acceptance < 1.0 or tokens < 0:
            raise ValueError(f"draft acceptance must be in [0, 1) and draft tokens >= 0, got {acceptance}, {tokens}")
        return replace(self, draft_tokens=tokens, draft_acceptance=acceptance)

    def transfer_time(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.link_latency_s + num_tokens * self.kv_bytes_per_token / self.link_bytes_per_s

    def to_json(self) -> dict:
        return asdict(self)
