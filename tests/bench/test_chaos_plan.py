"""The chaos benchmark's pure parts: `--faults` parsed, the seeded fault plan, how a request is
judged from what its stream showed, and where a recovery's time went on a made-up timeline."""

from __future__ import annotations

import pytest

from pdserve.bench.chaos.faults import Injection
from pdserve.bench.chaos.load import RequestResult, StreamSeen, judge
from pdserve.bench.chaos.plan import (
    DEFAULT_FAULTS, FaultSpec, PlannedFault, parse_faults, plan_faults, rolling_restart_plan, worker_names,
)
from pdserve.bench.chaos.recovery import breakdown, unexpected_exits

WORKERS = worker_names(1, 2)


def test_the_default_faults_parse_and_bad_ones_are_refused():
    assert parse_faults(DEFAULT_FAULTS) == [FaultSpec("kill-worker"), FaultSpec("freeze-worker", 5.0),
                                            FaultSpec("kill-router"), FaultSpec("cut-kv"), FaultSpec("drain")]
    assert parse_faults(" freeze-worker , drain,") == [FaultSpec("freeze-worker", 5.0), FaultSpec("drain")]
    assert parse_faults("") == []
    for bad in ("explode", "kill-worker:3", "freeze-worker:x", "freeze-worker:0", "freeze-worker:-1",
                "freeze-worker:1000"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def test_worker_names_are_those_serve_gives():
    assert WORKERS == ["prefill worker 0", "decode worker 1", "decode worker 2"]


def test_a_seed_gives_one_plan_spread_over_the_run_in_the_order_asked():
    specs = parse_faults(DEFAULT_FAULTS)
    plan = plan_faults(specs, 100.0, WORKERS, seed=7)
    assert plan == plan_faults(specs, 100.0, WORKERS, seed=7)
    assert plan != plan_faults(specs, 100.0, WORKERS, seed=8)
    assert [f.kind for f in plan] == [s.kind for s in specs]
    times = [f.at_s for f in plan]
    assert times == sorted(times) and 15.0 <= times[0] and times[-1] <= 75.0
    slot = 60.0 / len(specs)
    for i, t in enumerate(times):  # each in the first half of its own slot: the second is its recovery's
        assert 15.0 + i * slot <= t <= 15.0 + (i + 0.5) * slot + 1e-9
    assert next(f for f in plan if f.kind == "kill-router").target == "router"
    assert all(f.target in WORKERS for f in plan if f.kind != "kill-router")
    assert next(f for f in plan if f.kind == "freeze-worker").seconds == 5.0
    targets = {f.target for seed in range(30) for f in plan_faults(specs, 100.0, WORKERS, seed) if f.kind == "drain"}
    assert targets == set(WORKERS)  # the seed reaches every worker


def test_a_plan_needs_workers_and_a_duration():
    with pytest.raises(ValueError):
        plan_faults(parse_faults("drain"), 10.0, [], 0)
    with pytest.raises(ValueError):
        plan_faults(parse_faults("drain"), 0.0, WORKERS, 0)


def test_a_rolling_restart_drains_every_worker_in_order():
    plan = rolling_restart_plan(WORKERS, 60.0)
    assert [(f.kind, f.target) for f in plan] == [("drain", w) for w in WORKERS]
    assert plan[0].at_s == 9.0 and all(f.at_s == 0.0 for f in plan[1:])


@pytest.mark.parametrize("seen, hung, outcome", [
    (StreamSeen(done=True, usage_tokens=8), False, "ok"),
    (StreamSeen(status=503, error="overloaded"), False, "error"),
    (StreamSeen(error="server_error", usage_tokens=3), False, "error"),
    (StreamSeen(broken="RemoteProtocolError", text_chunks=2), False, "error"),
    (StreamSeen(), True, "lost"),  # a hang
    (StreamSeen(usage_tokens=8), False, "lost"),  # ended without [DONE] and without an error
    (StreamSeen(done=True, usage_tokens=5), False, "lost"),  # short, with ignore_eos, no error
    (StreamSeen(done=True, text_chunks=5), False, "lost"),
    (StreamSeen(done=True, usage_tokens=8, malformed="{oops"), False, "lost"),
])
def test_a_request_is_judged_by_what_its_stream_showed(seen, hung, outcome):
    assert judge(seen, 8, hung)[0] == outcome


def _sample(at, registered, stats, router_up=True):
    return {"at": at, "router_up": router_up, "registered": registered, "stats": stats}


def _result(start, end, outcome="ok"):
    r = RequestResult(0, 0, 8, start, end)
    r.outcome = outcome
    return r


def test_a_killed_worker_s_recovery_is_broken_down_from_events_and_samples():
    old, new = "http://w:1", "http://w:2"
    fault = PlannedFault(1.0, "kill-worker", "decode worker 1")
    injection = Injection(fault, at=100.0, pid=5, url=old, recovered_at=109.0)
    events = [{"event": "exited", "name": "decode worker 1", "code": -9, "at": 100.5},
              {"event": "exited", "name": "decode worker 1", "code": -9, "at": 50.0},  # before: not this one
              {"event": "restarted", "name": "decode worker 1", "pid": 6, "at": 101.0},
              {"event": "ready_again", "name": "decode worker 1", "pid": 6, "url": new, "load_seconds": 2.0,
               "at": 106.0}]
    serving = {"state": "serving", "heartbeat_age_s": 0.1, "role": "decode"}
    samples = [_sample(99.5, {old: serving}, {old: {"num_steps": 40}}),
               _sample(100.2, {old: serving}, {}),
               _sample(102.0, {}, {}),
               _sample(107.0, {new: serving}, {new: {"num_steps": 0}}),
               _sample(109.0, {new: serving}, {new: {"num_steps": 3}})]
    results = [_result(99.0, 100.4, "error"), _result(99.0, 101.0), _result(110.0, 111.0)]
    b = breakdown(injection, events, samples, results, workers=2)
    assert b["marks_s"] == {"exit seen": 0.5, "dropped by the router": 2.0, "restarted": 1.0,
                            "process started": 4.0, "model loaded": 6.0, "registered": 7.0, "serving": 9.0}
    assert b["steps_s"] == {"exit seen": 0.5, "dropped by the router": 1.5, "restarted": 0.0, "process started": 2.0,
                            "model loaded": 2.0, "registered": 1.0, "serving": 2.0}
    assert b["total_s"] == 9.0 and b["recovered"] and b["exit_code"] == -9
    assert b["requests_meanwhile"] == {"ok": 1, "error": 1, "lost": 0}


def test_router_and_freeze_and_cut_recoveries():
    w = "http://w:1"
    serving = {"state": "serving", "heartbeat_age_s": 0.2, "role": "decode"}
    router = Injection(PlannedFault(0, "kill-router", "router"), at=10.0, pid=1, url="http://r", recovered_at=13.0)
    events = [{"event": "exited", "name": "router", "code": -9, "at": 10.4},
              {"event": "restarted", "name": "router", "pid": 2, "at": 11.0},
              {"event": "ready_again", "name": "router", "pid": 2, "url": "http://r", "load_seconds": None, "at": 12.0}]
    samples = [_sample(11.0, {}, {}, router_up=False), _sample(12.5, {w: serving}, {})]
    b = breakdown(router, events, samples, [_result(11.0, 11.5, "error"), _result(12.1, 12.8)], workers=1)
    assert b["marks_s"] == {"exit seen": 0.4, "restarted": 1.0, "listening": 2.0, "workers registered": 2.5,
                            "first request served": 2.8}
    freeze = Injection(PlannedFault(0, "freeze-worker", "decode worker 1", 3.0), at=20.0, pid=3, url=w,
                       resumed_at=23.0, recovered_at=23.5)
    samples = [_sample(19.5, {w: serving}, {w: {"num_steps": 10}}),
               _sample(22.0, {w: {**serving, "heartbeat_age_s": 2.0}}, {}),
               _sample(23.5, {w: {**serving, "heartbeat_age_s": 0.1}}, {w: {"num_steps": 12}})]
    assert breakdown(freeze, [], samples, [], 1)["marks_s"] == {"resumed": 3.0, "heartbeat again": 3.5,
                                                                 "serving": 3.5}
    cut = Injection(PlannedFault(0, "cut-kv", "prefill worker 0"), at=30.0, pid=4, url="http://p",
                    recovered_at=30.1)
    samples = [_sample(29.8, {}, {w: {"kv_landed": 5}}), _sample(30.5, {}, {w: {"kv_landed": 5}}),
               _sample(31.0, {}, {w: {"kv_landed": 6}})]
    assert breakdown(cut, [], samples, [_result(30.2, 30.9)], 1)["marks_s"] == {
        "KV landed again": 1.0, "first request served": 0.9}


def test_an_exit_no_fault_explains_is_unexpected():
    injections = [Injection(PlannedFault(0, "kill-worker", "decode worker 1"), at=5.0, pid=1, url=""),
                  Injection(PlannedFault(0, "freeze-worker", "prefill worker 0", 2.0), at=9.0, pid=2, url="")]
    events = [{"event": "exited", "name": "decode worker 1", "code": -9, "at": 5.2},
              {"event": "exited", "name": "prefill worker 0", "code": 1, "at": 9.5},
              {"event": "restarted", "name": "prefill worker 0", "at": 10.0}]
    assert unexpected_exits(events, injections, after=0.0) == [{"name": "prefill worker 0", "code": 1}]


def test_kill_router_hits_one_of_the_replicas():
    from pdserve.bench.chaos.plan import router_names

    assert router_names(1) == ["router"] and router_names(2) == ["router 0", "router 1"]
    specs = parse_faults("kill-router")
    hit = {plan_faults(specs, 100.0, WORKERS, seed, routers=router_names(2))[0].target for seed in range(30)}
    assert hit == {"router 0", "router 1"}
    assert plan_faults(specs, 100.0, WORKERS, 3)[0].target == "router"


def test_errors_are_told_apart_by_cause():
    from pdserve.bench.chaos.causes import errors_by_cause

    kill = Injection(PlannedFault(0, "kill-router", "router 1"), at=10.0, pid=1, url="")
    refused = _result(10.1, 10.1, "error")
    refused.refused = True
    on_the_router = _result(9.0, 10.2, "error")  # running when the router died
    on_the_router.detail = "connection broke: RemoteProtocolError"
    later = _result(11.0, 12.0, "error")  # begun after the kill: the cluster failed it all the same
    later.detail = "error in the stream: server_error"
    ok = _result(9.0, 11.0)
    out = errors_by_cause([refused, on_the_router, later, ok], [kill])
    assert out == {"refused": 1, "in_flight": 1, "later": 1, "in_flight_by_fault": {"kill-router": 1},
                   "later_details": {"error in the stream: server_error": 1}}
