"""Where a decode batch's products turn dense, settled by timing whole decode steps at warm-up.

The load-time calibration (`layers.quant.calibrate`) times one product at a time. But a decode
step whose products all run on pdserve's quantized kernels runs as one kernel call
(`models.native_decode`), which also saves the framework's cost around the norms, rotary and
attention of every layer: no product's timing sees that. On a 2-vCPU Xeon with AMX the calibration
put the dense products at 8 rows, yet decode steps on AMX tiles in one call were 10-12% faster from
8 to 32 rows (16 rows: 37 against 41 ms). So where both are possible the engine times decode steps
of each kind, taking turns, at the calibrated count and at each doubling up to 64 rows, and the
dense products start at the first count where their steps are faster. The same holds for products
on panels (AVX2 or VNNI, without AMX).
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine")

TIMED_STEPS = 3  # of each kind, taking turns; the fastest of each counts
MAX_TILE_ROWS = 64  # the rows one expansion of a weight serves on AMX tiles
_PROMPT_TOKENS = 16


def settle_dense_rows(engine) -> None:
    """Move the dense products' row threshold up to where whole decode steps say it belongs. The
    engine must be idle (it runs requests of its own and leaves none)."""
    stack = engine.runner.model.decode_stack()
    if stack is None or engine.runner.kernels is None:
        return
    dense = stack.dense
    if dense.min_rows is None:
        return
    if dense.tile_rows is not None and engine.dtype == torch.bfloat16:
        batch_rows, on = dense.tile_rows, "AMX tiles"
    elif dense.panel_rows is not None:
        batch_rows, on = dense.panel_rows, "panels"
    else:
        return
    limit = min(MAX_TILE_ROWS, engine.config.max_num_seqs)
    calibrated, rows = dense.min_rows, max(dense.min_rows, batch_rows)
    while rows <= limit:
        dense_s, tiles_s = _decode_seconds(engine, dense, rows, calibrated)
        log.info("decode steps of %d rows: %.1f ms with dense products, %.1f ms in one call on %s",
                 rows, dense_s * 1e3, tiles_s * 1e3, on)
        if dense_s <= tiles_s:
            break
        rows *= 2
    dense.min_rows = max(calibrated, min(rows, limit + 1))  # only ever later than calibrated, by a timing
    if dense.min_rows != calibrated:
        log.info("quantized weights: products of %d rows or more run dense (calibrated: %d)", dense.min_rows,
                 calibrated)


def _decode_seconds(engine, dense, rows: int, calibrated: int) -> tuple[float, float]:
    """The fastest decode step of `rows` requests with dense products from `calibrated` rows, and
    with none below `rows + 1` (on tiles, in one call), taking turns."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=2 * TIMED_STEPS + 3, temperature=0.0, ignore_eos=True)
    for r in range(rows):
        engine.add_request(None, {"prompt_token_ids": [1 + (r * _PROMPT_TOKENS + j) % (vocab - 1)
                                                       for j in range(_PROMPT_TOKENS)]}, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(not r.output_token_ids for r in scheduler.running):
        engine.step()  # the prompts, and any decode the budget mixes in
    times: dict[int, float] = {calibrated: float("inf"), rows + 1: float("inf")}
    try:
        for _ in range(TIMED_STEPS):
            for threshold in times:
                dense.min_rows = threshold
                start = time.perf_counter()
                engine.step()
                times[threshold] = min(times[threshold], time.perf_counter() - start)
    finally:
        dense.min_rows = calibrated
    while engine.has_unfinished_requests():
        engine.step()
    return times[calibrated], times[rows + 1]
