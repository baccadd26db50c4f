"""Penalties and biases on a row's logits before it is sampled (greedy rows too), as OpenAI and
vLLM define them, in vLLM's order:

1. `logit_bias`: each named token's logit plus its bias (-100 bans a token in practice, +100
   all but forces it);
2. `repetition_penalty` (vLLM's, from CTRL): each token already in the prompt or the output has
   its logit divided by the penalty where positive, multiplied where negative;
3. `frequency_penalty` and `presence_penalty` (OpenAI's): each token's logit less its count in the
   output so far times the first, and less the second once it is in the output at all.

Everything here is a function of the prompt and the tokens so far, which every worker that samples
a request holds (the prefill worker its first token, the decode worker the rest, a worker it
migrated to the tokens it resumes from), so each samples what the others would. Rows without any
penalty keep their logits bit for bit, and a step without one costs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sampling_params import SamplingParams


@dataclass(slots=True)
class RowPenalties:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # every token so far, those generated elsewhere included


def apply_penalties(logits: torch.Tensor, rows: list[RowPenalties | None]) -> torch.Tensor:
    """`logits` ([rows, vocab] float32) with each row's penalties applied; a copy where any applies."""
    if all(row is None for row in rows):
        return logits
    logits = logits.clone()
    for i, row in enumerate(rows):
        if row is not None:
            _penalize(logits[i], row)
    return logits


def _penalize(x: torch.Tensor, row: RowPenalties) -> None:
    p = row.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=x.device)
        x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(row.prompt_ids + row.output_ids, dtype=torch.long, device=x.device).unique()
        values = x[seen]
        x[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if row.output_ids and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(row.output_ids, dtype=torch.long, device=x.device), minlength=x.numel())
        x -= counts.to(x.dtype) * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty
