"""A step as rank 0 tells the other ranks of its worker: what `ModelRunner` prepares a step's
tensors from, as one list of integers, and back as a step the runner takes.

Per request: its computed tokens, its new tokens' count and ids, its known tokens, its draft's
length, and the blocks of its table the step reads. The other ranks have no requests of their own:
`PlannedRequest` answers what the runner asks of one.
"""

from __future__ import annotations

from pdserve.engine.step import SchedulerOutput

_ROW = 5  # start, new tokens, known tokens, draft length, blocks


def step_plan(step: SchedulerOutput, block_size: int) -> list[int]:
    plan = [len(step.requests), step.num_decodes]
    for req, n, table in zip(step.requests, step.num_new_tokens, step.block_tables):
        start = req.num_computed_tokens
        blocks = -(-(start + n) // block_size)
        plan += [start, n, req.num_tokens, len(req.draft or ()), blocks]
        plan += req.token_ids(start, start + n)
        plan += table[:blocks]
    return plan


class PlannedRequest:
    __slots__ = ("num_computed_tokens", "num_tokens", "draft", "_ids")
    prompt_logprobs = None  # asked of rank 0's requests only

    def __init__(self, start: int, known: int, draft_len: int, ids: list[int]) -> None:
        self.num_computed_tokens, self.num_tokens, self._ids = start, known, ids
        self.draft = [0] * draft_len  # only its length matters to the runner

    def token_ids(self, start: int, end: int) -> list[int]:
        at = self.num_computed_tokens
        return self._ids[start - at : end - at]


def planned_step(plan: list[int]) -> SchedulerOutput:
    rows, num_decodes = plan[0], plan[1]
    step = SchedulerOutput(num_decodes=num_decodes)
    at = 2
    for _ in range(rows):
        start, n, known, draft_len, blocks = plan[at : at + _ROW]
        at += _ROW
        step.requests.append(PlannedRequest(start, known, draft_len, plan[at : at + n]))
        step.num_new_tokens.append(n)
        at += n
        step.block_tables.append(plan[at : at + blocks])
        at += blocks
    return step
