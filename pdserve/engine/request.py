"""A request inside the engine, and its ordered status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pdserve.engine.spec.budget import Acceptance
from pdserve.outputs import TokenLogprobs
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.engine.structured import Matcher


class RequestStatus(enum.IntEnum):
    # Live states first; every finished state compares greater than RUNNING.
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # decode role: blocks reserved, prompt KV not yet landed
    PREEMPTED = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token state of one sequence. The scheduler owns `status`; nobody else assigns it."""

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "params", "priority",
        "arrival_time", "status", "num_computed_tokens", "num_cached_tokens", "block_hashes",
        "generator", "max_total_tokens", "stop_reason", "num_preemptions", "remote_prefill",
        "first_scheduled_time", "kv_landed_time", "first_token_time", "finished_time",
        "remote_queue_s", "remote_compute_s", "output_logprobs", "pending_logprobs", "prompt_logprobs",
        "matcher", "draft", "draft_misses", "draft_pause", "acceptance", "head_feature", "resume_of",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        priority: int = 0,
        arrival_time: float | None = None,
        remote_prefill: bool = False,
        output_token_ids: list[int] = (),
        resume_of: str | None = None,
    ) -> None:
        self.request_id = request_id
        # its id on this worker before a crash: its KV may have outlived it (`engine/durable_kv.py`)
        self.resume_of = resume_of
        self.prompt_token_ids = list(prompt_token_ids)
        # tokens generated so far: empty, or what another worker generated before this one resumes
        self.output_token_ids: list[int] = list(output_token_ids)
        # with params.logprobs: one entry per token sampled here (a resumed request's earlier tokens
        # have theirs where they were sampled); the runner leaves a step's in `pending_logprobs`
        # (one a new token), and the scheduler moves them here with the tokens
        self.output_logprobs: list[TokenLogprobs] = []
        self.pending_logprobs: list[TokenLogprobs] = []
        # with params.prompt_logprobs: position i's entry once the runner computed the prompt there
        self.matcher: Matcher | None = None  # with params.structure: where its output is in it
        self.draft: list[int] = []  # tokens proposed to follow, verified by the step they are scheduled in
        self.draft_misses = 0  # drafts in a row of which the model kept none
        self.draft_pause = 0  # steps to decode without drafts before proposing again
        # a draft head's feature at the request's last token (`models/draft_head.py`): its next drafts start here
        self.head_feature: torch.Tensor | None = None
        self.acceptance = Acceptance()  # how often its draft tokens were kept, lately (`engine/spec/budget.py`)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in this request's blocks
        self.num_cached_tokens = 0  # of those, found in the prefix cache (or a KV tier) at admission
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, filled lazily
        self.max_total_tokens = max_total_tokens  # prompt + output cap (model length, max_tokens)
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.remote_prefill = remote_prefill  # decode role: the prompt's KV comes from a prefill worker
        # when things happened (time.monotonic), for the per-phase times of metrics
        self.first_scheduled_time: float | None = None  # admitted (or its KV reserved) first
        self.kv_landed_time: float | None = None
        self.remote_queue_s = 0.0  # queued on the prefill worker that sent the KV
        self.remote_compute_s = 0.0  # computing there
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            import torch  # here, so that the simulator, which never samples, runs without it

            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (and past them, the draft), without concatenating
        the whole sequence."""
        known = self.num_tokens
        if end > known:
            return self.token_ids(min(start, known), known) + self.draft[max(0, start - known) : end - known]
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def phase_times(self) -> dict[str, float]:
        """Seconds spent queued (here, and on a prefill worker), computing the prompt (here or
        there), transferring its KV (what of the wait for it was not the prefill worker's queue or
        compute: the hand-off and the transfer's tail), and decoding."""
        t0 = self.arrival_time
        scheduled = self.first_scheduled_time or t0
        first = self.first_token_time or scheduled
        end = self.finished_time or first
        queue, prefill, transfer = max(0.0, scheduled - t0), max(0.0, first - scheduled), 0.0
        if self.kv_landed_time is not None:  # the prompt's KV came from a prefill worker
            waited = max(0.0, self.kv_landed_time - scheduled)
            remote_queue = min(self.remote_queue_s, waited)
            prefill = min(self.remote_compute_s, waited - remote_queue)
            queue += remote_queue
            transfer = waited - remote_queue - prefill
        return {"queue_s": queue, "prefill_s": prefill, "transfer_s": transfer, "decode_s": max(0.0, end - first)}

    def stop_status(self, token: int, eos_token_ids: frozenset[int] | set[int]) -> RequestStatus | None:
        """Whether the request ends at its newest token, `token`, and why (None: it goes on)."""
        params = self.params
        if self.matcher is not None and self.matcher.done:  # the structure is complete: nothing may follow
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token in eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_landed(self, first_token: int, first_logprobs: TokenLogprobs | None,
                     prompt_logprobs: list[TokenLogprobs | None] | None) -> None:
        """ValueError unless a first token sampled elsewhere brings what this request asks for."""
        if self.params.logprobs is not None and first_logprobs is None:
            raise ValueError("the first token came without the log-probabilities the request asks for")
        if self.prompt_logprobs is not None:
            if prompt_logprobs is None or [e and e.token_id for e in prompt_logprobs] != [
                    None, *self.prompt_token_ids[1:]]:
                raise ValueError("the first token came without the prompt's log-probabilities the request asks for")
        if self.matcher is not None and not self.matcher.allows(first_token):
            raise ValueError(f"the first token ({first_token}) is outside the request's structure")

    def sort_key(self) -> tuple[int, float]:
        """Lower priority value first, then first come, first served."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )


def next_waiting(waiting: list[Request], max_wait_s: float | None, now: float) -> int:
    """Index of the waiting request to admit next (`waiting` in the scheduler's order: priority,
    then arrival). First come, first served within a priority; or (`max_wait_s` given) the shortest
    prompt (with any output so far), unless one has waited `max_wait_s` (or was preempted, holding
    progress): then the earliest of those goes first."""
    if max_wait_s is None:
        return 0
    top = waiting[0].priority
    best, best_key = 0, None
    for i, req in enumerate(waiting):
        if req.priority != top:
            break
        if req.status == RequestStatus.PREEMPTED or now - req.arrival_time >= max_wait_s:
            return i  # the list is in arrival order within a priority: the earliest overdue one
        key = (req.num_tokens, req.arrival_time)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best
