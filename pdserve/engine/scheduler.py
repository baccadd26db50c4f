"""Continuous batching with chunked prefill, priorities and preemption by recompute.

Lifecycle of a request in the scheduler:
1. `add`: WAITING, in the waiting queue (ordered by priority, then arrival; or, shortest prompt
   first within a priority, where a request waiting past `max_wait_s` goes first: none starves).
2. `schedule`: admitted when blocks and the step's token budget allow -> RUNNING. Its prompt may be
   computed over several steps (chunks); prefix-cache hits skip the blocks already computed.
3. Out of blocks: the lowest-priority running request is preempted -> PREEMPTED, blocks freed,
   back to the front of its priority class; later it recomputes prompt + output so far.
4. `update`: counts the computed tokens, appends the sampled token when the chunk reached the end,
   and finishes requests on eos / stop token / length.
5. `finish`: any live request can be ended (stop string, abort); its blocks go back to the pool.

A request whose prompt KV is computed elsewhere (`remote_prefill`, decode role) is admitted by
reservation instead: blocks for the whole prompt (minus prefix-cache hits) plus headroom for
generation -> WAITING_FOR_KV, and `hooks.on_reserved` leases them out. `kv_landed` then makes it
RUNNING with its first token; `kv_failed` sends it back to waiting to be computed here.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus, next_waiting
from pdserve.engine.role import RoleHooks
from pdserve.engine.spec.budget import DraftBudget
from pdserve.engine.spec.ngram import NgramProposer
from pdserve.engine.spec.drafting import propose_drafts
from pdserve.engine.step import SchedulerOutput
from pdserve.outputs import TokenLogprobs

if TYPE_CHECKING:  # the simulator runs the scheduler without torch
    from pdserve.engine.durable_kv import DurableKV


MAX_DRAFT_PAUSE = 64  # steps, at most, a request decodes without proposing after drafts that missed


# where the KV a request starts from came from: computed here, this worker's prefix cache, its
# host or disk tier, another worker (a prefill worker's lease), or its pool kept through a restart
TOKEN_SOURCES = ("computed", "prefix_cache", "host", "disk", "store", "transferred", "resumed")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        eos_token_ids: tuple[int, ...] = (),
        hooks: RoleHooks | None = None,
        headroom_tokens: int = 0,
        shortest_first_max_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        proposer: NgramProposer | None = None,  # or any proposer (`engine/spec/proposers.py`)
    ) -> None:
        self.blocks = block_manager
        self.clock = clock  # the clock of requests' arrival_time; tests stop it
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.hooks = hooks or RoleHooks()
        self.headroom_tokens = headroom_tokens  # generation room a KV reservation must leave
        self.max_wait_s = shortest_first_max_wait_s  # None: first come, first served
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key; the last is preempted first
        self.waiting_for_kv: dict[str, Request] = {}  # reserved, prompt KV arriving from elsewhere
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_prefill_pauses = 0  # steps a running prompt sat out for a more urgent one, since start
        self.proposer = proposer  # speculative decoding (engine/spec/); None: off
        self.draft_budget = DraftBudget() if proposer is not None else None
        self.num_drafts = 0  # drafts verified (one a request a step), since start
        self.num_drafted = 0  # draft tokens verified, since start
        self.num_accepted = 0  # of those, kept
        # the tokens whose KV requests started from, by where it came from (the worker's
        # pdserve_prompt_tokens_by_source_total), since start
        self.tokens_by_source = dict.fromkeys(TOKEN_SOURCES, 0)
        self.durable: DurableKV | None = None  # a pool that outlives the worker: what it kept (`durable_kv.py`)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    @property
    def num_live(self) -> int:
        """Requests holding blocks for their whole prompt: running or awaiting their KV."""
        return len(self.running) + len(self.waiting_for_kv)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: of waiting requests, and of running ones mid-prefill."""
        left = (r.num_tokens - r.num_computed_tokens for r in self.waiting)
        mid = (n for r in self.running if (n := r.num_tokens - r.num_computed_tokens) > 1)
        return sum(left) + sum(mid)

    def add(self, request: Request) -> None:
        assert request.status == RequestStatus.WAITING
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)
        self.blocks.prefetch(request)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        i = 0
        if self.proposer is not None:
            propose_drafts(self.running, self.proposer, self.draft_budget)
        urgent = self._urgent_priority(budget)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if urgent is not None and req.priority > urgent and req.num_tokens - req.num_computed_tokens > 1:
                # a less urgent prompt pauses at this chunk boundary, keeping what it computed
                self.num_prefill_pauses += 1
                i += 1
                continue
            if req.draft:
                req.draft = req.draft[: budget - 1]
            n = min(req.num_tokens - req.num_computed_tokens + len(req.draft), budget)
            if self._allocate_or_preempt(req, n, out):
                scheduled.append((req, n))
                budget -= n
                i += 1
        for req in self.running[i:]:  # not reached this step: its draft waits for no one
            req.draft = []
        if not out.preempted:
            budget = self._admit_waiting(budget, scheduled)
        # a request verifying a draft decodes too: a row for its last token and one for each draft
        decodes = [(r, n) for r, n in scheduled if n == 1 or r.draft]
        chunks = [(r, n) for r, n in scheduled if n != 1 and not r.draft]
        for req, n in decodes + chunks:
            out.requests.append(req)
            out.num_new_tokens.append(n)
            out.block_tables.append(self.blocks.block_table(req.request_id))
        out.num_decodes = len(decodes)
        return out

    def _urgent_priority(self, budget: int) -> int | None:
        """The priority of the waiting request that running prompts of a less urgent one make way
        for (they pause between chunks, their KV kept, and go on once it is in): the most urgent
        waiting one, where it could be admitted now (room for another request, and blocks for
        its first chunk: a paused prompt must never hold what the waiting one waits for)."""
        if not self.waiting or self.num_live >= self.max_num_seqs:
            return None
        req = self.waiting[0]
        if not any(r.priority > req.priority and r.num_tokens - r.num_computed_tokens > 1 for r in self.running):
            return None
        # a reservation takes its whole prompt and headroom at once; a prompt computed here, a chunk
        first = self._reservation_blocks(req) if req.remote_prefill else self.blocks.blocks_needed(
            min(req.num_tokens, budget))
        if first > self.blocks.num_free_blocks:
            return None
        return req.priority

    def _reservation_blocks(self, req: Request) -> int:
        """Blocks a reservation takes: the prompt's and the headroom's, at most the whole pool (a
        prompt that fits it alone must not wait for room that can never come, holding up the queue)."""
        return min(self.blocks.blocks_needed(req.num_tokens + self.headroom_tokens), self.blocks.num_blocks)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step's rows and seconds, which price the rows drafts add."""
        if self.draft_budget is not None:
            self.draft_budget.costs.observe(rows, seconds)

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.blocks.allocate(req, n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        now = self.clock()
        while self.waiting and budget > 0 and self.num_live < self.max_num_seqs:
            i = next_waiting(self.waiting, self.max_wait_s, now)
            req = self.waiting[i]
            if req.remote_prefill:
                if not self._reserve(req):
                    break
                self.waiting.pop(i)
                continue
            resumed = self.durable.claim(req, budget) if req.resume_of is not None and self.durable else 0
            if resumed is None:
                break
            if resumed:
                num_cached = resumed
                self._count_sources(0, 0, {}, resumed=resumed, computed=req.num_tokens - resumed)
            else:
                cached, slots, below = self.blocks.find_prefix(req)
                num_cached = (len(cached) + len(slots)) * self.blocks.block_size
                if not self.blocks.allocate(req, len(slots) * self.blocks.block_size
                                            + min(req.num_tokens - num_cached, budget), cached):
                    break
                self.blocks.promote(req, len(cached), slots)
                self._count_sources(len(cached), len(slots), below, computed=req.num_tokens - num_cached)
            n = min(req.num_tokens - num_cached, budget)
            self.waiting.pop(i)
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            bisect.insort(self.running, req, key=Request.sort_key)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _count_sources(self, pool_blocks: int, tier_blocks: int, below: dict[str, int], **more: int) -> None:
        """A request starts from its KV: its prefix hits' blocks (in the pool, the host tier, or
        read from below it), and `more` tokens (computed here, or transferred)."""
        by_source, bs = self.tokens_by_source, self.blocks.block_size
        by_source["prefix_cache"] += pool_blocks * bs
        by_source["host"] += (tier_blocks - sum(below.values())) * bs
        for tier, blocks in below.items():
            by_source[tier] += blocks * bs
        for source, n in more.items():
            by_source[source] += n

    def _reserve(self, req: Request) -> bool:
        assert req.status == RequestStatus.WAITING
        cached, slots, below = self.blocks.find_prefix(req)
        bs = self.blocks.block_size
        num_cached = (len(cached) + len(slots)) * bs
        needed = self._reservation_blocks(req) - len(cached)
        if needed > self.blocks.num_free_blocks:
            return False
        if not self.blocks.allocate(req, req.num_tokens - len(cached) * bs, cached):
            return False
        self.blocks.promote(req, len(cached), slots)
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        self._count_sources(len(cached), len(slots), below)  # what it lacks comes at landing
        req.status = RequestStatus.WAITING_FOR_KV
        req.first_scheduled_time = self.clock()
        self.waiting_for_kv[req.request_id] = req
        self.hooks.on_reserved(req)
        return True

    def kv_landed(self, request_id: str, first_token: int, prefill_times: tuple[float, float] = (0.0, 0.0),
                  first_logprobs: TokenLogprobs | None = None,
                  prompt_logprobs: list[TokenLogprobs | None] | None = None) -> Request | None:
        """The prompt's KV is in the reserved blocks and the first token was sampled elsewhere
        (with its log-probabilities, and the prompt's, where the request asks for them: ValueError
        if they are missing or are not the prompt's).

        Returns the request, now RUNNING (or finished, if that token ends it); None if it is gone.
        """
        req = self.waiting_for_kv.get(request_id)
        if req is None:
            return None
        req.check_landed(first_token, first_logprobs, prompt_logprobs)
        del self.waiting_for_kv[request_id]
        assert req.status == RequestStatus.WAITING_FOR_KV
        req.remote_prefill = False  # from now on its KV is computed here (after a preemption too)
        self.tokens_by_source["transferred"] += req.num_tokens - req.num_cached_tokens
        req.num_computed_tokens = req.num_tokens  # prompt and any resumed output
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=Request.sort_key)
        self.blocks.cache_full_blocks(req, computed=False)  # its prefill worker shared what it computed
        req.output_token_ids.append(first_token)
        if req.params.logprobs is not None:
            req.output_logprobs.append(first_logprobs)
        if req.prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        if req.matcher is not None:
            req.matcher.consume(first_token)
        req.kv_landed_time = req.first_token_time = self.clock()
        req.remote_queue_s, req.remote_compute_s = prefill_times
        status = req.stop_status(first_token, self.eos_token_ids)
        if status is not None:
            self.finish(request_id, status)
        return req

    def kv_failed(self, request_id: str) -> None:
        """The prompt's KV will not arrive: compute it here instead (the colocated path).

        The caller has already handed over any blocks a peer might still write into.
        """
        req = self.waiting_for_kv.pop(request_id, None)
        if req is None:
            return
        assert req.status == RequestStatus.WAITING_FOR_KV
        self.blocks.free(req)
        req.remote_prefill = False
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def _preempt(self, req: Request) -> None:
        assert req.status == RequestStatus.RUNNING
        self.running.remove(req)
        req.draft = []
        self.blocks.free(req)
        if self.proposer is not None:
            self.proposer.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Ahead of later arrivals of its priority: it came first.
        bisect.insort(self.waiting, req, key=Request.sort_key)

    # -- after the model ran -------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Apply a step's results; returns the requests that got a new token."""
        advanced = []
        for req, n, token in zip(out.requests, out.num_new_tokens, sampled):
            if req.draft:  # the drafts the model sampled, then its own token
                draft, req.draft = req.draft, []
                if req.status == RequestStatus.RUNNING and token is not None:
                    self._take_verified(req, draft, token)
                    advanced.append(req)
                req.pending_logprobs = []
                continue
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            self.blocks.cache_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            assert token is not None
            self._take(req, token, 0)
            req.pending_logprobs = []
            advanced.append(req)
        return advanced

    def _take(self, req: Request, token: int, i: int) -> bool:
        """Append the step's i-th new token of the request (with its log-probabilities, where it
        asked for them); True if the request stops there."""
        req.output_token_ids.append(token)
        if req.pending_logprobs:
            req.output_logprobs.append(req.pending_logprobs[i])
        if req.matcher is not None:
            req.matcher.consume(token)
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        status = req.stop_status(token, self.eos_token_ids)
        if status is not None:
            self.finish(req.request_id, status)
        return status is not None

    def _take_verified(self, req: Request, draft: list[int], tokens: list[int]) -> None:
        """A verified draft's new tokens (`spec.verify.verified`), one at a time as decoding would
        have taken them (a stop ends it there); only the KV of the last token and the drafts kept
        counts as computed."""
        self.num_drafts += 1
        self.draft_budget.verified(req.acceptance, len(tokens) - 1, len(draft))
        self.num_drafted += len(draft)
        self.num_accepted += len(tokens) - 1
        # a verifying step costs more than a plain one: a request whose drafts keep missing waits
        # twice as long each time (up to MAX_DRAFT_PAUSE steps) before it proposes again
        req.draft_misses = 0 if len(tokens) > 1 else min(req.draft_misses + 1, MAX_DRAFT_PAUSE.bit_length())
        req.draft_pause = min(MAX_DRAFT_PAUSE, (1 << req.draft_misses) - 1)
        for i, token in enumerate(tokens):
            if self._take(req, token, i):
                return
        req.num_computed_tokens += len(tokens)  # all but the newest token, as after any decode step
        self.blocks.cache_full_blocks(req)

    def restate_finish(self, req: Request, status: RequestStatus) -> None:
        """A finished request's reason, corrected: a stop string found in its text ended it at an
        earlier token of its last step than the one it finished at."""
        assert req.status.finished and status.finished
        req.status = status

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a live request (idempotent: an unknown or finished id is ignored)."""
        assert status.finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[request_id]
        else:
            self.waiting.remove(req)
        req.status = status
        req.finished_time = self.clock()
        self.hooks.on_finished(req)
        if self.proposer is not None:
            self.proposer.release(req)
            if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.proposer.finished(req)
        self.blocks.free(req)
        return req
