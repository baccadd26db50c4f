"""`pdserve simulate-trace`: a trace's windows become seeded Poisson arrivals (rates, lengths and
time scaling per window), and the controller, the best static split and 1:1 run on the same ones."""

from __future__ import annotations

import json

from pdserve.workload.loadgen import LengthDist
from pdserve.sim import trace_sim as ts
from pdserve.sim.plan_trace import Window
from pdserve.sim.trace_sim_cli import main

WINDOWS = [Window(0.0, 10.0, LengthDist.parse("100"), LengthDist.parse("20")),
           Window(3600.0, 40.0, LengthDist.parse("900-1100"), LengthDist.parse("5"))]


def test_each_window_arrives_at_its_rate_with_its_lengths_in_compressed_time():
    bounds = ts.window_bounds(WINDOWS, time_scale=60)
    assert bounds == [(0.0, 60.0), (60.0, 120.0)]  # an hour in 60 s; the last as long as the one before
    got = ts.arrivals(WINDOWS, time_scale=60, load_scale=1.0, seed=0)
    assert got == sorted(got, key=lambda a: a.at_s)
    for i, (start, end) in enumerate(bounds):
        mine = [a for a in got if a.window == i]
        assert all(start <= a.at_s < end for a in mine)
        expected = WINDOWS[i].qps * (end - start)  # Poisson: within 4 standard deviations
        assert abs(len(mine) - expected) < 4 * expected ** 0.5, (i, len(mine))
    assert {a.isl for a in got if a.window == 0} == {100} and {a.osl for a in got if a.window == 0} == {20}
    assert all(900 <= a.isl <= 1100 and a.osl == 5 for a in got if a.window == 1)


def test_the_load_scale_multiplies_rates_and_the_seed_repeats_them():
    once = ts.arrivals(WINDOWS, 60, 1.0, seed=3)
    assert once == ts.arrivals(WINDOWS, 60, 1.0, seed=3)
    twice = ts.arrivals(WINDOWS, 60, 2.0, seed=3)
    assert abs(len(twice) / len(once) - 2) < 0.15
    real_time = ts.arrivals(WINDOWS[:1], 1, 1.0, seed=0)  # an hour at 10 req/s: 36000 requests
    assert abs(len(real_time) - 36000) < 4 * 36000 ** 0.5 and real_time[-1].at_s < 3600


def test_static_splits_are_a_grid_with_1_to_1_then_refined_next_to_the_best():
    assert ts.static_grid(8, 8) == [1, 2, 3, 4, 5, 6, 7]
    assert ts.static_grid(64, 6) == [1, 12, 23, 32, 34, 45, 56, 63]
    assert ts.refine({1: (50.0, 1.0), 12: (90.0, 2.0), 23: (70.0, 1.5)}, 64) == [6, 18]
    assert ts.refine({5: (90.0, 1.0), 6: (91.0, 1.0), 7: (80.0, 1.0)}, 8) == []


def test_moves_are_counted_per_trace_hour_and_reversals_show_oscillation():
    moves = [{"at_s": 1.0, "to": "prefill"}, {"at_s": 14.0, "to": "prefill"}, {"at_s": 16.0, "to": "decode"}]
    assert ts.moves_per_hour(moves, time_scale=240, hours=3) == [2, 1, 0]  # an hour is 15 s
    assert ts.reversals(moves) == 1


def test_a_shift_to_long_prompts_moves_workers_to_prefill_and_all_three_are_reported(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"step": {"base_s": 0.010, "prefill_token_s": 0.001, "decode_seq_s": 0.020},
                                   "kv_bytes_per_token": 1000}))
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,qps,isl,osl\n0,1,100,40\n3600,2,1000,4\n")  # short prompts, then long
    out = tmp_path / "result.json"
    assert main(["--trace", str(trace), "--profile", str(profile), "--workers", "4", "--load-scale", "1",
                 "--time-scale", "60", "--chunk-tokens", "512", "--min-remote-tokens", "64",
                 "--json", str(out), "--plot-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    ctrl = result["controller"]
    assert ctrl["start"] == "2P:2D" and result["one_to_one"]["start"] == "2P:2D"
    assert {k for k in result if k in ("controller", "best_static", "one_to_one")} == \
        {"controller", "best_static", "one_to_one"}
    assert set(result["static_tried"]) == {"1", "2", "3"}  # 4 workers: every split
    assert ctrl["moves"] and all(m["to"] == "prefill" for m in ctrl["moves"] if m["at_s"] >= 60)
    assert ctrl["splits"][-1]["prefill"] >= 3 and ctrl["moves_per_hour"]["reversals"] == 0
    last = lambda key: result[key]["windows"][1]["sla_attainment_pct"]  # noqa: E731
    assert last("controller") > last("one_to_one")
    for key in ("controller", "best_static", "one_to_one"):
        assert result[key]["overall"]["completed"] == result[key]["overall"]["requests"] > 0
    assert (tmp_path / "simulate_trace.png").exists()
