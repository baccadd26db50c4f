"""Shadow traffic: a share of live requests also sent to the workers of another version (a new
model, build or configuration, `--version-label`), whose answers are compared and thrown away.

1. `mirror` (as a request is admitted): a single completion, picked with the shadow's share, is
   sent to a decode worker of the shadow version, as a task of its own, unless the shadow
   already has `max_concurrency` requests in flight (it is skipped and counted: the shadow never
   queues behind itself, and its load on the router is bounded). Nothing of it reaches the
   client; its failure is its own.
2. When both the request and its copy are done, the comparison is recorded: whether each
   finished, the time to first token and end to end of each, each side's phases (queue,
   prefill, transfer, decode, as their decode workers reported them), and for greedy requests
   (temperature 0) how many of the primary's tokens the shadow produced alike, from the start.
3. `report` (GET /admin/shadow, `pdserve shadow-report`) and /metrics show the totals and the
   medians of the last `WINDOW` comparisons.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve import wire
from pdserve.router.streams import LiveStream, worker_lines
from pdserve.router.waiting_line import Hold

log = logging.getLogger("pdserve.router")

WINDOW = 1000  # comparisons the report's medians are over
PHASES = ("queue_s", "prefill_s", "transfer_s", "decode_s")


@dataclass
class Side:
    """One side of a comparison: what it produced and how long it took."""

    tokens: list[int] = field(default_factory=list)
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class Comparison:
    primary: Side
    shadow: Side
    greedy: bool

    @property
    def agreement(self) -> float | None:
        """Of the primary's tokens, the share the shadow produced alike from the start (greedy)."""
        if not self.greedy or not self.primary.ok or not self.shadow.ok or not self.primary.tokens:
            return None
        same = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1],
                                                  zip(self.primary.tokens, self.shadow.tokens)))
        return same / len(self.primary.tokens)


class ShadowCopy:
    """One request's copy: its shadow side runs as a task; the primary side is told when it ends."""

    def __init__(self, shadow: Shadow, greedy: bool) -> None:
        self.shadow, self.greedy = shadow, greedy
        self.primary_tokens: list[int] = []  # the primary's tokens as they come (its stream's list)
        self.primary: Side | None = None
        self.copy: Side | None = None

    def primary_done(self, ok: bool, ttft_s: float | None, e2e_s: float | None, phases: dict | None) -> None:
        self.primary = Side(list(self.primary_tokens), ok, ttft_s, e2e_s, dict(phases or {}))
        self._maybe_record()

    def copy_done(self, side: Side) -> None:
        self.copy = side
        self._maybe_record()

    def _maybe_record(self) -> None:
        if self.primary is not None and self.copy is not None:
            self.shadow.record(Comparison(self.primary, self.copy, self.greedy))


class Shadow:
    def __init__(self, router, version: str, share: float, max_concurrency: int, timeout_s: float,
                 rng: random.Random | None = None) -> None:
        self.router, self.version, self.share = router, version, share
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.rng = rng or random.Random()
        self.in_flight = 0
        self.counts = {"mirrored": 0, "skipped_busy": 0, "skipped_no_worker": 0, "shadow_failed": 0,
                       "primary_failed": 0, "compared": 0, "greedy_compared": 0, "greedy_identical": 0}
        self.recent: deque[Comparison] = deque(maxlen=WINDOW)
        self.started = time.monotonic()
        self._ids = itertools.count()
        self.tasks: set[asyncio.Task] = set()

    def mirror(self, prompt_ids: list[int], sampling: wire.Sampling) -> ShadowCopy | None:
        """Send a copy of this request to the shadow version, if it is picked and fits."""
        if sampling.n != 1 or self.rng.random() >= self.share:
            return None
        if self.in_flight >= self.max_concurrency:
            self.counts["skipped_busy"] += 1
            return None
        chosen = self.router.route_or_none(prompt_ids, frozenset(), 1, self.version, fallback=False)
        if chosen is None:
            self.counts["skipped_no_worker"] += 1
            return None
        decode, prefill = chosen
        copy = ShadowCopy(self, sampling.temperature == 0)
        self.in_flight += 1
        self.counts["mirrored"] += 1
        task = asyncio.create_task(self._run(copy, decode, prefill, prompt_ids, sampling))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return copy

    async def _run(self, copy: ShadowCopy, decode, prefill, prompt_ids: list[int], sampling: wire.Sampling) -> None:
        router = self.router
        hold = Hold(router.line, decode, 1)
        side = Side()
        request_id = f"shadow-{next(self._ids)}"
        body = wire.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                                    prefill_url=prefill.url if prefill is not None else None)
        live = LiveStream(request_id, 1, len(prompt_ids), sampling.max_tokens or 0, decode.worker_id, request_id)
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                async for line in worker_lines(router.http, decode.url, body, router.worker_headers, live,
                                               router.config.worker_silence_s):
                    out = line.outputs[0]
                    if out.token_ids and side.ttft_s is None:
                        side.ttft_s = time.monotonic() - start
                    side.tokens += out.token_ids
                    if line.phase_times:
                        side.phases = dict(line.phase_times)
            side.ok, side.e2e_s = True, time.monotonic() - start
        except Exception as e:  # the shadow's failure is its own: counted, never passed on
            self.counts["shadow_failed"] += 1
            log.info("shadow request on %s failed: %s: %s", decode.url, type(e).__name__, e)
        finally:
            hold.release()
            self.in_flight -= 1
            copy.copy_done(side)

    def record(self, comparison: Comparison) -> None:
        self.counts["compared"] += 1
        self.counts["primary_failed"] += not comparison.primary.ok
        agreement = comparison.agreement
        if agreement is not None:
            self.counts["greedy_compared"] += 1
            self.counts["greedy_identical"] += agreement == 1.0 and len(comparison.shadow.tokens) == len(
                comparison.primary.tokens)
        self.recent.append(comparison)

    def agreement_mean(self) -> float | None:
        """Greedy token agreement, the mean over the last comparisons (None: none greedy yet)."""
        agreements = [a for c in self.recent if (a := c.agreement) is not None]
        return round(statistics.fmean(agreements), 4) if agreements else None

    def medians(self, name: str) -> dict:
        """The primary's and the shadow's median of latency `name` (ttft_s, e2e_s or a phase), and
        their ratio, over the last comparisons where both sides finished ({}: none yet)."""
        pick = {"ttft_s": lambda s: s.ttft_s, "e2e_s": lambda s: s.e2e_s}.get(name, lambda s: s.phases.get(name))
        values = [(pick(c.primary), pick(c.shadow)) for c in self.recent if c.primary.ok and c.shadow.ok]
        values = [(p, s) for p, s in values if p is not None and s is not None]
        if not values:
            return {}
        primary, shadow = statistics.median(p for p, _ in values), statistics.median(s for _, s in values)
        return {"primary": round(primary, 6), "shadow": round(shadow, 6),
                "ratio": round(shadow / primary, 4) if primary > 0 else None}

    def report(self) -> dict:
        """Totals, and medians over the last comparisons where both sides finished."""
        return {"version": self.version, "share": self.share, "max_concurrency": self.max_concurrency,
                "in_flight": self.in_flight, "running_s": round(time.monotonic() - self.started, 3),
                **self.counts, "window": len(self.recent), "greedy_agreement_mean": self.agreement_mean(),
                "latency_medians": {name: self.medians(name) for name in ("ttft_s", "e2e_s", *PHASES)}}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
