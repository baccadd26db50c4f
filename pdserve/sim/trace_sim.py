"""The P:D controller over a traffic trace, against static splits, simulated whole.

1. Arrivals: each window of the trace (plan_trace.read_trace) is a Poisson process at its rate
   times `load_scale`, each request's prompt and output lengths drawn from the window's ISL and
   OSL, all from one seeded stream. `time_scale` compresses time (60: a trace hour lasts 60
   simulated seconds) and keeps rates and lengths, so every request meets the load of its hour;
   only the hours are shorter.
2. The load scale, unless given, makes the busiest window need all the cluster's workers,
   rate-matched for that window, by closed-form estimates of one instance's capacity.
3. The same arrivals run on clusters of the same workers, prefix caching off (the generated prompts
   share none): one starting at a given split with the router's P:D controller (cluster.py runs
   router/rebalance.py), and static splits, of which the best for the whole trace (SLA
   attainment, then goodput) is kept, and 1:1.
4. Each run is summarized per window and over the trace: SLA attainment (share of requests within
   both targets), goodput (those requests per simulated second), p90 TTFT and TPOT; with the
   controller, its moves with their reasons and the pool sizes over time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from pdserve.workload.metrics import RequestRecord, meets_slo
from pdserve.router.policy import DisaggregationPolicy
from pdserve.router.rebalance import RebalancePolicy
from pdserve.sim.closed_form import decode_rate, prefill_seconds
from pdserve.sim.cluster import SimCluster
from pdserve.sim.perf import LinearPerfModel
from pdserve.sim.plan_trace import Window



@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float  # simulated seconds from the trace's start
    isl: int
    osl: int
    window: int  # index into the trace


@dataclass(frozen=True, slots=True)
class Setup:
    """What every run of one comparison shares."""

    prefill_perf: LinearPerfModel
    decode_perf: LinearPerfModel
    workers: int
    ttft_slo_s: float
    tpot_slo_s: float
    chunk_tokens: int = 2048  # prefill tokens per step
    batch: int = 64  # sequences per step
    num_blocks: int = 4096  # KV blocks of 16 tokens per worker
    min_remote_tokens: int = 256  # the router's disaggregation threshold
    rebalance_every_s: float = 1.0

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError("a disaggregated cluster needs at least 2 workers (one of each pool)")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("the TTFT and TPOT targets must be positive")


@dataclass(slots=True)
class Run:
    """One cluster over the trace."""

    label: str
    num_prefill: int  # at the start
    overall: dict
    windows: list[dict]
    moves: list[dict] = field(default_factory=list)
    splits: list[tuple[float, int, int]] = field(default_factory=list)  # (simulated s, prefill, decode)

    def to_json(self) -> dict:
        return {"label": self.label, "start": f"{self.num_prefill}P:{self.overall['workers'] - self.num_prefill}D",
                "overall": self.overall, "windows": self.windows, "moves": self.moves,
                "splits": [{"at_s": round(t, 3), "prefill": p, "decode": d} for t, p, d in self.splits]}


def window_bounds(windows: list[Window], time_scale: float) -> list[tuple[float, float]]:
    """(start, end) of each window in simulated seconds; the last lasts as long as the one before
    it (an hour if it is the only one)."""
    if time_scale <= 0:
        raise ValueError("the time scale must be positive")
    t0 = windows[0].time_s
    ends = [w.time_s for w in windows[1:]]
    ends.append(windows[-1].time_s + (ends[-1] - windows[-2].time_s if len(windows) > 1 else 3600.0))
    return [((w.time_s - t0) / time_scale, (end - t0) / time_scale) for w, end in zip(windows, ends)]


def arrivals(windows: list[Window], time_scale: float, load_scale: float, seed: int) -> list[Arrival]:
    """A Poisson process at each window's rate times `load_scale` (memoryless, so it restarts at
    each window's start), lengths drawn from the window's distributions."""
    rng = random.Random(seed)
    out = []
    for i, (w, (start, end)) in enumerate(zip(windows, window_bounds(windows, time_scale))):
        rate = w.qps * load_scale
        if rate <= 0:
            continue
        t = start + rng.expovariate(rate)
        while t < end:
            out.append(Arrival(t, w.isl.sample(rng), w.osl.sample(rng), i))
            t += rng.expovariate(rate)
    return out


def capacities(setup: Setup, w: Window) -> tuple[float, float]:
    """(prefill, decode) requests/s one instance serves at this window's mean lengths, estimated
    in closed form: a prefill instance busy all the time (queueing is left to the simulation:
    the router's overflow to decode workers makes the split's queues hard to foresee), a decode
    instance at the largest batch that steps within the TPOT target."""
    isl, osl = max(1, round(w.isl.mean)), max(2, round(w.osl.mean))
    return (1.0 / prefill_seconds(setup.prefill_perf, isl, setup.chunk_tokens),
            decode_rate(setup.decode_perf, isl, osl, setup.tpot_slo_s, setup.batch, setup.num_blocks * 16))


def needs(setup: Setup, windows: list[Window], load_scale: float) -> list[tuple[float, float]]:
    """(prefill, decode) instances each window needs at `load_scale`, fractional, estimated."""
    out = []
    for w in windows:
        p, d = capacities(setup, w)
        if not (p and d):
            raise ValueError(f"one instance cannot meet the targets at ISL {w.isl}, OSL {w.osl} even alone")
        out.append((w.qps * load_scale / p, w.qps * load_scale / d))
    return out


def auto_load_scale(setup: Setup, windows: list[Window]) -> float:
    busiest = max(p + d for p, d in needs(setup, windows, 1.0))
    if busiest <= 0:
        raise ValueError("the trace asks for no requests")
    return setup.workers / busiest


def policy_for(setup: Setup, time_scale: float, confirm_s: float | None = None,
               dwell_s: float | None = None) -> RebalancePolicy:
    """The router's policy with its waits shortened by the time scale, but not below what a move
    takes in simulated time, which the scale does not shorten: a need confirmed for at least 2 s
    (the controller looks once a second), and at least 5 s between moves (a moved decode worker
    drains its sequences at their own pace first)."""
    live = RebalancePolicy(setup.ttft_slo_s, setup.tpot_slo_s)
    confirm = confirm_s if confirm_s is not None else max(2.0, live.confirm_s / time_scale)
    dwell = dwell_s if dwell_s is not None else max(5.0, live.dwell_s / time_scale)
    return RebalancePolicy(setup.ttft_slo_s, setup.tpot_slo_s, confirm_s=confirm, dwell_s=dwell)


def simulate(setup: Setup, arrivals_: list[Arrival], bounds: list[tuple[float, float]], num_prefill: int,
             rebalance: RebalancePolicy | None, label: str) -> Run:
    """One cluster of `setup.workers` workers, `num_prefill` of them prefill at the start, over the
    arrivals. Each prompt is made as it arrives, so only those in flight are held."""
    if not 1 <= num_prefill < setup.workers:
        raise ValueError(f"a split of {setup.workers} workers has 1 to {setup.workers - 1} prefill workers")
    args = {"num_blocks": setup.num_blocks, "max_num_batched_tokens": setup.chunk_tokens, "max_num_seqs": setup.batch}
    c = SimCluster(setup.prefill_perf, setup.decode_perf, num_prefill, setup.workers - num_prefill, worker_args=args,
                   policy=DisaggregationPolicy(min_remote_tokens=setup.min_remote_tokens), transfer=setup.prefill_perf,
                   rebalance=rebalance, rebalance_every_s=setup.rebalance_every_s, prefix_caching=False)
    for a in arrivals_:
        c.clock.at(a.at_s, lambda a=a: c.submit(c.clock.now, list(range(10, 10 + a.isl)), a.osl))
    records = c.run()  # in submission order: that of the arrivals
    overall, windows = summaries(setup, records, arrivals_, bounds)
    moves = [{"at_s": round(t, 3), "worker": w, "to": role, "reason": why} for t, w, role, why in c.moves]
    return Run(label, num_prefill, overall, windows, moves, c.splits if rebalance is not None else [])


def _stats(setup: Setup, records: list[RequestRecord], seconds: float) -> dict:
    met = sum(meets_slo(r, setup.ttft_slo_s, setup.tpot_slo_s) for r in records)
    done = [r for r in records if r.ok]
    p90 = lambda v: float(np.percentile(np.asarray(v) * 1e3, 90)) if v else None  # noqa: E731
    return {"requests": len(records), "completed": len(done),
            "sla_attainment_pct": 100.0 * met / len(records) if records else None,
            "goodput": met / seconds if seconds > 0 else 0.0,
            "ttft_p90_ms": p90([r.ttft for r in done]),
            "tpot_p90_ms": p90([t for r in done if (t := r.tpot) is not None])}


def summaries(setup: Setup, records: list[RequestRecord], arrivals_: list[Arrival],
              bounds: list[tuple[float, float]]) -> tuple[dict, list[dict]]:
    by_window: list[list[RequestRecord]] = [[] for _ in bounds]
    for r, a in zip(records, arrivals_):
        by_window[a.window].append(r)
    windows = [_stats(setup, rs, end - start) for rs, (start, end) in zip(by_window, bounds)]
    overall = {"workers": setup.workers, **_stats(setup, records, bounds[-1][1] - bounds[0][0])}
    return overall, windows


def static_grid(workers: int, most: int) -> list[int]:
    """Prefill counts for the first pass over static splits: all of them up to `most`, else an
    even grid with its ends, and 1:1 always."""
    step = max(1, math.ceil((workers - 1) / most))
    return sorted({*range(1, workers, step), workers - 1, workers // 2})


def refine(tried: dict[int, tuple], workers: int) -> list[int]:
    """Prefill counts next to the best so far that are not yet tried, halfway to its tried
    neighbours (attainment is taken to rise to one peak as prefill workers are added)."""
    best = max(tried, key=lambda p: tried[p])
    lower = max((p for p in tried if p < best), default=best)
    upper = min((p for p in tried if p > best), default=best)
    return sorted({(lower + best) // 2, (best + upper + 1) // 2} - set(tried) - {0, workers})


def moves_per_hour(moves: list[dict], time_scale: float, hours: int) -> list[int]:
    """Moves begun in each trace hour."""
    counts = [0] * max(1, hours)
    for m in moves:
        counts[min(len(counts) - 1, int(m["at_s"] * time_scale // 3600))] += 1
    return counts


def reversals(moves: list[dict]) -> int:
    """Moves that undo the one before: the measure of oscillation."""
    return sum(a["to"] != b["to"] for a, b in zip(moves, moves[1:]))
