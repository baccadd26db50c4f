"""Routing policies: which decode worker, which prefill worker, and whether to disaggregate at all.

Pure functions over the workers' last heartbeat, so that they are tested without a model and the
planner's simulator can run the very same code; router/routing.py composes them into one decision.

- Decode choice: a weighted score of free sessions, short queue, free KV memory and fast steps
  (the seeds' formula, with step latency added), plus the share of the prompt the worker's prefix
  cache holds (its prefill saved, or its transfer); workers above the hot-spot threshold of KV use
  get no new work while a cooler one exists.
- Prefill choice: the least work to do, counting the worker's queued prompt tokens plus the
  prompt tokens it does not already hold in its prefix cache (a router-side index of block hashes).
- Conditional disaggregation: a prompt whose uncached part is short, or a saturated prefill pool,
  is prefilled by the decode worker itself.
- Hot-spot relief: a running request moves off a decode worker above the hot threshold of KV use
  to one well below it; its KV travels through the transfer engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.wire import WorkerStats


@dataclass(slots=True)
class WorkerLoad:
    """What a worker's heartbeat says about it (its /stats)."""

    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 1
    step_latency_ewma_ms: float = 0.0
    capacity: int = 0  # sequences it holds at most, running and queued (0: not said)
    step_token_budget: int = 0  # tokens a step computes at most (0: not said)

    @classmethod
    def from_stats(cls, stats: WorkerStats) -> WorkerLoad:
        return cls(**{k: getattr(stats, k) for k in cls.__slots__})

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)

    @property
    def sessions(self) -> int:
        return self.running + self.waiting_for_kv


@dataclass(frozen=True, slots=True)
class DecodeWeights:
    sessions: float = 0.35
    queue: float = 0.25
    memory: float = 0.25
    latency: float = 0.15
    sessions_cap: int = 64  # sessions at which the sessions term reaches zero
    queue_cap: int = 100
    latency_cap_ms: float = 250.0
    hot_kv_usage: float = 0.85  # above this a worker gets no new work while another is cooler
    prefix: float = 0.3  # added times the share of the prompt a worker's prefix cache holds


def decode_score(load: WorkerLoad, w: DecodeWeights = DecodeWeights()) -> float:
    """Higher is better, in [0, 1] when the weights sum to 1."""
    return (
        w.sessions * (1.0 - min(load.sessions / w.sessions_cap, 1.0))
        + w.queue * (1.0 - min(load.waiting / w.queue_cap, 1.0))
        + w.memory * (1.0 - min(load.kv_usage, 1.0))
        + w.latency * (1.0 - min(load.step_latency_ewma_ms / w.latency_cap_ms, 1.0))
    )


def choose_decode(loads: dict[str, WorkerLoad], w: DecodeWeights = DecodeWeights(),
                  exclude: frozenset[str] = frozenset(), cached_share: dict[str, float] | None = None) -> str | None:
    """The decode worker to use (by id), or None when there is none. `cached_share`: the share of the
    prompt each worker's prefix cache holds (absent: none), worth `w.prefix` of score at most."""
    shares = cached_share or {}
    candidates = {k: v for k, v in loads.items() if k not in exclude}
    cool = {k: v for k, v in candidates.items() if v.kv_usage <= w.hot_kv_usage}
    pool = cool or candidates
    if not pool:
        return None
    return max(sorted(pool), key=lambda k: decode_score(pool[k], w) + w.prefix * shares.get(k, 0.0))


class PrefixIndex:
    """Which prompt prefixes each worker has seen recently, as chained block hashes (the same
    hash as the engines' prefix caches), bounded per worker, least recently used out first.

    One index per block size: a worker's hashes name blocks of its own size, so a prompt is looked
    up with the hashes of the block size of the worker asked about."""

    def __init__(self, max_blocks_per_worker: int = 100_000) -> None:
        self.max_blocks = max_blocks_per_worker
        self._seen: dict[int, dict[str, OrderedDict[int, None]]] = {}  # block size -> worker -> hashes

    def cached_tokens(self, worker: str, block_size: int, hashes: list[int]) -> int:
        """Prompt tokens `worker` holds at the start of the prompt whose `block_size` hashes these are."""
        seen = self._seen.get(block_size, {}).get(worker)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n * block_size

    def record(self, worker: str, block_size: int, hashes: list[int]) -> None:
        seen = self._seen.setdefault(block_size, {}).setdefault(worker, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def forget(self, worker: str) -> None:
        for workers in self._seen.values():
            workers.pop(worker, None)

    def forget_blocks(self, worker: str, block_size: int, hashes: list[int]) -> None:
        seen = self._seen.get(block_size, {}).get(worker)
        for h in hashes if seen is not None else ():
            seen.pop(h, None)


def choose_prefill(loads: dict[str, WorkerLoad], cached_tokens: dict[str, int], prompt_len: int,
                   exclude: frozenset[str] = frozenset()) -> str | None:
    """The prefill worker with the least prompt work ahead of this request, or None.
    `cached_tokens`: how much of the prompt each worker holds in its prefix cache (absent: none)."""
    def work(k: str) -> int:
        return loads[k].queued_prefill_tokens + prompt_len - cached_tokens.get(k, 0)
    candidates = sorted(k for k in loads if k not in exclude)
    return min(candidates, key=work) if candidates else None


@dataclass(frozen=True, slots=True)
class DisaggregationPolicy:
    min_remote_tokens: int = 256  # uncached prompt tokens below which decode prefills itself
    saturated_queue_tokens: int = 16_384  # every prefill worker queued this much: decode prefills


def prefill_remotely(uncached_tokens: int, prefill_loads: dict[str, WorkerLoad],
                     policy: DisaggregationPolicy = DisaggregationPolicy()) -> bool:
    """Should this prompt go to a prefill worker (True) or be prefilled by its decode worker?"""
    if not prefill_loads or uncached_tokens < policy.min_remote_tokens:
        return False
    return min(l.queued_prefill_tokens for l in prefill_loads.values()) < policy.saturated_queue_tokens


@dataclass(slots=True)
class Admission:
    """Bounds on what the router holds: requests and prompt tokens waiting for a worker."""

    max_requests: int = 1024
    max_tokens: int = 1 << 20
    requests: int = 0
    tokens: int = 0
    _held: dict[str, int] = field(default_factory=dict)

    def try_admit(self, request_id: str, num_tokens: int) -> bool:
        if self.requests + 1 > self.max_requests or self.tokens + num_tokens > self.max_tokens:
            return False
        self.requests += 1
        self.tokens += num_tokens
        self._held[request_id] = num_tokens
        return True

    def release(self, request_id: str) -> None:
        n = self._held.pop(request_id, None)
        if n is not None:
            self.requests -= 1
            self.tokens -= n


@dataclass(frozen=True, slots=True)
class RunningStream:
    """What the router knows of a request streaming from a decode worker."""

    stream_id: str
    worker_id: str
    context_tokens: int  # prompt + generated so far: the KV it holds there
    remaining_tokens: int  # at most this many still to generate


@dataclass(frozen=True, slots=True)
class HotSpotRelief:
    target_max_kv_usage: float = 0.6  # a worker takes moved requests only below this KV use
    min_remaining_tokens: int = 32  # a request this close to its end stays where it is


def choose_migrations(loads: dict[str, WorkerLoad], streams: list[RunningStream],
                      w: DecodeWeights = DecodeWeights(), relief: HotSpotRelief = HotSpotRelief()) -> list[tuple[str, str]]:
    """Hot-spot relief: (stream id, target worker id) moves for this round. At most one request
    leaves each decode worker above the hot threshold of KV use, the one holding the most KV, and
    each goes to a different worker below the relief target (the best scored)."""
    hot = sorted((k for k, l in loads.items() if l.kv_usage > w.hot_kv_usage), key=lambda k: (-loads[k].kv_usage, k))
    cool = {k: l for k, l in loads.items() if l.kv_usage < relief.target_max_kv_usage}
    moves: list[tuple[str, str]] = []
    for worker in hot:
        movable = [s for s in streams if s.worker_id == worker and s.remaining_tokens >= relief.min_remaining_tokens]
        if not cool or not movable:
            continue
        stream = max(movable, key=lambda s: (s.context_tokens, s.stream_id))
        target = choose_decode(cool, w)
        moves.append((stream.stream_id, target))
        del cool[target]
    return moves
