"""One routing decision: which decode worker, and which prefill worker if any, for one prompt.

The router and the simulator both route with `route`, and differ only in how they apply its
decision. It is a pure function of plain data: each worker's load (its last report plus what was
routed to it since), whether it has room for the request, and its block size, with the prefix
index read but never written; the caller records the decision's hashes once it commits to it.

The decision, in order:
1. Decode candidates are the decode and colocated workers not excluded; with none of those alive,
   prefill workers serve colocated (and no worker prefills for another). None at all: `NoWorker`.
2. Of those, the ones with room; none: `NoRoom` (the request waits for room).
3. The decode worker with the best score (policy.choose_decode), its prefix cache's share of the
   prompt counted.
4. The prompt goes to a prefill worker when its part uncached on the decode worker is worth it and
   the prefill pool is not saturated (policy.prefill_remotely): the one with the least prompt work
   ahead, counting what its prefix cache holds (policy.choose_prefill).
A worker's cached part is what the index says its own prefix cache holds, or, where it shares a KV
store (`Candidate.store`), what any worker of that store computed: every full block a worker
computes goes to its store at once, and reading it back costs a fraction of computing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.prefix_hash import block_hashes
from pdserve.router.policy import (
    DecodeWeights, DisaggregationPolicy, PrefixIndex, WorkerLoad, choose_decode, choose_prefill, prefill_remotely,
)

DECODE_ROLES = ("decode", "both")
STORE_PREFIX = "store:"  # the prefix index's name for a shared KV store: what its workers computed


class NoWorker(Exception):
    """No live worker could take the request (none at all, or every one excluded)."""


class NoRoom(Exception):
    """Every worker that could decode the request holds as many sequences as it said it can."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as routing sees it."""

    worker_id: str
    role: str  # "prefill", "decode" or "both"
    load: WorkerLoad  # its last report, plus what was routed to it since
    has_room: bool = True  # it can take this request's sequences on top of those it holds
    block_size: int = 16  # tokens per block of its prefix cache
    store: str = ""  # the shared KV store it reads and writes (its id; "": none)


@dataclass(frozen=True, slots=True)
class PrefixRecord:
    """Block hashes a chosen worker will hold once it has the prompt, for the prefix index."""

    worker_id: str  # a worker, or a store ("store:" + its id): what a worker computes, its store holds
    block_size: int
    hashes: list[int]


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    decode_id: str
    prefill_id: str | None  # None: the decode worker computes the prompt itself
    decode_uncached: int  # prompt tokens not in the decode worker's prefix cache, as far as the index knows
    prefill_uncached: int  # the same for the prefill worker (0 without one)
    records: tuple[PrefixRecord, ...]  # for PrefixIndex.record, once the request is sent


def route(workers: list[Candidate], prompt_ids: list[int], index: PrefixIndex | None,
          weights: DecodeWeights = DecodeWeights(), policy: DisaggregationPolicy = DisaggregationPolicy(),
          exclude: frozenset[str] = frozenset()) -> RoutingDecision:
    """Where this prompt goes. `exclude`: workers not to decode it (they failed it already).
    `index` None: no worker is known to hold any prefix (nothing is hashed, nothing to record)."""
    decodes = {w.worker_id: w for w in workers if w.role in DECODE_ROLES and w.worker_id not in exclude}
    prefills = {w.worker_id: w for w in workers if w.role == "prefill"}
    if not decodes:  # no decode worker: prefill workers serve colocated
        decodes = {k: w for k, w in prefills.items() if k not in exclude}
        prefills = {}
    if not decodes:
        raise NoWorker()
    roomy = {k: w.load for k, w in decodes.items() if w.has_room}
    if not roomy:
        raise NoRoom()
    hashed: dict[int, list[int]] = {}  # block size -> the prompt's hashes: once per size

    def hashes(w: Candidate) -> list[int]:
        if w.block_size not in hashed:
            hashed[w.block_size] = block_hashes(prompt_ids, w.block_size)
        return hashed[w.block_size]

    known: dict[str, int] = {}  # worker id -> its cached tokens: each worker looked up once

    def cached(w: Candidate) -> int:  # in its own cache, or in a store it reads (a read, not a computation)
        if index is None:
            return 0
        if w.worker_id not in known:
            own = index.cached_tokens(w.worker_id, w.block_size, hashes(w))
            known[w.worker_id] = max(own, index.cached_tokens(STORE_PREFIX + w.store, w.block_size, hashes(w))) \
                if w.store else own
        return known[w.worker_id]

    shares = {k: cached(decodes[k]) / len(prompt_ids) for k in roomy} if index is not None and prompt_ids else {}
    d = decodes[choose_decode(roomy, weights, cached_share=shares)]
    chosen = [d]
    decode_uncached, prefill_uncached, prefill_id = len(prompt_ids) - cached(d), 0, None
    loads = {k: w.load for k, w in prefills.items()}
    if prefill_remotely(decode_uncached, loads, policy):
        p = prefills[choose_prefill(loads, {k: cached(w) for k, w in prefills.items()}, len(prompt_ids))]
        chosen.append(p)
        prefill_uncached, prefill_id = len(prompt_ids) - cached(p), p.worker_id
    if index is None:
        return RoutingDecision(d.worker_id, prefill_id, decode_uncached, prefill_uncached, ())
    records = tuple(PrefixRecord(w.worker_id, w.block_size, hashes(w)) for w in chosen) + tuple(
        PrefixRecord(STORE_PREFIX + w.store, w.block_size, hashes(w)) for w in chosen if w.store)
    return RoutingDecision(d.worker_id, prefill_id, decode_uncached, prefill_uncached, records)
