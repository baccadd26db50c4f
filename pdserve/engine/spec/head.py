"""Drafts from a draft head (`--speculative head:PATH`: EAGLE or MTP weights, `models/draft_head.py`)
on the model's own hidden states.

The hand-off is the model runner's: every step it runs the head's layer over every position it
computed (the model's feature there and the token after it), so the head's KV is in the model's
blocks wherever the model's is, and leaves each request that sampled its head feature at its
last token (`Request.head_feature`; a prefill worker sends it with the first token). Drafting
then needs no prompt pass at all: the first draft is the model's head on that feature, and each
further one a step of the head's layer at the next position (one row a request, all drafting
requests at once), its KV written into slots the request's next step computes over again.

A draft is the most likely token under the request's `logit_bias` (the model's distribution is
what verification keeps, `engine/spec/__init__.py`); a request without a feature yet (its prompt
still computing, or a prefill worker without the head) does not draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.spec.budget import COST_MEMORY
from pdserve.engine.step import SchedulerOutput


@dataclass(slots=True)
class _Row:
    """A request's drafting position, in the form the runner's step reads: one token at `position`."""

    request_id: str
    position: int
    token: int
    draft: list[int] = field(default_factory=list)  # the head verifies nothing
    prompt_logprobs: None = None

    @property
    def num_computed_tokens(self) -> int:
        return self.position

    @property
    def num_tokens(self) -> int:
        return self.position + 1

    def token_ids(self, start: int, end: int) -> list[int]:
        return [self.token]


def feature_from_wire(data: bytes, hidden_size: int, runner: ModelRunner) -> torch.Tensor | None:
    """A draft head's feature as a prefill worker sent it (float32 values), in the runner's dtype
    and device; None where none came; ValueError for bytes that are no feature of this model."""
    if not data:
        return None
    if len(data) != 4 * hidden_size:
        raise ValueError(f"a draft head feature of {len(data)} bytes; this model's has {hidden_size} float32 values")
    feature = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if not torch.isfinite(feature).all():
        raise ValueError("a draft head feature with values that are not finite")
    return feature.to(dtype=runner.dtype, device=runner.device)


class HeadProposer:
    """Proposes each request's next `num_tokens` tokens as the model's draft head guesses them."""

    method = "head"

    def __init__(self, runner: ModelRunner, blocks: BlockManager, num_tokens: int) -> None:
        self.runner = runner
        self.blocks = blocks  # the model's: the head's layer is one more in the same blocks
        self.num_tokens = num_tokens
        self.draft_seconds: float | None = None  # a drafting step of the head, moving average

    @torch.inference_mode()
    def propose_all(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        todo = []  # (index in wanted, request, drafts it wants)
        for i, (req, limit) in enumerate(wanted):
            k = min(self.num_tokens, limit)
            if k >= 1 and req.head_feature is not None:
                todo.append((i, req, k))
        if not todo:
            return drafts
        start = time.perf_counter()
        features = torch.stack([req.head_feature for _, req, _ in todo])
        for (i, _, _), token in zip(todo, self._guess(features, [req for _, req, _ in todo])):
            drafts[i].append(token)
        steps = 0
        for j in range(1, max(k for _, _, k in todo)):
            going = [(n, i, req) for n, (i, req, k) in enumerate(todo) if k > j and drafts[i]]
            # the head's KV at the request's positions from its last token on: slots its next
            # step allocates anyway (a request the pool has no room for stops drafting here)
            going = [(n, i, req) for n, i, req in going if self.blocks.allocate(req, j)]
            if not going:
                break
            step = SchedulerOutput()
            for _, i, req in going:
                step.requests.append(_Row(req.request_id, req.num_tokens - 2 + j, drafts[i][-1]))
                step.num_new_tokens.append(1)
                step.block_tables.append(self.blocks.block_table(req.request_id))
            step.num_decodes = len(going)
            features = self.runner.head_step(step, features[[n for n, _, _ in going]])
            todo_rows = [n for n, _, _ in going]
            for (_, i, _), token in zip(going, self._guess(features, [req for _, _, req in going])):
                drafts[i].append(token)
            todo = [todo[n] for n in todo_rows]
            steps += 1
        self._observe((time.perf_counter() - start) / (steps + 1))
        return drafts

    def _guess(self, features: torch.Tensor, requests: list[Request]) -> list[int]:
        logits = self.runner.head_logits(features)
        vocab = logits.shape[1]
        for row, req in enumerate(requests):
            for token, bias in req.params.logit_bias.items():
                if token < vocab:
                    logits[row, token] += bias
        return logits.argmax(dim=-1).tolist()

    def _observe(self, seconds: float) -> None:
        old = self.draft_seconds
        self.draft_seconds = seconds if old is None else old + COST_MEMORY * (seconds - old)

    def release(self, request: Request) -> None:
        """The head's KV is in the request's own blocks: nothing of its own to free."""

    def finished(self, request: Request) -> None:
        """A head learns nothing from requests that ended."""

    def forget(self) -> None:
        """Nothing kept between requests."""
