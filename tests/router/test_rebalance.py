"""The P:D controller's rule, on an injected clock: it moves a worker only when one pool is pressed
and the other relaxed, only after the need held, never twice within its dwell, never below a
pool's minimum, and the hysteresis gap keeps it from oscillating."""

from __future__ import annotations

import random

from pdserve.router.rebalance import ControllerState, RebalancePolicy, Signals, decide, pressures

POLICY = RebalancePolicy(ttft_target_s=2.0, tpot_target_s=0.1, confirm_s=10, dwell_s=60)


def signals(prefill_queue_s=0.0, decode_step_s=0.02, kv=0.1, p=2, d=2) -> Signals:
    return Signals(p, d, prefill_queue_s, decode_step_s, kv)


def run(state: ControllerState, s: Signals, start: float, until: float, every: float = 1.0) -> list[tuple[float, str]]:
    moves, t = [], start
    while t <= until:
        decision = decide(s, POLICY, state, t)
        if decision.move:
            moves.append((t, decision.move))
        t += every
    return moves


def test_pressures_are_against_the_targets():
    assert pressures(signals(prefill_queue_s=3.0, decode_step_s=0.05, kv=0.17), POLICY) == (1.5, 0.5)
    assert pressures(signals(decode_step_s=0.01, kv=0.85), POLICY)[1] == 1.0  # KV use counts too


def test_a_pressed_prefill_pool_takes_a_relaxed_decode_worker_once_the_need_held():
    state = ControllerState()
    moves = run(state, signals(prefill_queue_s=4.0), 0, 9)
    assert moves == []  # asked for 9 s of 10
    d = decide(signals(prefill_queue_s=4.0), POLICY, state, 10)
    assert d.move == "to_prefill" and "prefill at 2.00x" in d.reason and "2P:2D" in d.reason
    assert state.moves == {"to_prefill": 1, "to_decode": 0}


def test_each_decision_says_its_stage_and_what_the_signals_want():
    """The router logs the controller's changes of mind by these (balanced, blocked, confirming,
    dwelling, moving), so that a run that moved nothing says why."""
    state, pressed = ControllerState(), signals(prefill_queue_s=4.0)
    seen = [(d.stage, d.wanted, d.move) for d in (
        decide(signals(), POLICY, state, 0), decide(pressed, POLICY, state, 1), decide(pressed, POLICY, state, 11),
        decide(pressed, POLICY, state, 30), decide(pressed, POLICY, state, 45))]
    assert seen == [("balanced", None, None), ("confirming", "to_prefill", None), ("moving", "to_prefill", "to_prefill"),
                    ("confirming", "to_prefill", None),  # a need is confirmed afresh after a move
                    ("dwelling", "to_prefill", None)]  # confirmed, 34 s into the 60 s dwell
    both = decide(signals(prefill_queue_s=4.0, decode_step_s=0.2), POLICY, state, 46)
    assert both.stage == "blocked" and both.move is None and "prefill at 2.00x" in both.reason


def test_a_need_that_goes_away_starts_over():
    state = ControllerState()
    assert run(state, signals(prefill_queue_s=4.0), 0, 8) == []
    assert decide(signals(), POLICY, state, 9).move is None  # balanced for a moment
    assert run(state, signals(prefill_queue_s=4.0), 10, 19) == []  # the 10 s count from 10
    assert decide(signals(prefill_queue_s=4.0), POLICY, state, 20).move == "to_prefill"


def test_no_move_within_the_dwell_and_the_reason_says_so():
    state = ControllerState()
    pressed = signals(prefill_queue_s=4.0, p=1, d=4)
    assert run(state, pressed, 0, 10) == [(10, "to_prefill")]
    assert run(state, pressed, 11, 40) == []  # a need is confirmed afresh after a move (from 11)...
    held = decide(pressed, POLICY, state, 41)
    assert held.move is None and "held" in held.reason  # ... and then waits out the dwell
    assert run(state, pressed, 42, 100) == [(70, "to_prefill")]


def test_both_pools_pressed_or_both_relaxed_move_nothing():
    state = ControllerState()
    assert run(state, signals(prefill_queue_s=4.0, decode_step_s=0.2), 0, 100) == []
    assert run(state, signals(prefill_queue_s=0.5, decode_step_s=0.02), 101, 200) == []
    assert run(state, signals(prefill_queue_s=1.5, decode_step_s=0.02), 201, 300) == []  # 0.75x: not past high


def test_late_first_tokens_with_short_prefill_queues_ask_for_decode_workers():
    """First tokens are late (p90 6 s against 2 s) but no prompt is queued anywhere: they wait on
    decode workers whose KV is full. Another decode worker is what helps, so a prefill worker
    moves, though the prefill pool looks pressed by its TTFT; with a prefill queue behind those
    late first tokens, or prompts queued on the decode workers, nothing moves."""
    kv_bound = Signals(2, 2, prefill_queue_s=0.3, decode_step_s=0.05, decode_kv_usage=0.98, recent_ttft_s=6.0)
    assert run(ControllerState(), kv_bound, 0, 30) == [(10, "to_decode")]
    queued = Signals(2, 2, prefill_queue_s=3.0, decode_step_s=0.05, decode_kv_usage=0.98, recent_ttft_s=6.0)
    assert run(ControllerState(), queued, 0, 30) == []
    # prompts queued on the decode workers are the prefill pool's overflow: fewer prefill workers
    # would only add to them, so nothing moves
    overflow = Signals(2, 2, prefill_queue_s=0.3, decode_step_s=0.05, decode_kv_usage=0.98, recent_ttft_s=6.0,
                       decode_queue_s=9.0)
    assert run(ControllerState(), overflow, 0, 30) == []


def test_a_pool_is_never_emptied():
    assert run(ControllerState(), signals(prefill_queue_s=9.0, d=1), 0, 100) == []
    assert run(ControllerState(), signals(decode_step_s=0.5, p=1), 0, 100) == []


def test_the_hysteresis_gap_keeps_the_split_from_oscillating():
    """A load that swings each minute between favouring prefill and decode, just inside the gap,
    moves nothing; one that swings past both thresholds moves at most once per dwell."""
    state = ControllerState()
    moves = []
    for minute in range(10):
        mild = signals(prefill_queue_s=2.2, decode_step_s=0.06) if minute % 2 else signals(prefill_queue_s=1.2,
                                                                                            decode_step_s=0.11)
        moves += run(state, mild, minute * 60, minute * 60 + 59)
    assert moves == []
    state = ControllerState()
    moves = []
    for minute in range(10):
        strong = signals(prefill_queue_s=4.0) if minute % 2 else signals(decode_step_s=0.3)
        moves += run(state, strong, minute * 60, minute * 60 + 59)
    assert all(b[0] - a[0] >= POLICY.dwell_s for a, b in zip(moves, moves[1:]))
    assert len(moves) <= 10


def noisy(rng: random.Random, prefill_level: float, decode_level: float) -> Signals:
    """Signals around levels given as pressures (1: at target), with the noise of a live cluster:
    a relative spread of 30% and, now and then, a spike of three times the level."""
    def draw(level: float) -> float:
        return max(0.0, level * (3.0 if rng.random() < 0.03 else rng.gauss(1.0, 0.3)))
    return signals(prefill_queue_s=draw(prefill_level) * POLICY.ttft_target_s,
                   decode_step_s=draw(decode_level) * POLICY.tpot_target_s)


def test_noise_around_a_balanced_load_moves_nothing():
    """Two hours of a balanced load (both pools at 0.75x their targets) whose signals cross both
    thresholds again and again, spikes included: no need holds for `confirm_s`, nothing moves."""
    rng, state = random.Random(7), ControllerState()
    decisions = [decide(noisy(rng, 0.75, 0.75), POLICY, state, float(t)) for t in range(7200)]
    assert [d for d in decisions if d.move] == []
    assert sum(d.reason.startswith("to_") for d in decisions) > 50  # the noise did ask, again and again


def test_noise_on_a_real_shift_moves_one_way_only():
    """A load that turns prompt-heavy, noisy as above: the controller moves decode workers into
    prefill, at most once per dwell, and never back while the load stays where it is."""
    rng, state = random.Random(11), ControllerState()
    made = [d.move for t in range(3600) if (d := decide(noisy(rng, 1.6, 0.3), POLICY, state, float(t))).move]
    assert made and set(made) == {"to_prefill"}
    assert len(made) <= 3600 // POLICY.dwell_s + 1


def test_the_router_moves_a_worker_as_the_rule_says(tiny_llama):
    """With the controller on, a pressed prefill pool (as the heartbeats tell it) makes the router
    move its least busy decode worker to prefill: the worker changes role in place."""
    from pdserve.router.rebalance import pool_signals
    from pdserve.router.rounds import pool_members
    from pdserve.wire import WorkerStats
    from tests.router_server import RouterServer
    from tests.wait import wait_for
    from tests.worker.cluster import WorkerServer

    policy = RebalancePolicy(ttft_target_s=1.0, confirm_s=0.0, dwell_s=3600)
    with (WorkerServer(tiny_llama, "prefill", ["tcp"]) as p, WorkerServer(tiny_llama, "decode", ["tcp"]) as d1,
          WorkerServer(tiny_llama, "decode", ["tcp"]) as d2, RouterServer(tiny_llama, lease_s=600) as rs):
        members = [rs.join(w) for w in (p, d1, d2)]
        for m in members:
            m.stop()  # from here on the registry holds what this test says
        registry = rs.router.registry
        ids = {e.url: e.worker_id for e in registry.workers()}
        registry.heartbeat(ids[p.url], WorkerStats(role="prefill", queued_prefill_tokens=4096, step_token_budget=512,
                                                   step_latency_ewma_ms=400.0), rs.router.config.worker_token)
        registry.heartbeat(ids[d1.url], WorkerStats(role="decode", running=3, step_latency_ewma_ms=20.0),
                           rs.router.config.worker_token)
        registry.heartbeat(ids[d2.url], WorkerStats(role="decode", running=1, step_latency_ewma_ms=20.0),
                           rs.router.config.worker_token)
        s = pool_signals(pool_members(rs.router.registry))
        assert (s.prefill_workers, s.decode_workers, s.prefill_queue_s, s.decode_step_s) == (1, 2, 3.2, 0.02)
        assert rs.router.config.rebalance is None  # off unless asked for
        rs.router.config.rebalance = policy
        wait_for(lambda: d2.worker.role == "prefill", 30, "the less busy decode worker to become a prefill worker")
        assert d1.worker.role == "decode" and p.worker.role == "prefill"
        assert rs.router.metrics.rebalances.labels("to_prefill")._value.get() == 1
        assert rs.rounds.controller.moves == {"to_prefill": 1, "to_decode": 0}
