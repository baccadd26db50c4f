"""How many of its drafted tokens each request verifies at a step: as many as make the step give
the most tokens a second.

A verified draft token is one more row in the step, and every request of the batch waits for the
whole step. A step of `rows` decode rows gives `rows` tokens, plus each draft token's chance of
being kept, in `t(rows + draft rows)` seconds. The draft tokens are taken most likely first, and the
step verifies the number of them that gives the most tokens per second: one stream verifies long
drafts on a CPU where a row is nearly free, a full batch verifies none unless its drafts are nearly
sure, and a row count whose step costs a jump more (a new block of tile rows) is avoided.

- `t` is measured, not assumed: the engine reports every decode-only step's seconds and rows
  (`StepCosts`, moving averages by row count), read between measured counts on the line joining
  them and past the last on the last two's slope. Before anything is measured every draft is
  verified (which measures it), and a count not yet measured costs no more than the line says
  until it is.
- The chance that a request's j-th draft token is kept is `rate ** j` (each kept with `rate`, after
  all before it were), `rate` estimated from the request's recent drafts, drawn toward the
  engine's recent rate while the request has little history of its own (`Acceptance`).
- A request whose drafts missed waits before it proposes again (the scheduler's backoff); when it
  does, or before it has any history, its draft is a probe: priced at the engine's recent rate
  rather than its own (which its misses made low), so that a request whose output turns
  repetitive is found out where drafts are being kept, and verified only where that pays for its
  rows. At a batch where one more row costs a jump (a new tile of rows: measured on an AMD EPYC,
  8 rows 8.1 ms, 9 rows 10.0 ms) a probe that verified its first token whatever it cost made
  open-ended chat at 8 streams 0.92-0.95x of no speculation; one priced as if all of it would
  be kept, 0.81-0.86x.
- A proposer whose drafts cost time of their own (a draft model: a step of it for every draft
  token, all drafting requests at once) is asked for as many tokens ahead as make the step and
  its drafting give the most tokens a second (`lead`), priced by its measured seconds a token and
  the engine's acceptance: none where its tokens cost more than they give, then one token after
  `PROBE_EVERY` steps, so that the estimates follow the traffic, and after twice as many each
  time the answer stays none (up to `MAX_PROBE_EVERY`, at once where not even drafts that are always
  kept would pay: a draft model as large as the target): a probe costs more than its token, as the
  draft model first catches up with what the requests wrote meanwhile (a new request's prompt).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

REQUEST_MEMORY = 0.75  # how much of a request's acceptance history each new draft keeps
ENGINE_MEMORY = 0.98  # the engine's, over all requests' drafts
PRIOR_DRAFTS = 2.0  # a request's rate counts the engine's as this many drafts of its own
FIRST_RATE = 0.5  # the engine's rate before any draft was verified
COST_MEMORY = 0.2  # weight of a new step's seconds in its row count's moving average
PROBE_EVERY = 32  # steps a costly proposer sits out before it drafts a token again
MAX_PROBE_EVERY = 4096  # ... where its drafts have not paid for a long time


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
        self._counts: list[int] = []  # the row counts measured, in order

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            bisect.insort(self._counts, rows)
        self.seconds[rows] = seconds if old is None else old + COST_MEMORY * (seconds - old)

    def at(self, rows: int) -> float | None:
        """A step of `rows` rows' seconds: measured, or read off the line through the measured
        counts around it (past the last two, their slope; before the first, its value); None
        before any step was measured."""
        if rows in self.seconds:
            return self.seconds[rows]
        counts = self._counts
        if not counts:
            return None
        at = bisect.bisect(counts, rows)  # counts[:at] are below rows, counts[at:] above
        if 0 < at < len(counts):
            lo, hi = counts[at - 1], counts[at]
        elif at >= 2:
            lo, hi = counts[at - 2], counts[at - 1]
        else:
            return self.seconds[counts[0] if at == 0 else counts[-1]]
        slope = max(0.0, (self.seconds[hi] - self.seconds[lo]) / (hi - lo))
        return self.seconds[lo] + slope * (rows - lo)


class DraftBudget:
    """The engine's acceptance and step costs, and the cut of each step's drafts they imply."""

    def __init__(self) -> None:
        self.costs = StepCosts()
        self.engine = Acceptance()
        self.sat_out = 0  # steps in a row a costly proposer was asked for nothing
        self.probe_every = PROBE_EVERY  # how many it sits out before a probe

    def lead(self, rows: int, drafting: int, draft_seconds: float | None, most: int) -> int:
        """How many tokens ahead a proposer that takes `draft_seconds` a token (for all `drafting`
        requests at once) should draft, at most `most`, in a step of `rows` decode rows."""
        base = self.costs.at(rows)
        if base is None or draft_seconds is None:  # not measured yet: drafting measures it
            return most
        best_k = self._best_lead(rows, drafting, draft_seconds, most, self.engine.rate(FIRST_RATE, PRIOR_DRAFTS))
        if best_k:
            self.sat_out, self.probe_every = 0, PROBE_EVERY
            return best_k
        if not self._best_lead(rows, drafting, draft_seconds, most, 1.0):
            self.probe_every = MAX_PROBE_EVERY  # not even drafts always kept would pay: only its cost may change
        self.sat_out += 1
        if self.sat_out < self.probe_every:
            return 0
        self.sat_out, self.probe_every = 0, min(2 * self.probe_every, MAX_PROBE_EVERY)
        return 1

    @property
    def sitting_out(self) -> bool:
        """Whether a costly proposer does not pay at present (its last `lead` was none): the KV it
        would draft from is not worth shipping to this worker now."""
        return self.sat_out > 0

    def _best_lead(self, rows: int, drafting: int, draft_seconds: float, most: int, rate: float) -> int:
        best, best_k, gain = rows / self.costs.at(rows), 0, 0.0
        for k in range(1, most + 1):
            gain += drafting * rate ** k
            speed = (rows + gain) / (self.costs.at(rows + drafting * k) + k * draft_seconds)
            if speed > best:
                best, best_k = speed, k
        return best_k

    def rate(self, acceptance: Acceptance) -> float:
        return acceptance.rate(self.engine.rate(FIRST_RATE, PRIOR_DRAFTS), PRIOR_DRAFTS)

    def cut(self, drafts: list[tuple[list[int], Acceptance, bool]], rows: int) -> list[int]:
        """How many tokens of each draft to verify: (draft, its request's acceptance, whether it is
        a probe) for each request that drafted, in a step of `rows` decode rows without drafts."""
        if self.costs.at(rows) is None:  # nothing measured yet: verifying them all measures it
            return [len(d) for d, _, _ in drafts]
        engine = self.engine.rate(FIRST_RATE, PRIOR_DRAFTS)
        rates = [engine if probe else self.rate(a) for _, a, probe in drafts]
        tokens = float(rows)
        # the draft tokens in the order they join, most likely kept first: a request's next token's
        # chance is rate ** (its position)
        order: list[int] = []
        taken = [0] * len(drafts)
        heap = [(-rates[i], i) for i, (d, _, _) in enumerate(drafts) if d]
        heapq.heapify(heap)
        best, best_count = tokens / self.costs.at(rows), 0
        while heap:
            chance, i = heapq.heappop(heap)
            order.append(i)
            taken[i] += 1
            tokens -= chance
            speed = tokens / self.costs.at(rows + len(order))
            if speed > best:
                best, best_count = speed, len(order)
            if taken[i] < len(drafts[i][0]):
                heapq.heappush(heap, (-(rates[i] ** (taken[i] + 1)), i))
        keep = [0] * len(drafts)
        for i in order[:best_count]:
            keep[i] += 1
        return keep

    def verified(self, acceptance: Acceptance, kept: int, drafted: int) -> None:
        acceptance.add(kept, drafted, REQUEST_MEMORY)
        self.engine.add(kept, drafted, ENGINE_MEMORY)
