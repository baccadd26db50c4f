"""The chaos benchmark's fault plan: which faults, at what time, on which process. Pure data and
pure functions of the seed, so that a plan is tested without a cluster and a seed gives the same
plan every time.

- `parse_faults("kill-worker,freeze-worker:5,kill-router,cut-kv,drain")`: what `--faults` asks.
- `plan_faults(...)`: the faults spread over the run, each at a seeded time in a slot of its own
  (in the order asked), each on a seeded target among the processes its kind may hit.
- `rolling_restart_plan(...)`: every worker drained (SIGTERM) in turn; the runner starts each one
  once the one before is back.
A planned time is the earliest a fault may go in: the runner waits for the cluster to recover from
the fault before it (every worker registered again), so that each recovery is measured alone.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

# kind -> what it does (the runner's faults.py does it)
FAULT_KINDS = {
    "kill-worker": "SIGKILL to a worker; the launcher starts it again",
    "freeze-worker": "SIGSTOP to a worker for N seconds (freeze-worker:N, default 5), then SIGCONT",
    "kill-router": "SIGKILL to the router (with --routers N, one of them); the launcher starts it on the same "
                   "port, the workers register again",
    "drain": "SIGTERM to a worker: it drains, exits 0, and the launcher starts it again",
    "cut-kv": "every KV connection of a worker closed at once (its fault-injection endpoint)",
}
DEFAULT_FAULTS = "kill-worker,freeze-worker:5,kill-router,cut-kv,drain"
DEFAULT_FREEZE_S = 5.0
MAX_FREEZE_S = 120.0
ROUTER = "router"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One item of `--faults`."""

    kind: str
    seconds: float = 0.0  # how long a freeze lasts; 0 for the other kinds

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; the kinds are {', '.join(FAULT_KINDS)}")
        if self.kind == "freeze-worker" and not 0 < self.seconds <= MAX_FREEZE_S:
            raise ValueError(f"a freeze lasts more than 0 and at most {MAX_FREEZE_S:g} seconds, got {self.seconds:g}")
        if self.kind != "freeze-worker" and self.seconds:
            raise ValueError(f"{self.kind} takes no argument")


@dataclass(frozen=True, slots=True)
class PlannedFault:
    at_s: float  # earliest time to inject it, in seconds after the load started
    kind: str
    target: str  # the process's name in `pdserve serve`: "router", "prefill worker 0", "decode worker 1"
    seconds: float = 0.0  # a freeze's length

    def describe(self) -> str:
        extra = f" for {self.seconds:g}s" if self.kind == "freeze-worker" else ""
        return f"{self.kind} {self.target}{extra} at {self.at_s:.1f}s"

    def as_dict(self) -> dict:
        return asdict(self)


def parse_faults(text: str) -> list[FaultSpec]:
    """`kind[:seconds],...`; ValueError naming what is wrong. An empty list is allowed (no faults)."""
    specs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        kind, _, arg = item.partition(":")
        kind = kind.strip()
        if kind == "freeze-worker":
            try:
                seconds = float(arg) if arg.strip() else DEFAULT_FREEZE_S
            except ValueError:
                raise ValueError(f"freeze-worker:N takes seconds, got {arg!r}") from None
        elif arg:
            raise ValueError(f"{kind} takes no argument, got {item!r}")
        else:
            seconds = 0.0
        specs.append(FaultSpec(kind, seconds))
    return specs


def worker_names(prefill: int, decode: int, colocated: int = 0) -> list[str]:
    """The names `pdserve serve` gives its workers, in the order it starts them (one index across roles)."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["both"] * colocated
    return [f"{role} worker {i}" for i, role in enumerate(roles)]


def router_names(count: int) -> list[str]:
    """The names `pdserve serve --routers N` gives its routers."""
    return [ROUTER] if count == 1 else [f"{ROUTER} {i}" for i in range(count)]


def plan_faults(specs: list[FaultSpec], duration_s: float, workers: list[str], seed: int,
                start_frac: float = 0.15, end_frac: float = 0.75, routers: list[str] = (ROUTER,)
                ) -> list[PlannedFault]:
    """The faults in the order given, spread over [start_frac, end_frac] of the run: fault i at a
    seeded time in the first half of slot i (the second half is left for its recovery), on a seeded
    target: a worker for every kind but kill-router, which hits one of `routers`. The load before
    the first fault and after the last one shows the cluster's throughput without one."""
    if not workers:
        raise ValueError("a fault plan needs at least one worker")
    if not 0 <= start_frac < end_frac <= 1:
        raise ValueError(f"need 0 <= start_frac < end_frac <= 1, got {start_frac} and {end_frac}")
    if duration_s <= 0:
        raise ValueError(f"the run must last more than 0 seconds, got {duration_s:g}")
    rng = random.Random(f"chaos-plan-{seed}")
    begin, span = start_frac * duration_s, (end_frac - start_frac) * duration_s
    slot = span / max(1, len(specs))
    plan = []
    for i, spec in enumerate(specs):
        at = begin + i * slot + rng.uniform(0.0, slot / 2)
        target = (rng.choice(list(routers)) if len(routers) > 1 else routers[0]) if spec.kind == "kill-router" \
            else rng.choice(workers)
        plan.append(PlannedFault(round(at, 2), spec.kind, target, spec.seconds))
    return plan


def rolling_restart_plan(workers: list[str], duration_s: float, start_frac: float = 0.15) -> list[PlannedFault]:
    """Every worker drained in turn, in the order the cluster started them: the first at
    `start_frac` of the run, each next one as soon as the one before is back (time 0 after the
    first: the runner's wait for recovery spaces them)."""
    return [PlannedFault(round(start_frac * duration_s, 2) if i == 0 else 0.0, "drain", name)
            for i, name in enumerate(workers)]
