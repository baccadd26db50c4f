"""What `pdserve bench shift` sends, and to which clusters: a seeded two-phase workload, and the
splits of a number of workers.

- A phase is `duration_s` seconds of Poisson arrivals at `rate` with its own prompt and output
  lengths; the second phase's arrivals start where the first phase's time ends, so the traffic
  turns from one kind to the other halfway through, whatever each cluster makes of it.
- Every request remembers its phase: each half is measured on the requests sent in it.
- A split is written as `pdserve serve` is asked for it: `2P1D` (two prefill workers, one decode),
  or `3C` (three colocated workers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.workload.loadgen import BenchRequest, LengthDist, WorkloadSpec, arrival_times, build_requests

_SPLIT = re.compile(r"^(?:(\d+)P(\d+)D|(\d+)C)$")


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int
    decode: int
    colocated: int = 0

    @classmethod
    def parse(cls, text: str) -> Split:
        m = _SPLIT.match(text.strip().upper())
        if m is None:
            raise ValueError(f"a split is NPMD (prefill and decode workers, e.g. 2P1D) or NC (colocated); got {text!r}")
        split = cls(int(m[1]), int(m[2])) if m[3] is None else cls(0, 0, int(m[3]))
        if m[3] is None and (split.prefill < 1 or split.decode < 1):
            raise ValueError(f"a disaggregated split needs a worker in each pool; got {text!r}")
        if split.workers < 1:
            raise ValueError(f"a split needs at least one worker; got {text!r}")
        return split

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def serve_args(self) -> list[str]:
        return ["--prefill", str(self.prefill), "--decode", str(self.decode), "--colocated", str(self.colocated)]

    def __str__(self) -> str:
        return f"{self.colocated}C" if self.colocated else f"{self.prefill}P{self.decode}D"


def disaggregated_splits(workers: int) -> list[Split]:
    """Every split of `workers` into two non-empty pools, most prefill workers first."""
    return [Split(p, workers - p) for p in range(workers - 1, 0, -1)]


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # requests per second, Poisson
    input_len: LengthDist
    output_len: LengthDist

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or not self.rate > 0:
            raise ValueError(f"{self.name}: the duration and the rate must be positive")

    @property
    def num_requests(self) -> int:
        """As many as the rate sends in the phase on average (at least one)."""
        return max(1, round(self.rate * self.duration_s))

    def describe(self) -> dict:
        return {"name": self.name, "duration_s": self.duration_s, "rate": self.rate, "num_requests": self.num_requests,
                "input_len": str(self.input_len), "output_len": str(self.output_len)}


@dataclass(slots=True)
class ShiftWorkload:
    requests: list[BenchRequest]
    offsets: list[float]  # seconds from the start of the run at which each request is sent
    phase_of: list[int]  # index into `phases` of each request
    phases: list[Phase]

    @property
    def boundaries(self) -> list[float]:
        """When each phase begins, in seconds from the start."""
        starts, t = [], 0.0
        for phase in self.phases:
            starts.append(t)
            t += phase.duration_s
        return starts


def build_shift_workload(phases: list[Phase], seed: int, vocab_size: int) -> ShiftWorkload:
    """The phases one after another, each with prompts and arrivals of its own seed (seed + its
    index): the same seed gives every cluster the same requests at the same times. A phase's
    arrivals that the draw puts past its end are moved inside it, keeping their order, so that no
    request of one phase is sent during the next."""
    requests, offsets, phase_of, start = [], [], [], 0.0
    for i, phase in enumerate(phases):
        spec = WorkloadSpec(phase.num_requests, phase.input_len, phase.output_len, seed + i, vocab_size)
        times = arrival_times(phase.num_requests, phase.rate, seed=seed + i)
        span = times[-1] if times else 0.0
        if span >= phase.duration_s:  # squeeze into the phase, keeping the gaps' proportions
            times = [t * (phase.duration_s * 0.98) / span for t in times]
        requests += build_requests(spec)
        offsets += [start + t for t in times]
        phase_of += [i] * phase.num_requests
        start += phase.duration_s
    return ShiftWorkload(requests, offsets, phase_of, phases)
