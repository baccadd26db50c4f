"""Canary rollouts: moving live traffic from the stable version to a new one in steps, with an
automatic rollback.

Workers register with a version label (`pdserve worker --version-label v2`); the stable version
is the first registered worker's, or `--stable-version`. Every new request goes to one version
(`pick`): the stable one, or, while a rollout runs, the canary with the current step's share.
A rollout (`start`, from the admin API):
1. Each step (by default 5% -> 25% -> 50% -> 100%) lasts at least `step_s` and until the canary
   finished `min_requests` requests in it. Over the step, the canary's error ratio (calls to its
   workers that failed, of all its calls) and SLA attainment (finished requests within both the
   TTFT and TPOT targets) are compared with stable's over the same time.
2. The canary holds when its error ratio is at most stable's plus `max_error_increase` and its
   attainment at least stable's minus `max_attainment_drop`: the next step begins; after the
   last, the canary is promoted (it becomes the stable version; the old version's workers get
   no new request and can be drained).
3. It is rolled back the moment it does not hold (once `min_errors` calls failed, or at a step's
   end for attainment), or when it has had no worker for `lost_s`: its share drops to 0 at once.
   Requests in flight finish where they are; a call that fails on a canary worker before its
   first token is tried again on stable, so the canary's failures reach no client that can
   still be served.
`pause` holds the share where it is (no step advances, no automatic rollback); `resume` goes
on; `promote` and `abort` end the rollout by hand.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

STATES = ("idle", "running", "paused", "promoted", "rolled_back", "aborted")
MAX_EVENTS = 64
MAX_OUTCOMES = 200_000  # call and request outcomes held for the current step, at most


@dataclass(frozen=True)
class RolloutPolicy:
    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    step_s: float = 60.0
    min_requests: int = 20
    max_error_increase: float = 0.01
    max_attainment_drop: float = 0.05
    min_errors: int = 3
    lost_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.steps or len(self.steps) > 16 or any(not 0 < s <= 1 for s in self.steps):
            raise ValueError("steps: 1 to 16 shares, each in (0, 1]")
        if list(self.steps) != sorted(self.steps) or self.steps[-1] != 1.0:
            raise ValueError("steps: increasing shares ending at 1.0")
        for name in ("step_s", "lost_s"):
            if not 0 < getattr(self, name) <= 86_400:
                raise ValueError(f"{name}: seconds in (0, 86400]")
        if not 1 <= self.min_requests <= 1_000_000 or not 1 <= self.min_errors <= 1_000_000:
            raise ValueError("min_requests and min_errors: 1 to 1000000")
        for name in ("max_error_increase", "max_attainment_drop"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: a share in [0, 1]")


@dataclass
class Tally:
    """One version's outcomes since the step began."""

    calls: int = 0
    failed_calls: int = 0
    finished: int = 0
    sla_met: int = 0

    @classmethod
    def total(cls, tallies: list[dict[str, Tally]], version: str | None) -> Tally:
        """One version's outcomes summed over several routers' counts."""
        parts = [t[version] for t in tallies if version in t]
        return cls(*(sum(getattr(t, f) for t in parts) for f in ("calls", "failed_calls", "finished", "sla_met")))

    @property
    def error_ratio(self) -> float:
        return self.failed_calls / self.calls if self.calls else 0.0

    @property
    def attainment(self) -> float:
        return self.sla_met / self.finished if self.finished else 1.0


@dataclass
class Rollout:
    stable: str | None = None  # None until the first worker registers (or --stable-version)
    id: str = ""  # each rollout's own, so routers count the same step's outcomes together (`peer_state.py`)
    canary: str | None = None
    state: str = "idle"
    policy: RolloutPolicy = field(default_factory=RolloutPolicy)
    step: int = 0
    step_started: float = 0.0
    started: float = 0.0
    canary_seen: float = 0.0  # when the canary last had a worker
    tallies: dict[str, Tally] = field(default_factory=dict)
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    clock: object = time.monotonic
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    # -- routing -------------------------------------------------------------------------------

    @property
    def share(self) -> float:
        """The canary's share of new requests now."""
        return self.policy.steps[self.step] if self.state in ("running", "paused") else 0.0

    def pick(self) -> str | None:
        """The version a new request goes to (None: any, no worker registered yet)."""
        share = self.share
        return self.canary if share and self.rng.random() < share else self.stable

    def first_version(self, version: str) -> None:
        """A worker registered: the first one's version is stable unless one was set."""
        if self.stable is None:
            self.stable = version

    # -- outcomes --------------------------------------------------------------------------------

    def call_ended(self, version: str, failed: bool) -> None:
        with self.lock:
            tally = self._tally(version)
            if tally is not None:
                tally.calls += 1
                tally.failed_calls += failed

    def request_finished(self, version: str, sla_met: bool) -> None:
        with self.lock:
            tally = self._tally(version)
            if tally is not None:
                tally.finished += 1
                tally.sla_met += sla_met

    def _tally(self, version: str) -> Tally | None:
        if self.state != "running" or version not in (self.stable, self.canary):
            return None
        tally = self.tallies.setdefault(version, Tally())
        return tally if tally.calls + tally.finished < MAX_OUTCOMES else None

    # -- the operator's commands -----------------------------------------------------------------

    def start(self, canary: str, policy: RolloutPolicy) -> None:
        with self.lock:
            if self.state in ("running", "paused"):
                raise RolloutError(f"a rollout of {self.canary!r} is under way: promote or abort it first")
            if self.stable is None:
                raise RolloutError("no stable version yet: no worker has registered")
            if canary == self.stable:
                raise RolloutError(f"{canary!r} is the stable version already")
            now = self.clock()
            self.id = secrets.token_hex(8)
            self.canary, self.policy, self.state, self.step = canary, policy, "running", 0
            self.started = self.canary_seen = now
            self._new_step(now)
            self._event("started", now)

    def pause(self) -> None:
        self._command("running", "paused")

    def resume(self) -> None:
        self._command("paused", "running")
        with self.lock:
            self._new_step(self.clock())  # the step's window starts again: a pause is not evidence

    def promote(self) -> None:
        with self.lock:
            self._require_active()
            self._promote(self.clock(), "by hand")

    def abort(self) -> None:
        with self.lock:
            self._require_active()
            self._end("aborted", self.clock(), "by hand")

    def _command(self, before: str, after: str) -> None:
        with self.lock:
            if self.state != before:
                raise RolloutError(f"the rollout is {self.state}, not {before}")
            self.state = after
            self._event(after, self.clock())

    def _require_active(self) -> None:
        if self.state not in ("running", "paused"):
            raise RolloutError(f"no rollout is under way (it is {self.state})")

    # -- the automatic part ------------------------------------------------------------------------

    def tick(self, canary_workers: int, peers: list[dict[str, Tally]] = ()) -> str | None:
        """Advance, promote or roll back as the step's outcomes say, this router's and those its
        peers counted in the same step (the leader's rounds call it); returns what happened, if anything."""
        with self.lock:
            if self.state != "running":
                return None
            now = self.clock()
            if canary_workers:
                self.canary_seen = now
            elif now - self.canary_seen >= self.policy.lost_s:
                return self._end("rolled_back", now, f"no canary worker for {self.policy.lost_s:g} s")
            canary, stable = (Tally.total([self.tallies, *peers], v) for v in (self.canary, self.stable))
            p = self.policy
            if canary.failed_calls >= p.min_errors and canary.error_ratio > stable.error_ratio + p.max_error_increase:
                return self._end("rolled_back", now, f"error ratio {canary.error_ratio:.3f} against stable's "
                                                     f"{stable.error_ratio:.3f}")
            if now - self.step_started < p.step_s or canary.finished < p.min_requests:
                return None
            if canary.attainment < stable.attainment - p.max_attainment_drop:
                return self._end("rolled_back", now, f"SLA attainment {canary.attainment:.3f} against stable's "
                                                     f"{stable.attainment:.3f}")
            if self.step + 1 == len(p.steps):
                return self._promote(now, "every step held")
            self.step += 1
            self._new_step(now)
            return self._event("advanced", now)

    def _promote(self, now: float, why: str) -> str:
        old, self.stable = self.stable, self.canary
        return self._end("promoted", now, f"{why}; {old!r} gets no new request")

    def _end(self, state: str, now: float, why: str) -> str:
        self.state = state
        self._event(state, now, why)
        return state

    def _new_step(self, now: float) -> None:
        self.step_started = now
        self.tallies = {}

    def _event(self, kind: str, now: float, why: str = "") -> str:
        self.events.append({"event": kind, "at_s": round(now - self.started, 3), "share": self.share,
                            "canary": self.canary, "stable": self.stable, **({"why": why} if why else {})})
        return kind

    def status(self) -> dict:
        with self.lock:
            return {"id": self.id, "state": self.state, "stable": self.stable, "canary": self.canary, "share": self.share,
                    "step": self.step, "steps": list(self.policy.steps),
                    "step_age_s": round(self.clock() - self.step_started, 3) if self.state != "idle" else 0.0,
                    "policy": {**asdict(self.policy), "steps": list(self.policy.steps)},
                    "tallies": {v: {**asdict(t), "error_ratio": round(t.error_ratio, 4),
                                    "attainment": round(t.attainment, 4)} for v, t in self.tallies.items()},
                    "events": list(self.events)}


class RolloutError(ValueError):
    """A rollout command that does not fit the rollout's state (409)."""
