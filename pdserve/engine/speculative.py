"""Speculative decoding: a request's next tokens proposed cheaply, then verified in one step.

1. Before a step, the scheduler asks the proposer for up to `num_tokens` drafts for each running
   request that decodes one token and may speculate (`speculates`), and schedules it as a chunk of
   its last token and the drafts (`Request.draft`): KV slots for all of them are allocated.
2. The step computes the chunk like decode rows over the cache and samples a token after each of
   its positions, as decoding one at a time would have: the drafts ahead of a position count as
   output so far (penalties), the structure's mask is taken after them, and a seeded request's
   position j draws the generator's j-th next noise row (the sampler's exponential race).
3. The scheduler keeps the drafts up to the first the model did not sample, and the model's own
   token there (`verified`): between one and `len(draft) + 1` new tokens. Only the KV of the last
   token and the kept drafts counts as computed; a rejected draft's slots are written again by
   the next step, and no block holding one is ever cached, as the prefix cache takes full blocks
   of computed tokens only.

Why this keeps the target distribution: a draft here is one token, not a distribution (the
proposer is deterministic), and the standard accept/resample rule for such a draft (accept with
probability p(draft), else sample from p without the draft, renormalized) gives exactly the
token p's own draw gives: the draw equals the draft with probability p(draft), and otherwise it
is a draw from p given that it is not the draft. With the same noise the draw is also the very
token decoding without speculation samples, so a seeded request's output does not depend on
speculation at all (greedy is the case of no noise); its generator is then set back to where
drawing only the kept positions leaves it.

The proposers: prompt lookup (n-grams, here): where the output repeats its input (rewriting,
editing, quoting, extracting) the tokens that followed the latest earlier occurrence of the last
few tokens are likely to follow again; suffix decoding (`suffix_proposer`), which also drafts what
recent requests on the worker wrote. A proposer has `num_tokens`, `window` (the context tokens it
reads), `method`, `propose(tokens, limit)` and `finished(request)` (a request that ended here). A structured request's draft is cut to the tokens its
structure allows; a request may opt out (`SamplingParams.speculate`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from pdserve.engine.request import Request

SPECULATIVE_METHODS = ("off", "ngram", "suffix")


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the context's last
    `max_ngram` (down to `min_ngram`) tokens with `num_tokens` after it; where none has as many,
    what followed the latest occurrence of the longest tail found. Looks back at most `window`
    tokens."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 2
    window: int = 1024
    method = "ngram"

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """At most min(num_tokens, limit) drafts to follow `tokens` (prompt and output so far)."""
        k = min(self.num_tokens, limit)
        if k < 1:
            return []
        context = tokens[-self.window :]
        data = array("q", context).tobytes()  # searched in C: 8 bytes a token
        best: list[int] = []
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = data[-8 * n :]
            end = len(data) - 8  # a match must leave at least one token after it
            while True:
                at = data.rfind(tail, 0, end)  # the latest first
                if at < 0:
                    break
                if at % 8 == 0:  # on a token's boundary
                    i = at // 8
                    following = context[i + n : i + n + k]
                    if len(following) == k:
                        return following
                    best = best or following
                end = at + 8 * n - 1
        return best


    def finished(self, request: Request) -> None:
        """Prompt lookup learns nothing from requests that ended."""

    def forget(self) -> None:
        """Nothing learned to forget."""


def speculates(request: Request) -> bool:
    """Whether the request's next tokens may be drafted: it decodes here and did not opt out."""
    return request.params.speculate and not request.remote_prefill


def verified(draft: list[int], sampled: list[int]) -> list[int]:
    """The new tokens a verified draft gives: the drafts the model sampled, then the model's own
    token after them (`sampled[i]` is its token after the last token and the first i drafts)."""
    a = 0
    while a < len(draft) and draft[a] == sampled[a]:
        a += 1
    return draft[:a] + [sampled[a]]

