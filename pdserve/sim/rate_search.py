"""The highest rate that passes a test, to within a tolerance, in as few tests as it can.

A capacity search (plan.py) asks "does one instance meet the SLA at r requests/s?" of simulated
runs that cost a second or more each; the answer is yes below the capacity and no above it. The
search knows nothing else of the test, so it is a pure function of it, tested on its own:

1. Start from a guess. Without a better one it is an optimistic bound (a perfectly batched
   instance), and the search halves down from it and doubles up past it.
2. A guess from a neighbouring answer (the same instance with another batch limit, or another
   tensor parallelism scaled by the roofline) is usually within a few tens of percent: the
   search then steps away from it by a factor that starts at the tolerance and squares with every
   step in the same direction, so an exact guess costs two tests and a poor one a few more.
3. Once a passing rate `lo` and a failing rate `hi` bracket the answer, it bisects (geometrically:
   rates span orders of magnitude) until hi / lo <= 1 + tolerance, and returns lo.

A rate the test fails however low (below `floor`) gives 0. Above `ceiling` times the first
guess, the test is taken to have no upper limit worth finding, and the last rate that passed is
returned.
"""

from __future__ import annotations

import math
from typing import Callable


def highest_passing_rate(passes: Callable[[float], bool], guess: float, tolerance: float = 0.05,
                         informed: bool = False, floor: float = 1e-6, ceiling: float = 4096.0) -> float:
    """The highest rate at which `passes` holds, within `tolerance` (relative); 0 if none above
    `floor`. `informed`: the guess comes from a neighbouring answer, not an optimistic bound."""
    if guess <= 0 or tolerance <= 0:
        raise ValueError("the guess and the tolerance must be positive")
    lo, hi = 0.0, math.inf
    step = (1 + tolerance) if informed else 2.0
    x = guess
    while True:
        if passes(x):
            lo = x
        else:
            hi = x
        if lo and hi < math.inf:
            break
        if hi == math.inf:  # nothing failed yet: step up
            if lo >= guess * ceiling:
                return lo
            x = lo * step
        else:  # nothing passed yet: step down
            if hi <= floor:
                return 0.0
            x = hi / step
        step = step * step if informed else 2.0
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo
