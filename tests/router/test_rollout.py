"""The canary rollout's rules, on a clock the test moves: its share of new requests step by step,
advancing while the canary's error ratio and SLA attainment hold against stable's, promoted after
the last step, rolled back the moment they do not (or when its workers are gone); pause, resume,
promote and abort by hand, and commands that do not fit the state refused."""

from __future__ import annotations

import random
import types

import pytest

from pdserve.router.rollout import Rollout, RolloutError, RolloutPolicy

POLICY = RolloutPolicy(steps=(0.1, 0.5, 1.0), step_s=10, min_requests=5, max_error_increase=0.01,
                       max_attainment_drop=0.05, min_errors=3, lost_s=5)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def rollout() -> tuple[Rollout, Clock]:
    clock = Clock()
    r = Rollout(clock=clock, rng=random.Random(7))
    r.first_version("v1")
    r.first_version("v2")  # only the first worker's version is stable
    r.start("v2", POLICY)
    return r, clock


def serve(r: Rollout, version: str, n: int, failed: int = 0, met: bool = True) -> None:
    for i in range(n):
        r.call_ended(version, failed=i < failed)
        if i >= failed:
            r.request_finished(version, met)


def test_a_healthy_canary_takes_each_step_and_is_promoted():
    r, clock = rollout()
    assert r.stable == "v1" and r.share == 0.1
    picks = [r.pick() for _ in range(2000)]
    assert 0.07 < picks.count("v2") / 2000 < 0.13 and set(picks) == {"v1", "v2"}
    for share in (0.1, 0.5):
        serve(r, "v1", 40)
        serve(r, "v2", 5)
        clock.now += 9.9
        assert r.tick(canary_workers=1) is None  # the step's time is not up
        clock.now += 0.2
        assert r.tick(canary_workers=1) == "advanced"
    assert r.share == 1.0 and r.pick() == "v2"
    clock.now += 10
    assert r.tick(1) is None  # too few canary requests in the last step
    serve(r, "v2", 5)
    assert r.tick(1) == "promoted"
    assert (r.stable, r.state, r.share, r.pick()) == ("v2", "promoted", 0.0, "v2")
    assert [e["event"] for e in r.status()["events"]] == ["started", "advanced", "advanced", "promoted"]


def test_a_failing_canary_is_rolled_back_at_once():
    r, clock = rollout()
    serve(r, "v1", 100, failed=1)
    serve(r, "v2", 2, failed=2)
    assert r.tick(1) is None  # fewer failures than min_errors: not yet evidence
    serve(r, "v2", 1, failed=1)
    assert r.tick(1) == "rolled_back"
    assert r.share == 0.0 and r.pick() == "v1" and r.stable == "v1"
    assert "error ratio 1.000" in r.status()["events"][-1]["why"]


def test_errors_at_stable_s_ratio_do_not_roll_back():
    r, clock = rollout()
    serve(r, "v1", 100, failed=10)
    serve(r, "v2", 40, failed=4)  # 10%, as stable
    clock.now += 10
    assert r.tick(1) == "advanced"


def test_a_slow_canary_is_rolled_back_at_its_step_s_end():
    r, clock = rollout()
    serve(r, "v1", 50)
    serve(r, "v2", 10, met=False)
    assert r.tick(1) is None  # attainment is judged over the whole step
    clock.now += 10
    assert r.tick(1) == "rolled_back" and "SLA attainment 0.000" in r.status()["events"][-1]["why"]


def test_a_canary_without_workers_is_rolled_back_after_lost_s():
    r, clock = rollout()
    clock.now += 4
    assert r.tick(canary_workers=0) is None
    clock.now += 1
    assert r.tick(canary_workers=0) == "rolled_back"


def test_by_hand_pause_resume_promote_abort():
    r, clock = rollout()
    r.pause()
    serve(r, "v2", 10, failed=10)  # not counted while paused, and no rollback
    assert r.tick(1) is None and r.share == 0.1
    with pytest.raises(RolloutError, match="paused, not running"):
        r.pause()
    r.resume()
    assert r.state == "running"
    r.abort()
    assert (r.state, r.share, r.stable) == ("aborted", 0.0, "v1")
    with pytest.raises(RolloutError, match="no rollout"):
        r.promote()
    r.start("v2", POLICY)
    r.promote()
    assert (r.state, r.stable) == ("promoted", "v2")
    with pytest.raises(RolloutError, match="stable version already"):
        r.start("v2", POLICY)


def test_refusals():
    with pytest.raises(RolloutError, match="no stable version"):
        Rollout().start("v2", POLICY)
    r, _ = rollout()
    with pytest.raises(RolloutError, match="under way"):
        r.start("v3", POLICY)
    for bad in (dict(steps=(0.5, 0.2, 1.0)), dict(steps=(0.5,)), dict(steps=()), dict(step_s=0),
                dict(max_error_increase=2), dict(min_requests=0)):
        with pytest.raises(ValueError):
            RolloutPolicy(**bad)


def test_the_leader_judges_on_its_peers_counts_of_the_same_step():
    import msgspec

    from pdserve.router.peer_state import PeerState, follow_rollout, own_state, peers_tallies

    class Routerish:  # what own_state reads of a router (no relief: no streams to tell of)
        def __init__(self, rollout):
            self.rollout, self.shadow = rollout, None
            self.config = types.SimpleNamespace(migrate_hot_spots=False)

    leader, clock = rollout()
    follower = Rollout(clock=clock)
    follow_rollout(follower, own_state(Routerish(leader)).rollout)
    assert (follower.id, follower.share, follower.stable) == (leader.id, 0.1, "v1")
    serve(follower, "v2", 5, failed=3)  # the follower saw the canary fail; the leader saw nothing
    serve(follower, "v1", 5)
    peers = peers_tallies([own_state(Routerish(follower))], leader)
    assert leader.tick(canary_workers=1) is None
    assert leader.tick(canary_workers=1, peers=peers) == "rolled_back"
    stale = PeerState(rollout=msgspec.structs.replace(own_state(Routerish(follower)).rollout, step=1))
    assert peers_tallies([stale], leader) == []  # another step's counts are not this one's
