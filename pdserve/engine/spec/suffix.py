"""Suffix decoding: drafts from what recent requests wrote, as well as from the request's own text.

Agent loops, retries, templated answers and repeated questions make a worker write the same
continuations again and again, which prompt lookup cannot see (they are not in the request's own
prompt). `SuffixIndex` counts, for every n-gram (n = 2..4) of recent requests' outputs, the tokens
that followed it; a draft extends the context a token at a time by the most frequent follower of
its longest known tail, while that follower is a clear majority. Memory is bounded: at most
`capacity` n-grams are kept, the least recently seen dropped first (about 150 bytes each).

`SuffixProposer` asks prompt lookup first (the request's own prompt and output) and takes the
index's draft where that one is longer. It learns from every request that finishes on this worker;
what it knows belongs to the worker and its traffic, not to a request, so nothing travels with a
request that moves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.engine.spec.ngram import NgramProposer, recent_tokens

INDEX_CAPACITY = 1 << 17  # n-grams kept, at most: ~20 MB
MIN_SHARE = 0.5  # a follower is drafted only if more than this share of the n-gram's followers were it


@dataclass
class SuffixIndex:
    max_ngram: int = 4
    min_ngram: int = 2
    capacity: int = INDEX_CAPACITY
    counts: OrderedDict[tuple[int, ...], dict[int, int]] = field(default_factory=OrderedDict)

    def add(self, tokens: list[int]) -> None:
        """Count the followers of every n-gram of `tokens` (a finished request's output, after the
        last few tokens of its prompt)."""
        counts = self.counts
        for end in range(self.min_ngram, len(tokens)):
            follower = tokens[end]
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(tokens[end - n : end])
                seen = counts.get(key)
                if seen is None:
                    counts[key] = {follower: 1}
                else:
                    seen[follower] = seen.get(follower, 0) + 1
                    counts.move_to_end(key)
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens`, each its longest known tail's clear-majority follower."""
        context = list(tokens[-self.max_ngram :])
        draft: list[int] = []
        while len(draft) < k:
            followers = None
            for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
                followers = self.counts.get(tuple(context[-n:]))
                if followers:
                    break
            if not followers:
                break
            token, count = max(followers.items(), key=lambda item: item[1])
            if count <= MIN_SHARE * sum(followers.values()):
                break
            draft.append(token)
            context = context[1:] + [token]
        return draft


@dataclass
class SuffixProposer:
    """Prompt lookup over the request's own tokens, and the worker's index of recent outputs."""

    num_tokens: int = 8
    lookup: NgramProposer = None  # type: ignore[assignment]
    index: SuffixIndex = field(default_factory=SuffixIndex)
    method = "suffix"
    draft_seconds = 0.0  # lookups: free beside a step

    def __post_init__(self) -> None:
        if self.lookup is None:
            self.lookup = NgramProposer(self.num_tokens)

    @property
    def window(self) -> int:
        return self.lookup.window

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        own = self.lookup.propose(tokens, limit)
        k = min(self.num_tokens, limit)
        if len(own) >= k or k < 1:
            return own
        learned = self.index.propose(tokens, k)
        return learned if len(learned) > len(own) else own

    def propose_all(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose(recent_tokens(req, self.window), limit) for req, limit in wanted]

    def release(self, request: Request) -> None:
        """What the index knows belongs to the worker: nothing is held for a request."""

    def finished(self, request: Request) -> None:
        if request.output_token_ids:
            tail = request.prompt_token_ids[-self.index.max_ngram :]
            self.index.add(tail + request.output_token_ids[-self.lookup.window :])

    def forget(self) -> None:
        """Drop what earlier requests taught the index (a benchmark's runs start alike)."""
        self.index.counts.clear()
