"""Hot prefixes: which prompt prefixes many requests share now, and how many decode workers should
hold a copy of each. Pure bookkeeping over plain data (no workers, no HTTP); the replica round
(`replicas.py`) acts on it.

1. Every routed prompt's chained block hashes (the prefix index's, at the decode worker's block
   size) count towards a rate per hash, in requests per second, decaying with `window_s` (an
   exponentially weighted count: a burst lifts it at once, a quiet minute brings it to nothing).
   A hash's rate is never above its parent's, so a prompt's hot prefix is its longest run of
   leading blocks whose rate wants a second copy (twice `rate_per_copy`: below, its one holder
   serves it), at least `MIN_BLOCKS` long; a lone prompt's own blocks never are.
2. Such a prefix is tracked with its tokens (one past its last block where the prompt has it: the
   copy's source then computes that one token, its blocks all cached). Nested prefixes are tracked
   apart (a system prompt, and a document many of its requests go on with): their rates differ.
3. The copies a prefix wants: one per `rate_per_copy` of its rate, at least one (its first holder);
   the replica round makes at most as many as there are decode workers to hold them. A prefix whose rate fell below `FORGET_SHARE` of `rate_per_copy`
   is forgotten, once its copies are dropped.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

MIN_BLOCKS = 2  # shorter shared starts (a chat template's first tokens) are not worth a copy
MAX_BLOCKS = 512  # of a prompt's leading blocks counted: a prefix copied is at most this long
MAX_TRACKED_HASHES = 100_000
MAX_PREFIXES = 64
FORGET_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class HotPrefix:
    block_size: int
    hashes: tuple[int, ...]  # its blocks' chained hashes
    token_ids: tuple[int, ...]  # its blocks' tokens, and the prompt's next one where there was one

    @property
    def key(self) -> tuple[int, int]:
        return self.block_size, self.hashes[-1]

    @property
    def num_tokens(self) -> int:  # in its full blocks
        return len(self.hashes) * self.block_size


class HotPrefixes:
    def __init__(self, rate_per_copy: float, window_s: float = 10.0) -> None:
        if rate_per_copy <= 0 or window_s <= 0:
            raise ValueError("hot prefixes need a positive rate per copy and window")
        self.rate_per_copy, self.window_s = rate_per_copy, window_s
        self._counts: OrderedDict[tuple[int, int], tuple[float, float]] = OrderedDict()  # key -> (count, at)
        self._prefixes: OrderedDict[tuple[int, int], HotPrefix] = OrderedDict()

    def observe(self, prompt_ids: list[int], block_size: int, hashes: list[int], now: float) -> HotPrefix | None:
        """Count one routed prompt; returns its hot prefix, if it has one now."""
        rates = [self._add((block_size, h), now) for h in hashes[:MAX_BLOCKS]]
        depth = 0
        while depth < len(rates) and rates[depth] >= 2 * self.rate_per_copy:
            depth += 1
        if depth < MIN_BLOCKS:
            return None
        prefix = HotPrefix(block_size, tuple(hashes[:depth]), tuple(prompt_ids[:depth * block_size + 1]))
        self._track(prefix)
        return prefix

    def rate(self, block_size: int, block_hash: int, now: float) -> float:
        """Requests per second whose prompt had this block (decayed to `now`)."""
        entry = self._counts.get((block_size, block_hash))
        return self._decayed(entry, now) / self.window_s if entry is not None else 0.0

    def tracked(self, now: float) -> list[tuple[HotPrefix, int]]:
        """Each tracked prefix with the copies it wants now (0: cooled off, to be forgotten once its
        copies are dropped: `forget`)."""
        out = []
        for prefix in self._prefixes.values():
            rate = self.rate(prefix.block_size, prefix.hashes[-1], now)
            wanted = 0 if rate < FORGET_SHARE * self.rate_per_copy else max(1, math.floor(rate / self.rate_per_copy))
            out.append((prefix, wanted))
        return out

    def forget(self, prefix: HotPrefix) -> None:
        self._prefixes.pop(prefix.key, None)

    def _add(self, key: tuple[int, int], now: float) -> float:
        count = self._decayed(self._counts.get(key), now) + 1.0
        self._counts[key] = (count, now)
        self._counts.move_to_end(key)
        while len(self._counts) > MAX_TRACKED_HASHES:
            self._counts.popitem(last=False)
        return count / self.window_s

    def _decayed(self, entry: tuple[float, float] | None, now: float) -> float:
        if entry is None:
            return 0.0
        count, at = entry
        return count * math.exp(-max(0.0, now - at) / self.window_s)

    def _track(self, prefix: HotPrefix) -> None:
        self._prefixes[prefix.key] = prefix
        self._prefixes.move_to_end(prefix.key)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)
