"""Contenders timed in turns: each warmed up once, then each run in turn on every later input, so
that a neighbour's burst of load on a shared machine hits every side alike, not one whole side."""

from __future__ import annotations

from typing import Any, Callable


def best_in_turns(inputs: list, contenders: dict[str, Callable[[Any], float]]) -> dict[str, float]:
    """The best seconds of each contender (`run(x)` returns the seconds it took on `x`): all warmed
    up on inputs[0], then timed in turn on every later input."""
    for run in contenders.values():
        run(inputs[0])
    best = dict.fromkeys(contenders, float("inf"))
    for x in inputs[1:]:
        for name, run in contenders.items():
            best[name] = min(best[name], run(x))
    return best
