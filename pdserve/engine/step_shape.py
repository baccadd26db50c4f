"""What one scheduled step computes, in the terms the simulator's step model uses: prompt tokens
(and the context they attend to) and decoding sequences (and the KV they read)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.step import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_tokens: int = 0  # prompt tokens computed (chunks)
    prefill_context: int = 0  # mean context those tokens attend to
    decode_seqs: int = 0  # sequences computing one token each
    decode_context: int = 0  # KV tokens all the decodes read together


def step_shape(out: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step; call it before the step runs (it reads computed tokens)."""
    prefill = decode_seqs = decode_ctx = 0
    prefill_ctx = 0.0
    for req, n in zip(out.requests, out.num_new_tokens):
        if n == 1:
            decode_seqs += 1
            decode_ctx += req.num_computed_tokens + 1
        else:
            prefill += n
            prefill_ctx += n * (req.num_computed_tokens + n / 2)
    return StepShape(prefill, round(prefill_ctx / prefill) if prefill else 0, decode_seqs, decode_ctx)
