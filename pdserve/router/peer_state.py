"""What the routers of one cluster tell each other every round, and how a follower keeps to its
leader: the versions' state the admin API set, so every router routes alike.

Each router answers GET /internal/peer (worker token: the routers of a cluster share it) with
`PeerState`; each asks every peer for it once a round (`peers.py`), which is also how it knows
who is alive. Then:
- a follower takes its leader's rollout (its id, state, stable and canary versions, step and
  policy) and shadow settings as its own: the canary gets the same share of new requests from
  every router, and every router copies the same share to the shadow. The leader's step keeps
  its age, so a follower that becomes the leader mid-step goes on where the step was;
- the leader judges a step on the outcomes of every router: each router counts the calls and
  requests of the step (rollout id and step) it saw, and the leader adds its followers' counts
  for the same step to its own (`Rollout.tick`).
- hot-spot relief is the leader's for every router's streams: each router tells the others its
  movable streams on decode workers past the hot threshold (or draining), the leader chooses the
  moves among all of them, and asks the router that follows a stream to move it (POST
  /internal/move): that router takes the stream's next call to the target, as its own relief does.
Admin calls reaching a follower are answered by the leader (`admin.py`): only the leader changes
this state. A shadow report covers the copies the router answering it made (the leader's).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from pdserve import wire
from pdserve.router.rollout import STATES, Rollout, RolloutPolicy, Tally

Label = Annotated[str, Meta(max_length=64, pattern=wire.VERSION_LABEL)]
Share = Annotated[float, Meta(ge=0, le=1)]
MAX_VERSIONS = 64
MAX_STREAMS = 1024  # hot workers' streams a router tells its peers of, at most


class RolloutView(wire.Message):
    id: Annotated[str, Meta(max_length=32, pattern=r"^[0-9a-f]*\Z")] = ""
    state: Annotated[str, Meta(pattern="^(" + "|".join(STATES) + r")\Z")] = "idle"
    stable: Label | None = None
    canary: Label | None = None
    step: Annotated[int, Meta(ge=0, lt=16)] = 0
    steps: Annotated[tuple[Annotated[float, Meta(gt=0, le=1)], ...], Meta(min_length=1, max_length=16)] = (1.0,)
    step_s: Annotated[float, Meta(gt=0, le=86_400)] = 60.0
    min_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 20
    max_error_increase: Share = 0.01
    max_attainment_drop: Share = 0.05
    min_errors: Annotated[int, Meta(ge=1, le=1_000_000)] = 3
    lost_s: Annotated[float, Meta(gt=0, le=86_400)] = 30.0
    step_age_s: wire.Seconds = 0.0


class StepTally(wire.Message):
    calls: wire.Count = 0
    failed_calls: wire.Count = 0
    finished: wire.Count = 0
    sla_met: wire.Count = 0


class ShadowView(wire.Message):
    version: Label
    share: Annotated[float, Meta(gt=0, le=1)]
    max_concurrency: Annotated[int, Meta(ge=1, le=1024)]
    timeout_s: Annotated[float, Meta(gt=0, le=86_400)]


class PeerStream(wire.Message):
    """A router's stream that relief could move: on which worker (by URL: ids are each router's own)."""

    stream_id: wire.RequestId
    worker_url: wire.Url
    context_tokens: wire.Count
    remaining_tokens: wire.Count


class PeerMove(wire.Message):
    """The leader's relief, to the router following `stream_id`: move it to the worker at `target_url`."""

    stream_id: wire.RequestId
    worker_url: wire.Url  # where the leader saw it: a stream that moved meanwhile stays
    target_url: wire.Url


class PeerState(wire.Message):
    rollout: RolloutView
    tallies: Annotated[dict[Label, StepTally], Meta(max_length=MAX_VERSIONS)] = {}  # of the step in `rollout`
    shadow: ShadowView | None = None
    streams: Annotated[list[PeerStream], Meta(max_length=MAX_STREAMS)] = []  # movable, on hot workers


def rollout_view(rollout: Rollout) -> RolloutView:
    with rollout.lock:
        p = rollout.policy
        return RolloutView(id=rollout.id, state=rollout.state, stable=rollout.stable, canary=rollout.canary,
                           step=rollout.step, steps=p.steps, step_s=p.step_s, min_requests=p.min_requests,
                           max_error_increase=p.max_error_increase, max_attainment_drop=p.max_attainment_drop,
                           min_errors=p.min_errors, lost_s=p.lost_s,
                           step_age_s=max(0.0, rollout.clock() - rollout.step_started) if rollout.id else 0.0)


def own_state(router) -> PeerState:
    """What this router tells its peers."""
    rollout = router.rollout
    with rollout.lock:
        tallies = {v: StepTally(t.calls, t.failed_calls, t.finished, t.sla_met) for v, t in rollout.tallies.items()}
    shadow = router.shadow
    return PeerState(rollout=rollout_view(rollout), tallies=tallies,
                     shadow=None if shadow is None else ShadowView(shadow.version, shadow.share,
                                                                   shadow.max_concurrency, shadow.timeout_s),
                     streams=hot_streams(router))


def hot_streams(router) -> list[PeerStream]:
    """This router's movable streams on decode workers relief would move requests off (past the
    hot threshold of KV use, or draining), the largest first."""
    if not router.config.migrate_hot_spots:
        return []
    hot = router.config.decode_weights.hot_kv_usage
    urls = {w.worker_id: w.url for w in router.registry.workers("decode")
            if w.stats.draining or w.load.kv_usage > hot}
    streams = [PeerStream(s.request_id, urls[s.worker_id], max(0, s.context_tokens), max(0, s.remaining_tokens))
               for s in list(router.live.values()) if s.movable and s.worker_id in urls]
    return sorted(streams, key=lambda s: -s.context_tokens)[:MAX_STREAMS]


def follow_rollout(rollout: Rollout, view: RolloutView) -> None:
    """Take the leader's rollout as this router's own (its counts restart with each new step)."""
    policy = RolloutPolicy(view.steps, view.step_s, view.min_requests, view.max_error_increase,
                           view.max_attainment_drop, view.min_errors, view.lost_s)
    with rollout.lock:
        now = rollout.clock()
        if (rollout.id, rollout.step) != (view.id, view.step):
            rollout.tallies = {}
            rollout.canary_seen = now
        if rollout.id != view.id:
            rollout.started = now - view.step_age_s
        rollout.id, rollout.state, rollout.canary = view.id, view.state, view.canary
        rollout.stable = view.stable or rollout.stable  # None: no worker has reached the leader yet
        rollout.step, rollout.policy = view.step, policy
        rollout.step_started = now - view.step_age_s


def peers_tallies(states: list[PeerState], rollout: Rollout) -> list[dict[str, Tally]]:
    """The counts peers sent for this router's current rollout step (the leader adds them)."""
    key = (rollout.id, rollout.step)
    return [{v: Tally(t.calls, t.failed_calls, t.finished, t.sla_met) for v, t in s.tallies.items()}
            for s in states if (s.rollout.id, s.rollout.step) == key and s.rollout.id]
