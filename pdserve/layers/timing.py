"""Timing a choice between kernels at load: the best of a few runs after one that warms it up."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls of `run`, after one untimed (it builds kernels, fills
    caches): the least disturbed measure on a shared machine."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
