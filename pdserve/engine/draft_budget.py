"""How many of its drafted tokens each request verifies at a step: those expected to pay for the
rows they add.

A verified draft token is one more row in the step, and every request of the batch waits for the
whole step. A step of `rows` decode rows that gives `tokens` tokens in `t(rows)` seconds gains by
one more row whose token is kept with probability `g` when `(tokens + g) / t(rows + 1)` beats
`tokens / t(rows)`, that is when `g * t > tokens * dt` (`dt`: the row's cost). So the rows go, most
likely first, to the draft tokens whose chance of being kept passes that bar, and the bar rises
with the batch: one stream verifies long drafts on a CPU where a row is nearly free, a full batch
verifies none unless its drafts are nearly sure.

- `t(rows)` is measured, not assumed: the engine reports every decode-only step's seconds and rows
  (`StepCosts`), and a line is fitted to the moving averages of the row counts around the step's.
  Until two counts there are measured, every draft is verified (which measures them).
- The chance that a request's j-th draft token is kept is `rate ** j` (each kept with `rate`, after
  all before it were), `rate` estimated from the request's recent drafts, drawn toward the
  engine's recent rate while the request has little history of its own (`Acceptance`).
- A request whose drafts missed waits before it proposes again (the scheduler's backoff); when it
  does, or before it has any history, its first draft token is verified whatever the bar says: a
  probe, so that a request whose output turns repetitive is found out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

REQUEST_MEMORY = 0.75  # how much of a request's acceptance history each new draft keeps
ENGINE_MEMORY = 0.98  # the engine's, over all requests' drafts
PRIOR_DRAFTS = 2.0  # a request's rate counts the engine's as this many drafts of its own
FIRST_RATE = 0.5  # the engine's rate before any draft was verified
COST_MEMORY = 0.2  # weight of a new step's seconds in its row count's moving average


@dataclass(slots=True)
class Acceptance:
    """Decayed counts of draft tokens kept and of draft tokens tried (kept, plus the one that
    missed, if one did), whose ratio estimates the chance that a draft token is kept."""

    kept: float = 0.0
    tried: float = 0.0

    def add(self, kept: int, drafted: int, memory: float) -> None:
        self.kept = self.kept * memory + kept
        self.tried = self.tried * memory + kept + (kept < drafted)

    def rate(self, prior: float, weight: float) -> float:
        return (self.kept + weight * prior) / (self.tried + weight)


class StepCosts:
    """Decode-only steps' seconds, as moving averages by their number of rows."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + COST_MEMORY * (seconds - old)

    def line(self, rows: int, span: int) -> tuple[float, float] | None:
        """(seconds at `rows`, seconds a row more costs) from a least-squares line through the
        averages of `rows` to `rows + span` rows; None while fewer than two of those counts were seen."""
        points = [(r, t) for r, t in self.seconds.items() if rows <= r <= rows + span]
        if len(points) < 2:
            return None
        n = len(points)
        mean_r = sum(r for r, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        spread = sum((r - mean_r) ** 2 for r, _ in points)
        slope = max(0.0, sum((r - mean_r) * (t - mean_t) for r, t in points) / spread)
        return max(mean_t + slope * (rows - mean_r), 1e-9), slope


class DraftBudget:
    """The engine's acceptance and step costs, and the cut of each step's drafts they imply."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens  # a draft's length at most
        self.costs = StepCosts()
        self.engine = Acceptance()

    def rate(self, acceptance: Acceptance) -> float:
        return acceptance.rate(self.engine.rate(FIRST_RATE, PRIOR_DRAFTS), PRIOR_DRAFTS)

    def cut(self, drafts: list[tuple[list[int], Acceptance, bool]], rows: int) -> list[int]:
        """How many tokens of each draft to verify: (draft, its request's acceptance, whether its
        first token is a probe) for each request that drafted, in a step of `rows` decode rows
        without drafts."""
        keep = [1 if probe else 0 for _, _, probe in drafts]
        line = self.costs.line(rows, 2 * self.max_tokens)
        if line is None:  # nothing measured around here yet: verifying them all measures it
            return [len(d) for d, _, _ in drafts]
        seconds, per_row = line
        rates = [self.rate(a) for _, a, _ in drafts]
        tokens = rows + sum(rates[i] for i, k in enumerate(keep) if k)
        seconds += per_row * sum(keep)
        # the next token of each draft, most likely kept first: its chance is rate ** (its position)
        heap = [(-(rates[i] ** (keep[i] + 1)), i) for i, (d, _, _) in enumerate(drafts) if keep[i] < len(d)]
        heapq.heapify(heap)
        while heap:
            chance, i = heapq.heappop(heap)
            if -chance * seconds <= tokens * per_row:
                break  # no later token is more likely
            keep[i] += 1
            tokens -= chance
            seconds += per_row
            if keep[i] < len(drafts[i][0]):
                heapq.heappush(heap, (-(rates[i] ** (keep[i] + 1)), i))
        return keep

    def verified(self, acceptance: Acceptance, kept: int, drafted: int) -> None:
        acceptance.add(kept, drafted, REQUEST_MEMORY)
        self.engine.add(kept, drafted, ENGINE_MEMORY)
