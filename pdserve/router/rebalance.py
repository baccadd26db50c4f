"""The P:D controller: which way, if any, to move one worker between the prefill and decode pools.

`decide` is a pure function of live signals, targets and its own small state, so that the router
(`pdserve serve --rebalance`) and a simulated cluster can run the very same rule:
- pressure of a pool = how close it runs to its target: prefill, the worse of the recent first-token
  times (p90 of the last `RecentTTFT.window_s`) and of the longest queue on a prefill worker, against
  the TTFT target (measured TTFT also counts prompts that wait on decode workers, where the router
  sends them when the prefill pool is saturated); decode, the worst of the decode step time against
  the TPOT target, of KV use against the hot threshold, and of the prompt queue on a decode worker
  against the TTFT target (a decode worker computing prompts is no spare capacity: in an overload
  of both kinds nothing moves, since no split would help);
- a worker moves from the relaxed pool to the pressed one only when one pool is past `high` while
  the other is below `low` (the gap between them is the hysteresis), and has been for `confirm_s`;
  one exception: decode workers short of decoding itself (TPOT or KV past their targets) with no
  prompt queued anywhere get a prefill worker however late first tokens are, since those wait on
  the decode workers' KV or steps (`_short_of_decoding`);
- after a move, nothing moves for `dwell_s`: the moved worker must drain and the signals settle
  before they say anything about the new split. Neither pool is ever taken below its minimum.
Every decision comes with its reason, in words, for the log.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pdserve.router.policy import WorkerLoad

Move = Literal["to_prefill", "to_decode"]


@dataclass(frozen=True, slots=True)
class Signals:
    prefill_workers: int
    decode_workers: int
    prefill_queue_s: float  # the longest a prompt waits on a prefill worker now
    decode_step_s: float  # the decode workers' step time: what each token costs a stream
    decode_kv_usage: float  # the fullest decode worker's KV use, 0..1
    recent_ttft_s: float = 0.0  # p90 of the first-token times measured lately
    decode_queue_s: float = 0.0  # the longest prompt queue on a decode worker (its own prefills, or
    # the prefill pool's overflow): prompt work that keeps it from being spare capacity


@dataclass(frozen=True, slots=True)
class RebalancePolicy:
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.1
    hot_kv_usage: float = 0.85
    high: float = 1.0  # a pool this pressed (1: at its target) needs a worker
    low: float = 0.5  # a pool this relaxed can give one
    confirm_s: float = 10.0  # a need must hold this long before a move
    dwell_s: float = 60.0  # no move sooner than this after the last one
    min_prefill: int = 1
    min_decode: int = 1


@dataclass(slots=True)
class ControllerState:
    last_move_at: float = -math.inf
    wanted: Move | None = None  # what the signals have asked for since `since`
    since: float = 0.0
    moves: dict[str, int] = field(default_factory=lambda: {"to_prefill": 0, "to_decode": 0})


Stage = Literal["balanced", "blocked", "confirming", "dwelling", "moving"]


@dataclass(frozen=True, slots=True)
class Decision:
    move: Move | None
    reason: str
    stage: Stage = "moving"  # balanced: no pool past its target; blocked: one is, but the other is not
    # relaxed enough to give a worker (or is at its minimum); confirming: a need that has not held
    # long enough; dwelling: a confirmed need waiting out the dwell; moving: `move` now
    wanted: Move | None = None  # what the signals ask for, moved or not


@dataclass(frozen=True, slots=True)
class PoolMember:
    """A worker the controller may count and move: a prefill or decode one, not draining."""

    worker_id: str
    role: str
    load: WorkerLoad


class RecentTTFT:
    """First-token times of the last `window_s` seconds, for the prefill pressure."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, float]] = deque()

    def add(self, now: float, ttft_s: float) -> None:
        self._seen.append((now, ttft_s))

    def p90(self, now: float) -> float:
        while self._seen and now - self._seen[0][0] > self.window_s:
            self._seen.popleft()
        if not self._seen:
            return 0.0
        ordered = sorted(t for _, t in self._seen)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def pool_signals(members: list[PoolMember], recent_ttft_s: float = 0.0) -> Signals:
    """The signals of the router's view of its workers (or a simulated cluster's)."""
    prefills = [m.load for m in members if m.role == "prefill"]
    decodes = [m.load for m in members if m.role == "decode"]
    step_s = max((w.step_latency_ewma_ms / 1e3 for w in decodes if w.running), default=0.0)
    kv = max((w.kv_usage for w in decodes), default=0.0)
    return Signals(len(prefills), len(decodes), _longest_queue_s(prefills), step_s, kv, recent_ttft_s,
                   _longest_queue_s(decodes))


def _longest_queue_s(loads: list[WorkerLoad]) -> float:
    """How long the longest queue of prompt tokens takes: steps to go, times a step."""
    return max((w.queued_prefill_tokens / max(1, w.step_token_budget) * w.step_latency_ewma_ms / 1e3
                for w in loads), default=0.0)


def to_move(members: list[PoolMember], move: Move) -> PoolMember:
    """The worker to move: the least busy of the pool it leaves."""
    leaving = "decode" if move == "to_prefill" else "prefill"
    return min((m for m in members if m.role == leaving),
               key=lambda m: (m.load.running + m.load.waiting, m.load.queued_prefill_tokens))


def new_role(move: Move) -> str:
    return "prefill" if move == "to_prefill" else "decode"


def pressures(s: Signals, p: RebalancePolicy) -> tuple[float, float]:
    """(prefill pressure, decode pressure): 1 means at target."""
    prefill = max(s.prefill_queue_s, s.recent_ttft_s) / p.ttft_target_s
    decode = max(s.decode_step_s / p.tpot_target_s, s.decode_kv_usage / p.hot_kv_usage,
                 s.decode_queue_s / p.ttft_target_s)
    return prefill, decode


def _short_of_decoding(s: Signals, p: RebalancePolicy) -> bool:
    """Decode workers short of decoding itself (steps past the TPOT target, or KV past the hot
    threshold) while prompts queue neither on prefill workers nor on decode workers: first tokens
    that are late all the same wait for decode workers' KV or steps, and another decode worker is
    what helps them, however late they are. (Prompts queued on decode workers are the prefill
    pool's overflow: fewer prefill workers would only add to them.)"""
    decoding = max(s.decode_step_s / p.tpot_target_s, s.decode_kv_usage / p.hot_kv_usage)
    return decoding > p.high and max(s.prefill_queue_s, s.decode_queue_s) / p.ttft_target_s < p.low


def decide(s: Signals, p: RebalancePolicy, state: ControllerState, now: float) -> Decision:
    """Whether to move a worker now; updates `state` (its want, and the move when there is one)."""
    pp, dp = pressures(s, p)
    said = f"prefill at {pp:.2f}x its target (TTFT p90 {s.recent_ttft_s:.2f}s, queue {s.prefill_queue_s:.2f}s), " \
           f"decode at {dp:.2f}x " \
           f"(step {s.decode_step_s * 1e3:.0f}ms, KV {s.decode_kv_usage:.0%}, queue {s.decode_queue_s:.2f}s), " \
           f"split {s.prefill_workers}P:{s.decode_workers}D"
    if pp > p.high and dp < p.low and s.decode_workers > p.min_decode:
        want: Move | None = "to_prefill"
    elif s.prefill_workers > p.min_prefill and (dp > p.high and pp < p.low or _short_of_decoding(s, p)):
        want = "to_decode"
    else:
        want = None
    if want != state.wanted:
        state.wanted, state.since = want, now
    if want is None and max(pp, dp) > p.high:
        return Decision(None, f"blocked: a pool is past its target, the other cannot give a worker: {said}",
                        "blocked")
    if want is None:
        return Decision(None, f"balanced: {said}", "balanced")
    if now - state.since < p.confirm_s:
        return Decision(None, f"{want} asked for {now - state.since:.0f}s of {p.confirm_s:.0f}: {said}", "confirming",
                        want)
    if now - state.last_move_at < p.dwell_s:
        return Decision(None, f"{want} held: {now - state.last_move_at:.0f}s since the last move of "
                              f"{p.dwell_s:.0f}: {said}", "dwelling", want)
    state.last_move_at, state.wanted = now, None
    state.moves[want] += 1
    return Decision(want, said, "moving", want)
