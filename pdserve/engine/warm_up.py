"""What an engine runs before it serves, so that no request waits for it.

1. One prompt of a full step's tokens and one block more (a chunk alone, then one after a cached
   prefix) through the model, its output dropped: the first steps of those shapes set up the math
   library's kernels (seconds on some CPUs).
2. The matmuls at every row count they pad to (`linear.warm_up`), whose kernels oneDNN builds one
   count at a time.
3. Where a decode batch may run its products either way, decode steps timed to settle where they
   turn dense (`decode_products`); not on a prefill worker, which never decodes.

The engine's role hooks see none of these requests.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from pdserve.engine.decode_products import settle_dense_rows
from pdserve.engine.role import RoleHooks
from pdserve.layers.linear import warm_up as warm_up_products
from pdserve.sampling_params import SamplingParams


def warm_up(engine) -> float:
    """Steps 1-3 above on an idle `engine` (RuntimeError if it is not). Returns the seconds."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    t0 = time.perf_counter()
    config = engine.config
    room = (engine.block_manager.num_free_blocks - 1) * config.block_size
    n = min(config.max_num_batched_tokens + config.block_size, engine.max_model_len - 1, room)
    if n < 1:
        return 0.0
    vocab = engine.model_config.vocab_size
    with _without_role_hooks(engine), _without_speculation(engine):
        engine.add_request(None, {"prompt_token_ids": [1 + i % (vocab - 1) for i in range(n)]},
                           SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        if engine.num_failed:
            raise RuntimeError("the warm-up prompt failed: see the log")
    with torch.inference_mode():
        warm_up_products(engine.runner.model.products(config.max_num_batched_tokens, config.max_num_seqs),
                         engine.dtype)
    if config.role != "prefill":
        with _without_role_hooks(engine), _without_speculation(engine):
            settle_dense_rows(engine)
    sched = engine.scheduler
    sched.tokens_by_source = dict.fromkeys(sched.tokens_by_source, 0)  # its requests are none of the worker's
    return time.perf_counter() - t0


@contextlib.contextmanager
def _without_speculation(engine) -> Iterator[None]:
    """The warm-up times plain steps: its greedy requests would otherwise verify drafts."""
    proposer, engine.scheduler.proposer = engine.scheduler.proposer, None
    try:
        yield
    finally:
        engine.scheduler.proposer = proposer


@contextlib.contextmanager
def _without_role_hooks(engine) -> Iterator[None]:
    """A role's hooks see requests, and the warm-up's are none."""
    hooks = engine.hooks
    engine.hooks = engine.scheduler.hooks = RoleHooks()
    try:
        yield
    finally:
        engine.hooks = engine.scheduler.hooks = hooks
