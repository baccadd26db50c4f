"""The rates `pdserve bench shift` sends at when none is given: measured on the host it runs on, so
that a default run shows what the benchmark exists to show (a split that suits the traffic meets
the targets where one that does not suit it fails) rather than overloading a small machine, where
every split misses, or idling a large one, where every split meets them.

1. Start the two extreme splits of `--workers` (most prefill workers, e.g. 2P1D, and most decode
   workers, 1P2D), one after another, each as the benchmark's clusters start.
2. Against each, send each phase's kind of request closed-loop: twice as many in flight as the
   cluster has workers, `BURST_ROUNDS` of them each, so every pool stays busy. Completions per
   second are that split's capacity for that phase's traffic.
3. A phase's rate is the larger of its two capacities: what the split that suits the phase
   serves, past what the other does. A burst measures less than a split sustains under Poisson
   arrivals within the targets (on a 2-core Xeon, at the geometric mean of the two capacities
   every static split met the targets for all of phase 1), so no margin is taken off. Where the
   capacities differ by less than `DISTINCT` (say, a host with too few cores for the pools to work
   apart), the splits cannot be told apart there and the rate is `FALLBACK_LOAD` of the larger: a
   load both meet. The run says which.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdserve.workload.loadgen import WorkloadSpec, build_requests
from pdserve.bench.local_cluster import LocalCluster
from pdserve.bench.serving import run_load, server_info
from pdserve.bench.shift_workload import Phase, Split

BURST_ROUNDS = 2  # requests a probe sends: this many times as many as it keeps in flight
DISTINCT = 1.2  # capacities closer than this ratio: the splits serve the phase alike
FALLBACK_LOAD = 0.8  # of the larger capacity, where the splits serve a phase alike
SEED_OFFSET = 1000  # the probe's prompts are drawn apart from the measured run's


@dataclass(frozen=True, slots=True)
class Capacity:
    split: str
    phase: str
    completed: int
    sent: int
    wall_s: float

    @property
    def req_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0


def probe_splits(workers: int) -> list[Split]:
    """The two splits whose capacities bound a phase's: most prefill workers, most decode ones."""
    return [Split(workers - 1, 1), Split(1, workers - 1)]


def rate_from(capacities: list[float]) -> tuple[float, bool]:
    """(the phase's rate, whether the splits serve it differently) from its capacities."""
    low, high = min(capacities), max(capacities)
    if low <= 0:
        return FALLBACK_LOAD * high, False
    if high / low < DISTINCT:
        return FALLBACK_LOAD * high, False
    return high, True


def probe_rates(model: str, workers: int, phases: list[Phase], serve_args: list[str], seed: int,
                vocab_size: int | None, log_dir: Path, say: Callable[[str], None]) -> tuple[list[float], dict]:
    """Each phase's rate (requests/s), and what was measured (for the results' JSON)."""
    in_flight = 2 * workers
    found: list[Capacity] = []
    for split in probe_splits(workers):
        log_path = log_dir / f"shift_probe_{split}.log"
        say(f"probing {split}: {in_flight} requests in flight, {BURST_ROUNDS * in_flight} of each phase; "
            f"its log: {log_path}")
        cluster = LocalCluster(model, [*split.serve_args, *serve_args], log_path=log_path,
                               progress=lambda s, name=split: say(f"probe {name}: still starting after {s:.0f}s"))
        try:
            info = server_info(cluster.url)
            vocab = vocab_size or int(info["vocab_size"])
            for i, phase in enumerate(phases):
                spec = WorkloadSpec(BURST_ROUNDS * in_flight, phase.input_len, phase.output_len,
                                    seed + SEED_OFFSET + i, vocab)
                records = asyncio.run(run_load(cluster.url, info["id"], build_requests(spec), math.inf, in_flight,
                                               label=f"probe {split}, phase {i + 1}: "))
                done = [r for r in records if r.ok]
                wall = max((r.end for r in done), default=0.0) - min((r.start for r in records), default=0.0)
                found.append(Capacity(str(split), phase.name, len(done), len(records), max(wall, 0.0)))
                say(f"probe {split}, phase {i + 1} ({phase.name}): {len(done)}/{len(records)} done, "
                    f"{found[-1].req_s:.3f} req/s")
        finally:
            cluster.stop()
    rates, report = [], {"in_flight": in_flight, "rounds": BURST_ROUNDS, "phases": []}
    for phase in phases:
        caps = [c for c in found if c.phase == phase.name]
        rate, distinct = rate_from([c.req_s for c in caps])
        if not rate > 0:
            raise RuntimeError(f"the probe completed no request of {phase.name!r} on any split: see {log_dir}")
        rates.append(rate)
        report["phases"].append({"phase": phase.name, "rate": rate, "splits_differ": distinct,
                                 "capacity_req_s": {c.split: round(c.req_s, 4) for c in caps},
                                 "completed": {c.split: f"{c.completed}/{c.sent}" for c in caps}})
        if distinct:
            say(f"{phase.name}: {rate:.3f} req/s, the larger of the splits' capacities "
                f"({', '.join(f'{c.split} {c.req_s:.3f}' for c in caps)})")
        else:
            say(f"{phase.name}: the splits serve it alike on this host "
                f"({', '.join(f'{c.split} {c.req_s:.3f}' for c in caps)} req/s): "
                f"{rate:.3f} req/s, {FALLBACK_LOAD:.0%} of the larger")
    return rates, report
