"""A simulated run against an SLA: its outcome at the SLA's percentile, and the rule that ends a
run as soon as that outcome is certain to miss a bound (plan.py's searches stop most of their
runs this way)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.workload.loadgen import BenchRequest
from pdserve.workload.metrics import RequestRecord
from pdserve.sim.cluster import SimCluster


@dataclass(frozen=True, slots=True)
class SLA:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def describe(self) -> str:
        return f"p{self.percentile:g} TTFT <= {self.ttft_s * 1e3:g} ms and p{self.percentile:g} TPOT <= " \
               f"{self.tpot_s * 1e3:g} ms"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A simulated run, at the SLA's percentile. A run stopped early (`EarlyVerdict`) has the bound
    it was certain to miss at infinity and the others at what its requests showed until then."""

    ttft_s: float
    tpot_s: float
    completed: bool
    stopped_early: bool = False

    def misses(self, sla: SLA) -> list[str]:
        """The bounds this run misses: "ttft", "tpot" (an unfinished run misses both)."""
        if not self.completed:
            return ["ttft", "tpot"]
        return [name for name, value, bound in (("ttft", self.ttft_s, sla.ttft_s), ("tpot", self.tpot_s, sla.tpot_s))
                if value > bound]


class EarlyVerdict:
    """Stops a run once its percentile must miss a bound, whatever the rest of the run does.

    With linear interpolation between ranks (numpy's), the p-th percentile of n values exceeds a
    bound as soon as n - floor((n - 1) p / 100) of them do: from then on the run's verdict is
    known, and an overloaded run (most runs of a capacity search above the answer) ends after a
    fraction of its requests. Its requests' first tokens and completions are watched as they
    happen (`SimCluster.observe`).
    """

    def __init__(self, sla: SLA, requests: list[BenchRequest], stop_on: tuple[str, ...] = ("ttft", "tpot")) -> None:
        self.sla, self.stop_on = sla, stop_on
        allowed = lambda n: n - math.floor((n - 1) * sla.percentile / 100)  # noqa: E731
        self.limit = {"ttft": allowed(len(requests)), "tpot": allowed(sum(r.max_tokens >= 2 for r in requests))}
        self.count = {"ttft": 0, "tpot": 0}
        self.missed: list[str] = []
        self.clock = None

    def watch(self, cluster: SimCluster) -> SimCluster:
        self.clock = cluster.clock
        cluster.observe = self.observe
        return cluster

    def observe(self, record: RequestRecord, event: str) -> None:
        if event == "first_token":
            name, late = "ttft", record.ttft > self.sla.ttft_s
        else:
            tpot = record.tpot
            name, late = "tpot", tpot is not None and tpot > self.sla.tpot_s
        if late:
            self.count[name] += 1
            if self.count[name] >= self.limit[name] and name in self.stop_on and name not in self.missed:
                self.missed.append(name)
                self.clock.stop()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0
