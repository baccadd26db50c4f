"""Prompt lookup: drafts from the request's own prompt and output, where the output repeats its
input (rewriting, editing, quoting, extracting)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from pdserve.engine.request import Request


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
    draft_seconds = 0.0  # a lookup in the request's own tokens: free beside a step

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


    def propose_all(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """`propose` for each (request, limit), over the request's last `window` tokens."""
        return [self.propose(recent_tokens(req, self.window), limit) for req, limit in wanted]

    def release(self, request: Request) -> None:
        """Nothing is held for a request."""

    def finished(self, request: Request) -> None:
        """Prompt lookup learns nothing from requests that ended."""

    def forget(self) -> None:
        """Nothing learned to forget."""


def recent_tokens(request: Request, window: int) -> list[int]:
    """The request's last `window` tokens (prompt and output)."""
    return request.token_ids(max(0, request.num_tokens - window), request.num_tokens)
