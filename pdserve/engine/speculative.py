"""Speculative decoding: a request's next tokens proposed cheaply, then verified in one step.

1. Before a step, the scheduler asks the proposer for up to `num_tokens` drafts for each running
   request that decodes one token and may speculate (`speculates`), and schedules it as a chunk of
   its last token and the drafts (`Request.draft`): KV slots for all of them are allocated.
2. The step computes the chunk like a prefill chunk after cached tokens and returns the model's
   choice after each of its positions (`verify`).
3. The scheduler keeps the drafts up to the first the model would not have chosen, and the model's
   own choice there: between one and `len(draft) + 1` new tokens, exactly the tokens decoding one
   at a time would have given (greedy). Only the KV of the last token and the kept drafts counts as
   computed; a rejected draft's slots are written again by the next step, and no block holding
   one is ever cached, as the prefix cache takes full blocks of computed tokens only.

The proposer here is prompt lookup (n-grams): where the output repeats its input (rewriting,
editing, quoting, extracting) the tokens that followed the latest earlier occurrence of the last
few tokens are likely to follow again. Only greedy requests without penalties, biases, structures
or log-probabilities speculate: their next token is the model's argmax alone.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from pdserve.engine.request import Request

SPECULATIVE_METHODS = ("off", "ngram")


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


def speculates(request: Request) -> bool:
    """Whether the request's next tokens are the model's argmax alone, so drafts can be verified
    against it: greedy, one completion, nothing that changes or reads the distribution."""
    p = request.params
    return (p.temperature == 0 and not p.penalized and p.logprobs is None and request.matcher is None
            and not request.remote_prefill)


def accepted(draft: list[int], chosen: list[int]) -> list[int]:
    """The new tokens a verified draft gives: the drafts the model agrees with, then the model's own
    choice after them (`chosen[i]` is its choice after the last token and the first i drafts)."""
    a = 0
    while a < len(draft) and draft[a] == chosen[a]:
        a += 1
    return draft[:a] + [chosen[a]]
