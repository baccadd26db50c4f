"""Running a step so that a request that breaks it fails alone.

A step computes a batch of requests at once, so an exception from it says nothing of which request
caused it. When a step of several requests raises, each is run again on its own (the KV of
positions not yet counted as computed is simply written again, and seeded generators are rewound
first), and only the requests that still fail are reported, with their exceptions. Their batch
mates go on as if nothing had happened.
"""

from __future__ import annotations

import logging
from typing import Callable

from pdserve.engine.parallel.lost import RanksLost
from pdserve.engine.step import SchedulerOutput

log = logging.getLogger("pdserve.engine")

StepRun = Callable[[SchedulerOutput], list[int | None]]


def run_isolating(step: SchedulerOutput, run: StepRun) -> tuple[list[int | None], dict[str, Exception]]:
    """The step's sampled tokens, and the requests (by id) that failed, with their exception."""
    seeded = {r.request_id: r.generator.get_state() for r in step.requests if r.generator is not None}
    try:
        return run(step), {}
    except RanksLost:  # no request's fault: the worker cannot compute any step
        raise
    except Exception as e:
        if len(step.requests) == 1:
            log.exception("a step failed on request %s", step.requests[0].request_id)
            return [None], {step.requests[0].request_id: e}
        log.warning("a step of %d requests failed (%s: %s); running them one at a time to find the cause",
                    len(step.requests), type(e).__name__, e)
    sampled: list[int | None] = []
    failed: dict[str, Exception] = {}
    for i, req in enumerate(step.requests):
        if req.generator is not None:  # the failed attempt may have drawn from it
            req.generator.set_state(seeded[req.request_id])
        try:
            sampled.append(run(single(step, i))[0])
        except Exception as e:
            log.exception("request %s fails a step on its own", req.request_id)
            failed[req.request_id] = e
            sampled.append(None)
    return sampled, failed


def single(step: SchedulerOutput, i: int) -> SchedulerOutput:
    """Row i of a step as a step of its own."""
    return SchedulerOutput(requests=[step.requests[i]], num_new_tokens=[step.num_new_tokens[i]],
                           num_decodes=int(i < step.num_decodes), block_tables=[step.block_tables[i]])

